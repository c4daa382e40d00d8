"""One thin handler per URL; the route table is at the foot of this module (the base handler is
base.py's, the file routes' handlers file_handlers.py's)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from tornado import web

from ..errors import (
    Forbidden,
    InvalidRequest,
    RunNotFound,
    SessionNotFound,
)
from ..models import (
    SESSION_ID_PATTERN,
    ApprovalRequest,
    CheckpointList,
    ExecuteRequest,
    Health,
    OneShotRequest,
    PackagesRequest,
    SessionCreate,
    ToolList,
    ToolMatches,
)
from ..services import Services
from ..sessions.listing import page_limit
from ..tools.search import tool_limit
from .base import SID, BaseHandler
from .file_handlers import (
    ArtifactsHandler,
    FileHandler,
    FilesHandler,
    NotebookHandler,
    PublicArtifactHandler,
)
from .forwarding import FORWARDED_HEADER
from .openapi import openapi_document

__all__ = ["BaseHandler", "NotFoundHandler", "all_routes", "route_table"]


class HealthHandler(BaseHandler):
    public = True

    async def get(self) -> None:
        self.send(Health(status="ok"))


class ReadyHandler(BaseHandler):
    public = True

    async def get(self) -> None:
        checks = await self.services.readiness()
        ok = all(v is True or (isinstance(v, dict) and v.get("ok")) for v in checks.values())
        self.send(Health(status="ok" if ok else "unavailable", checks=checks), 200 if ok else 503)


class OpenAPIHandler(BaseHandler):
    async def get(self) -> None:
        self.send(openapi_document())


class SessionsHandler(BaseHandler):
    async def get(self) -> None:
        """A page of the caller's sessions (``limit``, ``cursor``: sessions/listing.py)."""
        limit = page_limit(self.get_query_argument("limit", None))
        self.send(self.services.sessions.page(self.principal, limit, self.get_query_argument("cursor", None)))

    async def post(self) -> None:
        req = self.body_model(SessionCreate)
        # A fork checkpoints its source's live kernel: on the manager that owns the source.
        router = self.services.router
        if req.fork_of is not None and router is not None and (
                target := router.for_session(req.fork_of, FORWARDED_HEADER in self.request.headers)):
            await self.forward_whole(target)
            return
        info = await self.services.sessions.create(req, self.principal)
        self.send(info, 201)


class SessionHandler(BaseHandler):
    forward_by = "session"

    async def get(self, session_id: str) -> None:
        self.send(self.services.sessions.get(self.own(session_id)))

    async def delete(self, session_id: str) -> None:
        await self.services.sessions.delete(self.own(session_id))
        self.set_status(204)
        self.finish()


class ExecuteHandler(BaseHandler):
    forward_by = "session"

    async def post(self, session_id: str) -> None:
        self.services.sessions.status(self.own(session_id))  # 404 before validating the body (no usage read)
        req = self.body_model(ExecuteRequest)
        self.services.tenants.count_run(self.principal)
        result = await self.services.sessions.execute(session_id, req.code, req.timeout_seconds, req.wait_seconds)
        if result.status in ("running", "awaiting_approval"):
            self.set_header("Location", f"/v1/runs/{result.run_id}")
            self.send(result, 202)
        else:
            self.send(result)


class RunHandler(BaseHandler):
    """Long-run polling: output since ``offset``; ``wait_seconds`` holds the answer until
    there is something new (or the run ends)."""

    forward_by = "run"

    async def get(self, run_id: str) -> None:
        try:
            run = self.services.sessions.get_run(run_id, self.principal)
        except RunNotFound:
            if await self.forward_unknown_run(run_id):
                return
            raise
        try:
            offset = int(self.get_query_argument("offset", "0"))
            wait = float(self.get_query_argument("wait_seconds", "0"))
            version = self.get_query_argument("approvals_version", None)
            seen = int(version) if version is not None else None
        except ValueError as e:
            raise InvalidRequest("offset and approvals_version must be integers, wait_seconds a number") from e
        if offset < 0 or not 0 <= wait <= 60:
            raise InvalidRequest("offset must be >= 0 and wait_seconds between 0 and 60")
        if wait:
            await run.wait_changed(offset, wait, seen)
        self.send(run.progress(offset))


class ApprovalHandler(BaseHandler):
    """Approve or deny a tool call (or a run, for the code policy) that waits for approval."""

    forward_by = "run"

    async def post(self, run_id: str, call_id: str) -> None:
        try:
            self.services.sessions.get_run(run_id, self.principal)  # 404 (another tenant's too) first
        except RunNotFound:
            if await self.forward_unknown_run(run_id):
                return
            raise
        req = self.body_model(ApprovalRequest)
        self.send(self.services.sessions.decide_approval(run_id, call_id, req.approve, req.reason,
                                                         self.principal))


