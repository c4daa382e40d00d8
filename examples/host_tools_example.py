"""Host tools named in kernelmode.example.yaml (``tools:``), callable from kernel code.

    tools:
      - name: word_count
        function: "examples.host_tools_example:word_count"

Kernel code then calls ``tools.word_count(text="a b a", top=1)`` -> ``{"a": 2}``. The tool runs
in the manager (outside the sandbox); its JSON Schema, signature and description come from the
type hints and the docstring. The module must be importable by the manager's Python: run
``kernelmode serve`` from the repository root with ``PYTHONPATH=.`` (or ``python -m
kernelmode.cli serve``, which puts the working directory on ``sys.path``).
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime, timezone


def word_count(text: str, top: int = 10) -> dict[str, int]:
    """Count the words of a text; return the `top` most frequent, most frequent first."""
    words = re.findall(r"[\w']+", text.lower())
    return dict(Counter(words).most_common(max(top, 0)))


def utc_now() -> str:
    """The host's current time in UTC, ISO 8601 (kernels have no network to ask a time server)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
