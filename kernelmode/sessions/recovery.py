"""Adoption after a manager restart: the sessions whose kernels outlived a crashed manager (in a
gateway that kept running) are taken over with their variables; the rest become ``lost``."""

from __future__ import annotations

import asyncio
import logging

from ..audit import audit
from ..errors import KernelmodeError
from ..models import RunError, RunResult, SessionInfo
from .kernel_env import Kernels
from .kernels import Kernel
from .live import LiveSession
from .store import SessionStore

log = logging.getLogger("kernelmode.sessions")


def adoptable(store: SessionStore, running_kernels: set[str] | frozenset[str]) -> list[SessionInfo]:
    """The stored sessions whose kernel is among ``running_kernels``."""
    return store.with_kernels(running_kernels)


async def adopt(kernels: Kernels, store: SessionStore, infos: list[SessionInfo],
                in_flight: dict[str, RunResult]) -> list[LiveSession]:
    """Reconnect to the running kernels of sessions a crashed manager held; an interrupted run is
    stopped first (a kernel that does not answer then is given up: its session is lost)."""
    timeout = min(kernels.start_timeout, 30.0)

    async def one(info: SessionInfo) -> LiveSession | None:
        assert info.kernel_id is not None
        workspace = store.workspace(info.session_id)
        if workspace is None:
            return None
        s = LiveSession(kernel=Kernel(kernels, info.kernel_id, workspace, info))
        try:
            if info.session_id in in_flight:
                await s.kernel.interrupt()
            await s.kernel.connect(timeout)
        except KernelmodeError as e:
            log.warning("session %s: its kernel could not be adopted (%s)", info.session_id, e)
            await s.kernel.shutdown()
            store.mark_lost(info)
            return None
        s.info.status = "idle"
        s.touch()
        store.save(s.info, s.kernel_id, s.workspace)
        audit("session_adopted", session_id=info.session_id, tenant=info.tenant, kernel_id=s.kernel_id)
        return s

    done = await asyncio.gather(*(one(i) for i in infos))
    adopted = [s for s in done if s is not None]
    if infos:
        kept = {s.info.session_id for s in adopted}
        log.info("adopted %d of %d session(s) whose kernels outlived the previous manager "
                 "(survived: %s; lost: %s)", len(adopted), len(infos), ", ".join(sorted(kept)) or "none",
                 ", ".join(sorted(i.session_id for i in infos if i.session_id not in kept)) or "none")
    return adopted


RESTARTED = "the server stopped while this code ran; its output after that is lost"
TAKEN_OVER = ("the manager running this code stopped, and another manager took the session over "
              "(its variables kept, unless state_lost); the code's output after that is lost, and it "
              "was not run again")


def end_interrupted_runs(store: SessionStore, in_flight: dict[str, RunResult], adopted: set[str],
                         why: str = RESTARTED) -> None:
    """The server died under these runs: they end as interrupted (state lost unless adopted)."""
    for run in in_flight.values():
        store.end_run(run.model_copy(update={
            "status": "interrupted", "state_lost": run.session_id not in adopted,
            "error": RunError(ename="ServerRestarted", evalue=why, traceback="")}))
