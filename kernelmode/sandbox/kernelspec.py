"""Install kernelmode's kernelspec for the chosen backend, and check that the sandbox works.

Runs in the manager before the gateway starts. The check launches a real throw-away sandbox
(the same launcher and bwrap command line as a kernel) so that `serve` refuses to start with a
clear message instead of failing on the first session.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from ..errors import SandboxUnavailable
from . import seccomp
from .bwrap_command import bwrap_argv, launcher_argv

KERNEL_NAME = "kernelmode"
PROVISIONERS = {"bwrap": "kernelmode-bwrap", "none": "kernelmode-none", "docker": "kernelmode-docker"}
INSTALL_HINT = (
    "bubblewrap is not installed. Install it with `sudo apt-get install bubblewrap` "
    "(Debian/Ubuntu) or `sudo dnf install bubblewrap`, or run `make setup`. "
    "For development only, `--sandbox none` runs kernels without any isolation."
)


def kernel_env_paths(kernel_python: Path) -> list[str]:
    """Directories the kernel's Python needs (its venv and base install); checks ipykernel."""
    if not kernel_python.exists():
        raise SandboxUnavailable(
            f"the kernel environment's Python {kernel_python} does not exist: build it with "
            "`kernelmode setup` (`make setup` in a checkout), or set sandbox.kernel_python"
        )
    probe = "import json, sys, ipykernel; print(json.dumps([sys.prefix, sys.base_prefix]))"
    try:
        out = subprocess.run(
            [str(kernel_python), "-c", probe], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except subprocess.CalledProcessError as e:
        raise SandboxUnavailable(
            f"the kernel environment {kernel_python} cannot import ipykernel: {e.stderr.strip()[-500:]}"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise SandboxUnavailable(f"the kernel environment {kernel_python} did not answer") from e
    return sorted({os.path.realpath(p) for p in json.loads(out)})


def install_kernelspec(
    kernels_dir: Path, backend: str, kernel_python: Path, template: Path, ro_paths: list[str] | None = None
) -> Path:
    """Write ``kernels_dir/kernelmode/kernel.json``; return the kernelspec directory.
    ``ro_paths``: ``kernel_env_paths(kernel_python)`` if the caller has them (a probe: ~0.2 s)."""
    spec = json.loads(template.read_text())
    # A Docker kernel runs the image's own Python; the provisioner puts it in the command.
    python = "python" if backend == "docker" else str(kernel_python)
    spec["argv"] = [a.replace("{kernel_python}", python) for a in spec["argv"]]
    spec["metadata"]["kernel_provisioner"]["provisioner_name"] = PROVISIONERS[backend]
    spec["metadata"]["kernelmode"]["ro_paths"] = ([] if backend == "docker" else ro_paths if ro_paths is not None
                                                  else kernel_env_paths(kernel_python))
    d = kernels_dir / KERNEL_NAME
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.json").write_text(json.dumps(spec, indent=2))
    return d


def _check_traversable(path: str) -> None:
    """As root, kernels run as other uids: every parent of a bound path must be searchable."""
    p = Path(path)
    for parent in [p, *p.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            raise SandboxUnavailable(
                f"{parent} is not searchable by other users (mode {stat.filemode(mode)}), so a "
                f"sandboxed kernel cannot reach {path}. Put the data dir and the kernel "
                "environment outside it, or `chmod o+x` it."
            )


def check_bwrap(bwrap: str, kernel_python: Path, data_dir: Path, ro_paths: list[str] | None = None) -> str:
    """Start one throw-away sandbox; return a description, or raise SandboxUnavailable.
    ``ro_paths``: ``kernel_env_paths(kernel_python)`` if the caller has them."""
    exe = shutil.which(bwrap)
    if exe is None:
        raise SandboxUnavailable(INSTALL_HINT)
    ro_paths = ro_paths if ro_paths is not None else kernel_env_paths(kernel_python)
    if os.getuid() == 0:
        for p in [*ro_paths, str(data_dir)]:
            _check_traversable(p)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix="check-") as tmp:
        kdir = Path(tmp) / "k"
        ws = Path(tmp) / "ws"
        kdir.mkdir()
        (Path(tmp) / "etc").mkdir()
        ws.mkdir()
        for name in ("passwd", "group", "hosts"):
            (Path(tmp) / "etc" / name).write_text("")
        os.chmod(tmp, 0o755)
        # The kernels' seccomp filter too: the kernel's Python must start under it.
        bpf = Path(tmp) / "seccomp.bpf"
        bpf.write_bytes(seccomp.compile_bpf())
        spec: dict[str, object] = {"seccomp": str(bpf)}
        if os.getuid() == 0:
            spec.update(uid=65534, gid=65534)
            for d in (kdir, ws):
                os.chown(d, 65534, 65534)
        argv = bwrap_argv(
            bwrap=exe, kernel_dir=kdir, etc_dir=Path(tmp) / "etc", workspace=ws, ro_paths=ro_paths, tmp_bytes=1 << 20,
            env={"PATH": "/usr/bin:/bin"},
            command=[str(kernel_python), "-c", "import ipykernel, socket; print(socket.if_nameindex())"],
        )
        cmd = [*launcher_argv(spec), *argv]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
            )
        except subprocess.TimeoutExpired as e:
            raise SandboxUnavailable("a test sandbox did not finish within 60 s") from e
    if proc.returncode != 0:
        raise SandboxUnavailable(
            "bubblewrap could not start a sandbox here: "
            f"{(proc.stderr or proc.stdout).strip()[-800:]} (user namespaces may be disabled: "
            "check /proc/sys/kernel/unprivileged_userns_clone and user.max_user_namespaces)"
        )
    return f"bwrap ok; interfaces inside: {proc.stdout.strip()}"
