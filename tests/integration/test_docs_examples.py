"""The examples of the README (and of any docs page) marked ``<!-- docs-example: LANG -->`` run
against a real server: a documented example that breaks fails the suite.

A marker may name what the example must print: ``<!-- docs-example: python, expect: "ok 7" -->``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Server

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- docs-example: (\w+)((?:, expect: \"[^\"]*\")*) -->\n```\w*\n(.*?)\n```", re.S)


def _examples() -> list[tuple[str, str, str, list[str]]]:
    found = []
    for page in PAGES:
        for i, m in enumerate(MARKER.finditer(page.read_text())):
            expects = re.findall(r'expect: "([^"]*)"', m.group(2))
            found.append((f"{page.relative_to(REPO)}#{i + 1}", m.group(1), m.group(3), expects))
    return found


EXAMPLES = _examples()


def test_the_readme_has_examples() -> None:
    assert sum(1 for name, *_ in EXAMPLES if name.startswith("README.md")) >= 3


@pytest.mark.parametrize(("name", "lang", "code", "expects"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_docs_example_runs(server: Server, tmp_path: Path, name: str, lang: str, code: str,
                           expects: list[str]) -> None:
    env = {**os.environ, "KERNELMODE_URL": server.url, "KERNELMODE_TOKEN": server.token}
    if lang == "python":
        cmd = [sys.executable, "-c", code]
    elif lang == "sh":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        pytest.fail(f"{name}: unknown example language {lang!r}")
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    for expected in expects:
        assert expected in proc.stdout, f"{name}: {expected!r} not in its output:\n{proc.stdout}"
