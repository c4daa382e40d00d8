"""``/readyz``'s checks of the session side: the workspace quota, the warm pool and the drain, as
they are now (not as configured). A draining manager (stopping) is not ready: the load balancer
sends new requests elsewhere. A pool refilling as it should is ready; one whose kernels fail to start
is not, and neither is a workspace quota whose volumes cannot be made. ``/readyz`` is public:
errors name no path of the data dir (``<data dir>`` stands for it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sessions import SessionManager


def _public(error: str | None, data_dir: Path) -> str | None:
    return None if error is None else error.replace(str(data_dir), "<data dir>")


def workspace_quota(sessions: SessionManager | None, data_dir: Path) -> dict[str, Any]:
    """The mechanism chosen at start (``off (why)`` when ``auto`` found no loop devices), whether
    it caps workspaces, and why the last workspace could not be made, if it could not."""
    if sessions is None:
        return {"ok": False, "mechanism": "", "enforced": False, "error": "not started yet"}
    volumes = sessions.volumes
    return {"ok": volumes.error is None, "mechanism": _public(sessions.quota, data_dir),
            "enforced": volumes.enabled, "error": _public(volumes.error, data_dir)}


def pool(sessions: SessionManager | None, size: int, data_dir: Path) -> dict[str, Any]:
    """Kernels ready now, the floor (``size``), the size demand asks for now (``target``,
    between the floor and ``sessions.pool_max``), the pool's state (off, full, refilling,
    failing) and the last start's error while it fails."""
    if sessions is None:
        return {"ok": False, "state": "starting", "ready": 0, "size": size, "target": size, "error": None}
    p = sessions.pool
    return {"ok": p.state != "failing", "state": p.state, "ready": p.ready, "size": p.size,
            "target": p.target(), "error": _public(p.error, data_dir)}


def drain(sessions: SessionManager | None) -> dict[str, Any]:
    """Whether this manager is stopping (sessions/drain.py): it takes no new work then."""
    draining = sessions is not None and sessions.drain.draining
    return {"ok": not draining, "draining": draining}
