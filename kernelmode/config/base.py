"""What every settings section shares: the base model (unknown keys refused; attribute docstrings
are the descriptions, read by ``docs.field_descriptions``), the environment prefix and the default places of the kernel environment and the
gateway's config."""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

ENV_PREFIX = "KERNELMODE_"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Shipped inside the package (package data), so that `pip install .` works without a checkout.
GATEWAY_CONFIG_DIR = Path(str(importlib.resources.files("kernelmode.gateway_ext") / "config"))


def default_kernel_env() -> Path:
    """Where the kernel environment (a venv with ipykernel) is by default: the checkout's
    .kernel-venv (what `make setup` builds) when kernelmode runs from a checkout; otherwise
    where `kernelmode setup` builds it: /opt/kernelmode/kernel-venv as root (readable by the
    sandbox uids, unlike /root), else the user's data dir."""
    if (REPO_ROOT / "pyproject.toml").is_file():
        return REPO_ROOT / ".kernel-venv"
    if os.geteuid() == 0:
        return Path("/opt/kernelmode/kernel-venv")
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "kernelmode" / "kernel-venv"


class _Section(BaseModel):
    # Not use_attribute_docstrings: it parses the module's source at every start (config/docs.py).
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


TENANT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
ADMIN_TENANT = "admin"  # the tenant of the admin token (server.token); no configured tenant may take it


