"""The ``KERNEL_*`` launch parameters the manager sends an external gateway with a kernel start.

An Enterprise Gateway substitutes these values into launch commands and pod templates, so no
value leaves the manager unchecked: each must match a strict charset (letters, digits, ``._-``,
not starting with ``-``), and one that does not is refused, never passed on or "cleaned".
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import InvalidRequest
from ..models import Limits
from ..sandbox.spec import LAUNCH_LIMITS

# What EG and Kubernetes accept in usernames and label values alike; nothing a shell or a
# template would read as syntax ($, quotes, ;, spaces, newlines, backticks, braces).
SAFE_VALUE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,62}")
SAFE_NAME = re.compile(r"KERNEL_[A-Z0-9_]{1,64}")
# A value that is host:port (the egress proxy's address): the charset above and one colon.
ADDRESS_VALUE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}:[0-9]{1,5}")
ADDRESS_NAMES = frozenset({"KERNEL_KM_EGRESS_PROXY"})
# A value that is an absolute path on the node or in the pod (the egress CA bundle's): the same
# charset and slashes, no '..' (config/egress.py checks egress.remote_ca_bundle against it).
PATH_VALUE = re.compile(r"(?!.*/\.\.?(/|$))(/[A-Za-z0-9_][A-Za-z0-9._-]*)+")
PATH_NAMES = frozenset({"KERNEL_KM_EGRESS_CA"})
# KERNEL_USERNAME when the session has no tenant: Enterprise Gateway would otherwise fall back
# to its own user (root is in its default unauthorized_users, and the rig refuses none).
DEFAULT_USERNAME = "kernelmode"


def checked(name: str, value: str) -> str:
    """``value`` unchanged if ``name`` and it are safe to send; else InvalidRequest (422,
    naming the parameter)."""
    if not SAFE_NAME.fullmatch(name):
        raise InvalidRequest(f"launch parameter name {name!r} is not KERNEL_[A-Z0-9_]")
    if name in ADDRESS_NAMES and ADDRESS_VALUE.fullmatch(value):
        return value
    if name in PATH_NAMES and len(value) <= 255 and PATH_VALUE.fullmatch(value):
        return value
    if not SAFE_VALUE.fullmatch(value):
        raise InvalidRequest(
            f"launch parameter {name} refused: {value[:80]!r} is not 1-63 characters of "
            "letters, digits, '.', '_' or '-' (not starting with '-' or '.')",
            details={"parameter": name})
    return value


def launch_env(tenant: str | None, limits: Limits, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``KERNEL_*`` env of one kernel start: username = tenant (or DEFAULT_USERNAME), and the session's limits
    (each value checked); ``extra``: further KERNEL_* values (namespace, image), checked too."""
    env = {name: str(getattr(limits, key)) for key, name in LAUNCH_LIMITS.items()}
    env["KERNEL_USERNAME"] = tenant or DEFAULT_USERNAME
    env.update(extra or {})
    return {name: checked(name, value) for name, value in env.items()}
