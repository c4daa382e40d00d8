"""``pip download`` as a subprocess of the manager's venv: wheels only, for the kernel's target.

``--only-binary :all:`` with ``--platform``/``--python-version``/``--implementation``/``--abi``
of the kernel: pip never builds, so no code of a package runs on the host. The kernel's own
distributions (and those already in the session) go in as constraints, so the resolver either
keeps them or fails; it never picks another ipykernel or tornado. The download is watched and
pip stopped as soon as it passes ``max_download_mb``.

pip also reads a requirement as a file of its working directory when one by that name exists
(policy.parse_requirement refuses such names first): it runs in an empty private directory, as
``python -I -m pip --isolated`` with no PIP_* variables and no per-user configuration, so nothing
of the manager's directory, user or environment can steer it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidRequest, NoWheel, PackageFetchFailed, PackageRefused
from .target import KernelTarget

_DOWNLOADING = re.compile(r"Downloading \S+ \(([\d.]+) (bytes|kB|MB|GB)\)")
_UNITS = {"bytes": 1, "kB": 1000, "MB": 1000**2, "GB": 1000**3}
_NO_MATCH = re.compile(r"No matching distribution found for (\S+)")
STDERR_TAIL = 1500


@dataclass(frozen=True)
class FetchOptions:
    index_url: str | None
    extra_index_urls: tuple[str, ...]
    max_bytes: int
    timeout: float


def pip_argv(dest: Path, requirements: list[str], target: KernelTarget, constraints: Path,
             options: FetchOptions) -> list[str]:
    """The pip command line (a pure function, tested on its own)."""
    argv = [sys.executable, "-I", "-m", "pip", "download", "--isolated", "--no-cache-dir",
            "--dest", str(dest), "--no-input", "--disable-pip-version-check", "--progress-bar", "off", "--no-color",
            *target.pip_args(), "--constraint", str(constraints)]
    if options.index_url:
        argv += ["--index-url", options.index_url]
    for url in options.extra_index_urls:
        argv += ["--extra-index-url", url]
    return [*argv, "--", *requirements]


def pip_env() -> dict[str, str]:
    """The manager's environment without PIP_* (a PIP_FIND_LINKS would steer pip past the
    configured index; pip reads PIP_CONFIG_FILE even with --isolated). What is left of pip's
    configuration is the host's own files (/etc/pip.conf, the venv's pip.conf): root's, not a user's."""
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("PIP_")}


def _explain(stderr: str, target: KernelTarget) -> Exception:
    """Turn pip's failure into the error the caller gets."""
    tail = stderr.strip()[-STDERR_TAIL:]
    if "ResolutionImpossible" in stderr or "conflicting dependencies" in stderr:
        cause = "\n".join(line.strip() for line in stderr.splitlines()
                          if "depends on" in line or "requested" in line or "constraint" in line)
        return PackageRefused("the packages conflict with the kernel's own packages or with those already "
                              "installed in this session (rule: kernel packages are never replaced):\n"
                              + (cause or tail), details={"rule": "kernel_packages"})
    m = _NO_MATCH.search(stderr)
    if m:
        return NoWheel(f"no wheel of {m.group(1)} for the kernel ({target.describe()}) on the index, or no "
                       "such package: kernelmode installs wheels only and never builds a package on the "
                       "host (an sdist-only package cannot be installed)", details={"package": m.group(1)})
    if "Invalid requirement" in stderr:
        return InvalidRequest(tail)
    return PackageFetchFailed(f"pip download failed: {tail}")


async def download(dest: Path, requirements: list[str], target: KernelTarget, constraints: Path,
                   options: FetchOptions) -> list[Path]:
    """Run pip; return the wheels it put in ``dest``. Raises NoWheel, PackageRefused (a conflict,
    or the size cap) or PackageFetchFailed."""
    with tempfile.TemporaryDirectory(prefix="kernelmode-pip-") as cwd:  # empty, mode 0700
        return await _download(cwd, dest, requirements, target, constraints, options)


async def _download(cwd: str, dest: Path, requirements: list[str], target: KernelTarget, constraints: Path,
                    options: FetchOptions) -> list[Path]:
    argv = pip_argv(dest, requirements, target, constraints, options)
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, cwd=cwd, env=pip_env())
    assert proc.stdout is not None and proc.stderr is not None
    announced = 0
    over = False

    async def watch_stdout() -> None:
        nonlocal announced, over
        assert proc.stdout is not None
        async for raw in proc.stdout:
            m = _DOWNLOADING.search(raw.decode("utf-8", "replace"))
            if m:
                announced += int(float(m.group(1)) * _UNITS[m.group(2)])
                if announced > options.max_bytes and not over:
                    over = True
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()

    async def run() -> bytes:
        assert proc.stderr is not None
        out_task = asyncio.ensure_future(watch_stdout())
        err = await proc.stderr.read()
        await out_task
        await proc.wait()
        return err

    try:
        stderr = (await asyncio.wait_for(run(), options.timeout)).decode("utf-8", "replace")
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise PackageFetchFailed(f"pip download did not finish within {options.timeout:.0f} s "
                                 "(packages.timeout_seconds)") from None
    except BaseException:  # cancelled (the MCP call, the server stopping): no pip left behind
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        raise
    return _check_result(dest, over, proc.returncode, stderr, target, options)


def _check_result(dest: Path, over: bool, returncode: int | None, stderr: str, target: KernelTarget,
                  options: FetchOptions) -> list[Path]:
    wheels = sorted(dest.glob("*.whl"))
    total = sum(p.stat().st_size for p in wheels)
    if over or total > options.max_bytes:
        raise PackageRefused(f"the download is over packages.max_download_mb "
                             f"({options.max_bytes // (1024 * 1024)} MB)",
                             details={"rule": "max_download_mb"})
    if returncode != 0:
        raise _explain(stderr, target)
    others = [p.name for p in dest.iterdir() if p.suffix != ".whl"]
    if others:  # cannot happen with --only-binary; refuse rather than trust it
        raise NoWheel(f"the index gave files that are not wheels: {', '.join(others)}")
    return wheels
