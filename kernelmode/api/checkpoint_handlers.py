"""REST handlers of checkpoints: take one now, list a session's (forks go through POST /v1/sessions)."""

from __future__ import annotations

from ..models import CheckpointList
from .handlers import BaseHandler


class CheckpointHandler(BaseHandler):
    """``POST /v1/sessions/{id}/checkpoint``: save the variables and files now."""

    async def post(self, session_id: str) -> None:
        self.send(await self.services.sessions.checkpoint(self.own(session_id)))


class CheckpointsHandler(BaseHandler):
    """``GET /v1/sessions/{id}/checkpoints``: the session's checkpoints, newest first."""

    async def get(self, session_id: str) -> None:
        self.send(CheckpointList(checkpoints=self.services.sessions.list_checkpoints(self.own(session_id))))
