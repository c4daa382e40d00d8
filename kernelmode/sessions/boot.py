"""The code the manager runs in a new (or restarted) kernel to ready it: kernelmode's in-kernel
modules (kernel/preamble.py, file_agent.py, hints.py), each sent as source and loaded as a module
of its own, then ``install`` with the session's tool specs. Data goes in as literals made by
repr() and json.dumps, never pasted into code."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..sandbox.spec import WORKSPACE_MOUNT

if TYPE_CHECKING:
    from ..config import Settings
    from ..models import Limits

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernel"  # what runs inside kernels


@functools.cache
def _source_literal(name: str) -> str:
    """An in-kernel module's source as a Python literal: read and quoted once per process, not at
    every kernel start and every change of a session's tools."""
    return repr((KERNEL_DIR / name).read_text(encoding="utf-8"))


def boot_code(specs: list[dict[str, Any]], files_config: dict[str, Any] | None = None,
              hints_config: dict[str, Any] | None = None) -> str:
    """The code the manager runs in a kernel: this module, loaded as its own module (so that
    its helpers do not litter the user's namespace), then install(). Data goes in as string
    literals made by repr(), never pasted into code. ``files_config``: the file agent's bounds;
    ``hints_config``: what the error hints (kernel/hints.py) say."""
    files_config = files_config or {}
    # The file agent (kernel/file_agent.py) and the error hints (kernel/hints.py) once per kernel
    # process: the agent's baseline must survive a new set of tools.
    source, files_source, hints_source = (_source_literal(n) for n in ("preamble.py", "file_agent.py", "hints.py"))
    return (
        "def __kernelmode_boot(source, specs, files_source, files_config, hints_source, hints_config):\n"
        "    import json, sys, types\n"
        "    mod = types.ModuleType('kernelmode_preamble')\n"
        "    exec(compile(source, '<kernelmode preamble>', 'exec'), mod.__dict__)\n"
        "    sys.modules['kernelmode_preamble'] = mod\n"
        "    mod.install(specs, get_ipython().user_ns)\n"
        "    if 'kernelmode_files' not in sys.modules:\n"
        "        files = types.ModuleType('kernelmode_files')\n"
        "        exec(compile(files_source, '<kernelmode files>', 'exec'), files.__dict__)\n"
        "        sys.modules['kernelmode_files'] = files\n"
        "        files.install(get_ipython(), json.loads(files_config))\n"
        "    if 'kernelmode_hints' not in sys.modules:\n"
        "        hints = types.ModuleType('kernelmode_hints')\n"
        "        exec(compile(hints_source, '<kernelmode hints>', 'exec'), hints.__dict__)\n"
        "        sys.modules['kernelmode_hints'] = hints\n"
        "        hints.install(get_ipython(), json.loads(hints_config))\n"
        "    mod.ping()\n"
        f"__kernelmode_boot({source}, {json.dumps(specs)!r}, {files_source}, {json.dumps(files_config)!r}, "
        f"{hints_source}, {json.dumps(hints_config or {})!r})\n"
        "del __kernelmode_boot\n"
    )


def kernel_boot(specs: list[dict[str, Any]], settings: Settings, limits: Limits) -> str:
    """``boot_code`` with the bounds of the file agent and what the error hints say, from the
    server's settings and the kernel's limits."""
    files_config = {"root": WORKSPACE_MOUNT, "max_changes": settings.artifacts.max_artifacts_per_run}
    hints = {"installs": settings.packages.allow != [], "memory_mb": limits.memory_mb}
    return boot_code(specs, files_config, hints)


def snapshot_code(request: dict[str, Any]) -> str:
    """The code the manager runs (silently) in a kernel to save or restore its variables:
    kernel/snapshot.py, loaded as its own module (nothing of it lands in the user's namespace),
    then main(). Data goes in as a string literal made by repr(), never pasted into code."""
    return (
        "def __kernelmode_snapshot(source, request):\n"
        "    import sys, types\n"
        "    mod = sys.modules.get('kernelmode_snapshot')\n"
        "    if mod is None:\n"
        "        mod = types.ModuleType('kernelmode_snapshot')\n"
        "        exec(compile(source, '<kernelmode snapshot>', 'exec'), mod.__dict__)\n"
        "        sys.modules['kernelmode_snapshot'] = mod\n"
        "    mod.main(get_ipython(), request)\n"
        f"__kernelmode_snapshot({_source_literal('snapshot.py')}, {json.dumps(request)!r})\n"
        "del __kernelmode_snapshot\n"
    )