class OneShotHandler(BaseHandler):
    """A run in a fresh kernel that is discarded afterwards (no session to manage)."""

    async def post(self) -> None:
        req = self.body_model(OneShotRequest)
        files = []
        for i, f in enumerate(req.files):
            try:
                files.append((f.path, base64.b64decode(f.content_base64, validate=True)))
            except (binascii.Error, ValueError) as e:
                raise InvalidRequest(f"files[{i}].content_base64 is not valid base64: {e}") from e
        self.services.tenants.count_run(self.principal)
        self.send(await self.services.sessions.one_shot(req.code, files, req.timeout_seconds, req.tools,
                                                   self.principal, egress=req.egress))


class InterruptHandler(BaseHandler):
    forward_by = "session"

    async def post(self, session_id: str) -> None:
        self.send(await self.services.sessions.interrupt(self.own(session_id)))


class RestartHandler(BaseHandler):
    forward_by = "session"

    async def post(self, session_id: str) -> None:
        self.send(await self.services.sessions.restart(self.own(session_id)))


class PackagesHandler(BaseHandler):
    """Install packages into the session (kernelmode/packages/): the kernel stays offline."""

    forward_by = "session"

    async def post(self, session_id: str) -> None:
        req = self.body_model(PackagesRequest)
        self.send(await self.services.sessions.install_packages(self.own(session_id), req.packages))


class CheckpointHandler(BaseHandler):
    forward_by = "session"

    async def post(self, session_id: str) -> None:
        self.send(await self.services.sessions.checkpoint(self.own(session_id)))


class CheckpointsHandler(BaseHandler):
    forward_by = "session"

    async def get(self, session_id: str) -> None:
        self.send(CheckpointList(checkpoints=self.services.sessions.list_checkpoints(self.own(session_id))))


class MetricsHandler(BaseHandler):
    """Prometheus text format; behind the token like the rest (scrape with a bearer token)."""

    async def get(self) -> None:
        from ..metrics import CONTENT_TYPE

        if not self.principal.admin:
            raise Forbidden("metrics cover every tenant: scrape them with the admin token")

        self.set_header("Content-Type", CONTENT_TYPE)
        self.finish(self.services.metrics.render())


class ToolsHandler(BaseHandler):
    async def get(self) -> None:
        """Every host tool; with ``q``, the ``limit`` (default 8) that best fit that intent."""
        query, limit = self.get_query_argument("q", None), self.get_query_argument("limit", None)
        if query is None:
            if limit is not None:
                raise InvalidRequest("limit goes with q (a search): GET /v1/tools?q=...&limit=N")
            self.send(ToolList(tools=self.services.tools.infos()))
            return
        self.send(ToolMatches(tools=self.services.tools.search(query, tool_limit(limit))))


class NotFoundHandler(BaseHandler):
    def prepare_body(self) -> None:  # after the token check: unknown routes are no one's business
        path = self.request.path
        if path.startswith("/v1/sessions/"):
            raise SessionNotFound(f"no such session or route: {path} (ids match {SESSION_ID_PATTERN})")
        raise web.HTTPError(404, f"no route {path}")


routes: list[tuple[str, type[web.RequestHandler]]] = [
    (r"/healthz", HealthHandler),
    (r"/readyz", ReadyHandler),
    (r"/openapi.json", OpenAPIHandler),
    (r"/metrics", MetricsHandler),
    (r"/v1/tools", ToolsHandler),
    (r"/v1/execute", OneShotHandler),
    (r"/v1/sessions", SessionsHandler),
    (rf"/v1/sessions/({SID})", SessionHandler),
    (rf"/v1/sessions/({SID})/execute", ExecuteHandler),
    (rf"/v1/sessions/({SID})/interrupt", InterruptHandler),
    (rf"/v1/sessions/({SID})/restart", RestartHandler),
    (rf"/v1/sessions/({SID})/files", FilesHandler),
    (rf"/v1/sessions/({SID})/files/(.+)", FileHandler),
    (rf"/v1/sessions/({SID})/artifacts", ArtifactsHandler),
    (rf"/v1/sessions/({SID})/notebook", NotebookHandler),
    (rf"/v1/sessions/({SID})/packages", PackagesHandler),
    (rf"/v1/sessions/({SID})/checkpoint", CheckpointHandler),
    (rf"/v1/sessions/({SID})/checkpoints", CheckpointsHandler),
    (r"/v1/runs/([0-9a-f]{32})", RunHandler),
    (r"/v1/runs/([0-9a-f]{32})/approvals/([0-9a-f]{32})", ApprovalHandler),
    (r"/v1/artifacts/(.+)", PublicArtifactHandler),
]


def all_routes() -> list[tuple[str, type[web.RequestHandler]]]:
    """(URL pattern, handler) of every REST route, the console websocket included (the Jupyter
    API's are api/jupyter_api.py's ``jupyter_routes``)."""
    from .channels import ChannelsHandler

    return [*routes, (rf"/v1/sessions/({SID})/channels", ChannelsHandler)]


def route_table(services: Services) -> list[tuple[str, type[web.RequestHandler], dict[str, Any]]]:
    """The routes as tornado takes them: each handler gets ``services`` through ``initialize``."""
    return [(pattern, handler, {"services": services}) for pattern, handler in all_routes()]
