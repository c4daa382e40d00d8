"""The ``none`` backend: a plain local kernel process. Nothing is isolated: development only."""

from __future__ import annotations

from pathlib import Path

from ..protocol import PACKAGES_ENV
from .base import KernelmodeProvisioner, kernel_environment, log


class UnsandboxedProvisioner(KernelmodeProvisioner):
    """Runs the kernel as a normal child of the gateway, in the session's workspace."""

    def wrap_command(
        self, cmd: list[str], env: dict[str, str], kdir: Path
    ) -> tuple[list[str], dict[str, str], Path]:
        assert self.params is not None
        log.warning("kernel %s runs WITHOUT a sandbox (--sandbox none)", self.kernel_id)
        self.params.workspace.mkdir(parents=True, exist_ok=True)
        venv_bin = str(Path(cmd[0]).parent)
        kenv = kernel_environment(f"{venv_bin}:/usr/local/bin:/usr/bin:/bin")
        tmp = kdir / "tmp"
        tmp.mkdir(exist_ok=True)
        kenv.update(HOME=str(tmp), TMPDIR=str(tmp), MPLCONFIGDIR=str(tmp / ".matplotlib"),
                    IPYTHONDIR=str(tmp / ".ipython"))
        packages = self.params.packages_dir()
        if packages is not None:  # no mount without a sandbox: the host path itself
            kenv[PACKAGES_ENV] = str(packages)
        # The kernel starts in its workspace, like /mnt/data in the sandbox.
        return cmd, kenv, self.params.workspace

