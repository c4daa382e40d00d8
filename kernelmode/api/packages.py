"""``POST /v1/sessions/{id}/packages``: install packages into a session (kernelmode/packages/)."""

from __future__ import annotations

from ..models import PackagesRequest
from .handlers import BaseHandler


class PackagesHandler(BaseHandler):
    async def post(self, session_id: str) -> None:
        req = self.body_model(PackagesRequest)
        self.send(await self.services.sessions.install_packages(self.own(session_id), req.packages))
