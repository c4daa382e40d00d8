"""`kernelmode setup`: build the kernel environment, the venv whose Python runs every sandboxed
kernel (ipykernel and the libraries that code in a session can import).

`make setup` runs this too, so there is one way to build it. The venv is made with the system
Python and left readable by everyone (``a+rX``): as root, kernels run as other uids, which
cannot read a Python under /root or a 0700 home. A stamp file holding the hash of the
requirements makes a second run a quick check.

Every run (a quick one too) also writes the kernels' IPython configuration into the venv's
``etc/ipython`` (see install_ipython_config): one file that every kernel started from this venv
reads, however it is started (the embedded gateway, Enterprise Gateway's launchers).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import SandboxUnavailable, SetupFailed
from .sandbox.kernelspec import _check_traversable

# The same list as kernel-image/requirements.txt (the Docker image's), shipped as package data.
REQUIREMENTS = Path(str(importlib.resources.files("kernelmode.sandbox") / "kernel-requirements.txt"))
# The kernels' IPython configuration (kernel-image/ipython_kernel_config.json, the Docker image's too).
IPYTHON_CONFIG = Path(str(importlib.resources.files("kernelmode.sandbox") / "ipython_kernel_config.json"))
STAMP = ".stamp"  # the Makefile's stamp too: its mtime says when the environment was last built
VENV_TIMEOUT = 300
PIP_TIMEOUT = 3600  # a first install downloads numpy, pandas, scipy, matplotlib, pyarrow...


def system_python() -> str:
    """The Python to build the venv from: Debian's /usr/bin/python3 (readable by every uid),
    else the first python3 on PATH, else this process's own."""
    for candidate in ("/usr/bin/python3", shutil.which("python3")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


def _fingerprint(requirements: Path, python: str, extra: Sequence[str] = ()) -> str:
    h = hashlib.sha256(requirements.read_bytes())
    h.update(python.encode())
    if extra:  # kernel.extra_requirements (none: the fingerprint of earlier versions)
        h.update("\n".join(extra).encode())
    return h.hexdigest()


def extra_install_argv(venv_python: Path, requirements: Path, extra: Sequence[str], quiet: bool) -> list[str]:
    """pip's command for ``kernel.extra_requirements``: the kernel's own list as constraints,
    so that a team's package can add to the kernel but never replace ipykernel or its stack."""
    return [str(venv_python), "-m", "pip", "install", "--disable-pip-version-check",
            *(["-q"] if quiet else []), "--constraint", str(requirements), "--", *extra]


def _check_reachable(target: Path) -> None:
    """As root, the sandbox uids must reach the venv: check the nearest existing ancestor now,
    rather than after a long install."""
    if os.getuid() != 0:
        return
    existing = next(p for p in [target, *target.parents] if p.exists())
    try:
        _check_traversable(str(existing))
    except SandboxUnavailable as e:
        raise SetupFailed(f"{e.message} (choose another --kernel-env)") from e


def _open_to_all(root: Path) -> None:
    """chmod -R a+rX: readable by all; directories and executables searchable/runnable by all."""
    for dirpath, _dirs, files in os.walk(root):
        for path in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = st.st_mode | 0o444
            if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o100:
                mode |= 0o111
            if mode != st.st_mode:
                os.chmod(path, stat.S_IMODE(mode))


def _run(argv: list[str], timeout: float, what: str, quiet: bool) -> None:
    """Run a step; its output goes to the terminal (pip's progress) unless quiet."""
    try:
        proc = subprocess.run(argv, timeout=timeout, capture_output=quiet, text=True)
    except subprocess.TimeoutExpired as e:
        raise SetupFailed(f"{what} did not finish within {timeout:.0f} s") from e
    except OSError as e:
        raise SetupFailed(f"{what} could not start: {e}") from e
    if proc.returncode != 0:
        tail = ((proc.stderr or proc.stdout or "").strip()[-1500:] + "\n") if quiet else ""
        raise SetupFailed(f"{tail}{what} failed (exit code {proc.returncode})")


def install_ipython_config(target: Path, source: Path = IPYTHON_CONFIG) -> Path:
    """Write the kernels' IPython config to ``target/etc/ipython/ipython_kernel_config.json``.

    IPython reads ``sys.prefix/etc/ipython`` (its ENV_CONFIG_DIRS) at every kernel start, whatever
    starts the kernel: ``ipykernel_launcher`` with the kernelspec's argv, or Enterprise Gateway's
    ``launch_ipykernel.py``, which takes no IPython options. The venv is read-only in the sandbox.
    """
    d = target / "etc" / "ipython"
    d.mkdir(parents=True, exist_ok=True)
    for p in (target / "etc", d):
        os.chmod(p, 0o755)
    dest = d / "ipython_kernel_config.json"
    text = source.read_text()
    if not dest.is_file() or dest.read_text() != text:
        dest.write_text(text)
    os.chmod(dest, 0o644)
    return dest


def _imports_ipykernel(python: Path) -> bool:
    try:
        return subprocess.run([str(python), "-c", "import ipykernel"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def build_kernel_env(
    target: Path,
    python: str | None = None,
    requirements: Path = REQUIREMENTS,
    force: bool = False,
    quiet: bool = False,
    say: Callable[[str], None] = print,
    extra: Sequence[str] = (),
) -> Path:
    """Create or update the venv at ``target``; return its Python. Raise SetupFailed."""
    target = target.expanduser().absolute()
    python = python or system_python()
    if not requirements.is_file():
        raise SetupFailed(f"the requirements file {requirements} does not exist")
    venv_python = target / "bin" / "python"
    stamp = target / STAMP
    fingerprint = _fingerprint(requirements, python, extra)
    current = stamp.read_text().strip() if stamp.is_file() else ""
    if not force and current == fingerprint and _imports_ipykernel(venv_python):
        install_ipython_config(target)
        stamp.touch()
        say(f"kernel environment {target} is up to date (requirements unchanged; --force rebuilds)")
        return venv_python
    _check_reachable(target)
    say(f"[1/4] kernel environment: {target} (from {python})")
    if venv_python.exists() and not force:
        say("[2/4] the venv exists; updating it")
    else:
        say("[2/4] creating the venv")
        _run([python, "-m", "venv", *(["--clear"] if force else []), str(target)], VENV_TIMEOUT,
             f"{python} -m venv", quiet)
    say(f"[3/4] installing {requirements}" + ("" if quiet else " (pip's progress follows; the first "
                                                              "time takes minutes)"))
    _run([str(venv_python), "-m", "pip", "install", "--disable-pip-version-check",
          *(["-q"] if quiet else []), "-r", str(requirements)], PIP_TIMEOUT, "pip install", quiet)
    if extra:
        say(f"      and kernel.extra_requirements: {' '.join(extra)}")
        _run(extra_install_argv(venv_python, requirements, extra, quiet), PIP_TIMEOUT,
             "pip install (kernel.extra_requirements)", quiet)
    say("[4/4] the kernels' IPython config; making it readable by the sandbox users, checking ipykernel")
    install_ipython_config(target)
    _open_to_all(target)
    if not _imports_ipykernel(venv_python):
        raise SetupFailed(f"{venv_python} cannot import ipykernel after the install: is ipykernel "
                          f"in {requirements}?")
    stamp.write_text(fingerprint + "\n")
    os.chmod(stamp, 0o644)
    say(f"kernel environment ready: {venv_python}")
    return venv_python
