"""One thin handler per URL; the route table is at the foot of this module."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import tempfile
from typing import Any, BinaryIO, TypeVar, cast
from urllib.parse import quote, unquote

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from tornado import web
from tornado.http1connection import HTTP1Connection
from tornado.iostream import StreamClosedError

from ..artifacts.local import LocalStore
from ..errors import (
    BadJSON,
    Forbidden,
    InvalidRequest,
    KernelmodeError,
    NotFound,
    PayloadTooLarge,
    SessionNotFound,
    StoreError,
    Unauthorized,
    from_wire,
)
from ..gateway.frames import refuse_lone_surrogates
from ..models import (
    SESSION_ID_PATTERN,
    ApprovalRequest,
    ArtifactList,
    CheckpointList,
    ExecuteRequest,
    FileDeleted,
    Health,
    OneShotRequest,
    PackagesRequest,
    SessionCreate,
    ToolList,
    ToolMatches,
)
from ..services import Services
from ..sessions.listing import page_limit
from ..tenants import ADMIN, Principal
from ..tools.search import tool_limit
from .openapi import openapi_document

log = logging.getLogger("kernelmode.api")
M = TypeVar("M", bound=BaseModel)
SID = SESSION_ID_PATTERN.strip("^$")


# Every handler streams its body, so that the token is checked before any of the body is read
# (a buffered handler gets the body whole, and form bodies parsed, before ``prepare``). A refusal
# made before the body is read would make tornado hang up on the unread bytes; the kernel then
# resets the connection, and the reset can destroy the answer before the client reads it (the MCP
# SDK saw a bare ReadError instead of its 401). So a refused body of up to this size is read and
# dropped first; a bigger one is cut off unread.
DRAIN_BEFORE_REJECTING = 1 << 20


@web.stream_request_body
class BaseHandler(web.RequestHandler):
    """JSON in, JSON out, bearer token, errors as ``{"error": {"code", "message"}}``.

    Subclasses check their headers in ``prepare_body``; the body is buffered (``body``) unless
    a subclass streams it elsewhere by overriding ``data_received``.
    """

    public = False
    principal: Principal = ADMIN  # who sent the request (set by prepare from the token)
    rejected = False  # refused before its body was read: the body is dropped
    _body_chunks: list[bytes]

    services: Services

    def initialize(self, services: Services) -> None:
        """``services``: from the route table's third element (``route_table``)."""
        self.services = services

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")

    def prepare(self) -> None:
        self._body_chunks = []
        try:
            self.authenticate()
            self.prepare_body()
        except (KernelmodeError, web.HTTPError) as e:
            status = e.http_status if isinstance(e, KernelmodeError) else e.status_code
            if status >= 500 or not self._drain_then_answer(e):
                raise

    def authenticate(self) -> None:
        if self.public:
            return
        principal = self.services.tenants.from_authorization(self.request.headers.get("Authorization", ""))
        if principal is None:
            raise Unauthorized("missing or wrong bearer token (send `Authorization: Bearer <token>`)")
        self.principal = principal

    def prepare_body(self) -> None:
        """Check the headers and set up what the body will stream into."""

    def data_received(self, chunk: bytes) -> None:
        if not self.rejected:  # the server's max_body_bytes caps the total
            self._body_chunks.append(chunk)

    @property
    def body(self) -> bytes:
        return b"".join(self._body_chunks)

    def _drain_then_answer(self, error: Exception) -> bool:
        length = self.request.headers.get("Content-Length", "0") or "0"
        conn = self.request.connection
        if not length.isdigit() or int(length) > DRAIN_BEFORE_REJECTING or not isinstance(conn, HTTP1Connection):
            return False
        conn.set_max_body_size(DRAIN_BEFORE_REJECTING)
        self.rejected = True

        def answer(*_args: Any, **_kwargs: Any) -> None:
            raise error

        # tornado looks the verb's method up on the instance once the body is in: whichever verb
        # this was, no handler code runs for the refused request.
        setattr(self, self.request.method.lower(), answer)
        return True

    def own(self, session_id: str) -> str:
        """The id, if the caller may use that session (another tenant's is a 404 like an unknown id)."""
        self.services.sessions.authorize(self.principal, session_id)
        return session_id

    def body_model(self, model: type[M]) -> M:
        raw = self.body or b"{}"
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadJSON(f"the request body is not valid JSON: {e}") from e
        except RecursionError as e:
            raise BadJSON("the request body is nested too deeply") from e
        if not isinstance(data, dict):
            raise InvalidRequest("the request body must be a JSON object")
        if b"\\u" in raw:  # only an escape makes a lone surrogate
            refuse_lone_surrogates(data, "the request body")
        try:
            return model.model_validate(data)
        except PydanticValidationError as e:
            errors = [
                {"field": ".".join(str(p) for p in err["loc"]), "message": err["msg"]}
                for err in e.errors(include_url=False, include_input=False)
            ]
            summary = "; ".join(f"{x['field'] or 'body'}: {x['message']}" for x in errors)
            raise InvalidRequest(f"invalid request: {summary}", details=errors) from e

    def send(self, payload: BaseModel | dict[str, Any], status: int = 200) -> None:
        self.set_status(status)
        if isinstance(payload, BaseModel):
            self.finish(payload.model_dump_json())
        else:
            self.finish(json.dumps(payload))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """REST's and the Jupyter API's one translation point (tornado's refusals: ``from_wire``)."""
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, web.HTTPError):
            exc = from_wire(exc.log_message or self._reason, status=exc.status_code)
        error = exc if isinstance(exc, KernelmodeError) else KernelmodeError("internal server error (see the server log)")
        status = error.http_status
        self.clear()
        self.set_default_headers()
        self.set_header("Content-Type", "application/json")  # also where defaults are not JSON (/mcp)
        if status == 401:
            self.set_header("WWW-Authenticate", 'Bearer realm="kernelmode"')
        if status == 429:  # when to come back: the error's own figure, else its class's hint
            details = error.details if isinstance(error.details, dict) else {}
            retry: Any = details.get("retry_after_seconds") or getattr(error, "retry_after_seconds", 1)
            self.set_header("Retry-After", str(max(1, int(retry))))
        self.set_status(status)
        self.finish(json.dumps(self.error_document(error.to_dict())))

    def error_document(self, body: dict[str, Any]) -> dict[str, Any]:
        """The error's JSON document (the Jupyter API adds Jupyter's own keys)."""
        return {"error": body}

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, KernelmodeError) and value.http_status < 500:
            return  # a client error, answered as such
        super().log_exception(typ, value, tb)


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
        info = await self.services.sessions.create(req, self.principal)
        self.send(info, 201)


class SessionHandler(BaseHandler):
    async def get(self, session_id: str) -> None:
        self.send(self.services.sessions.get(self.own(session_id)))

    async def delete(self, session_id: str) -> None:
        await self.services.sessions.delete(self.own(session_id))
        self.set_status(204)
        self.finish()


class ExecuteHandler(BaseHandler):
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

    async def get(self, run_id: str) -> None:
        run = self.services.sessions.get_run(run_id, self.principal)
        try:
            offset = int(self.get_query_argument("offset", "0"))
            wait = float(self.get_query_argument("wait_seconds", "0"))
        except ValueError as e:
            raise InvalidRequest("offset must be an integer and wait_seconds a number") from e
        if offset < 0 or not 0 <= wait <= 60:
            raise InvalidRequest("offset must be >= 0 and wait_seconds between 0 and 60")
        if wait:
            await run.wait_changed(offset, wait)
        self.send(run.progress(offset))


class ApprovalHandler(BaseHandler):
    """Approve or deny a tool call (or a run, for the code policy) that waits for approval."""

    async def post(self, run_id: str, call_id: str) -> None:
        self.services.sessions.get_run(run_id, self.principal)  # 404 (another tenant's too) first
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
                                                   self.principal))


class InterruptHandler(BaseHandler):
    async def post(self, session_id: str) -> None:
        self.send(await self.services.sessions.interrupt(self.own(session_id)))


class RestartHandler(BaseHandler):
    async def post(self, session_id: str) -> None:
        self.send(await self.services.sessions.restart(self.own(session_id)))


class PackagesHandler(BaseHandler):
    """Install packages into the session (kernelmode/packages/): the kernel stays offline."""

    async def post(self, session_id: str) -> None:
        req = self.body_model(PackagesRequest)
        self.send(await self.services.sessions.install_packages(self.own(session_id), req.packages))


class CheckpointHandler(BaseHandler):
    async def post(self, session_id: str) -> None:
        self.send(await self.services.sessions.checkpoint(self.own(session_id)))


class CheckpointsHandler(BaseHandler):
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


# Types a browser would render (and run scripts in): always downloaded, never sniffed.
_ACTIVE_TYPES = {"text/html", "image/svg+xml", "application/xhtml+xml", "text/xml", "application/xml"}


class FilesHandler(BaseHandler):
    async def get(self, session_id: str) -> None:
        self.send(await self.services.sessions.list_files(self.own(session_id)))


class FileHandler(BaseHandler):
    """Uploads stream to a spool file (not memory) under their own size cap."""

    _spool: Any = None
    _received = 0

    def prepare_body(self) -> None:
        if self.request.method != "PUT":
            return
        cap = self.services.settings.artifacts.max_upload_bytes
        length = int(self.request.headers.get("Content-Length", "0") or 0)
        if length > cap:
            raise PayloadTooLarge(f"the upload is {length} bytes, over this server's limit of {cap}")
        conn = self.request.connection
        if isinstance(conn, HTTP1Connection):
            conn.set_max_body_size(cap + 1)
        self._spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115

    def data_received(self, chunk: bytes) -> None:
        self._received += len(chunk)
        if self._spool is not None and not self.rejected \
                and self._received <= self.services.settings.artifacts.max_upload_bytes:
            self._spool.write(chunk)

    def on_finish(self) -> None:
        if self._spool is not None:
            self._spool.close()

    async def put(self, session_id: str, path: str) -> None:
        cap = self.services.settings.artifacts.max_upload_bytes
        if self._received > cap:
            raise PayloadTooLarge(f"the upload is over this server's limit of {cap} bytes")
        overwrite = self.get_query_argument("overwrite", "false").lower() in ("1", "true", "yes")
        self._spool.seek(0)
        result = await self.services.sessions.upload(self.own(session_id), path, self._spool, self._received,
                                                overwrite)
        self.send(result, 201)

    async def get(self, session_id: str, path: str) -> None:
        # Streamed from the kernel's file agent chunk by chunk (artifacts/channel.py): the
        # manager holds two chunks, never the file. The length is the kernel's announcement;
        # a kernel that then sends more or less fails the transfer (the connection is cut).
        download, mime = await self.services.sessions.open_file(self.own(session_id), path)
        self.set_header("Content-Type", mime)
        self.set_header("Content-Length", str(download.size))
        self.set_header("X-Content-Type-Options", "nosniff")
        name = path.rsplit("/", 1)[-1]
        if mime in _ACTIVE_TYPES:
            self.set_header("Content-Disposition", f"attachment; filename*=UTF-8''{quote(name)}")
        chunks = download.chunks()
        try:
            self.write(await anext(chunks, b""))  # errors before the first byte answer as JSON
            async for chunk in chunks:
                self.write(chunk)
                await self.flush()
        except (KernelmodeError, StreamClosedError) as e:
            if not self._headers_written:
                raise
            log.warning("download of %s from session %s failed midway: %s", name, session_id, e)
            self.request.connection.close()  # type: ignore[union-attr]
            return
        finally:
            await chunks.aclose()  # the kernel's side of the transfer is closed too
        self.finish()

    async def delete(self, session_id: str, path: str) -> None:
        self.send(FileDeleted(path=await self.services.sessions.delete_file(self.own(session_id), path)))


class ArtifactsHandler(BaseHandler):
    async def get(self, session_id: str) -> None:
        self.send(ArtifactList(artifacts=await self.services.sessions.artifacts(self.own(session_id))))


class NotebookHandler(BaseHandler):
    """The session's runs as an .ipynb (console runs included; also after the session is gone)."""

    async def get(self, session_id: str) -> None:
        # Written run by run to a spool (on disk past 1 MiB), then sent in chunks: a long history
        # with big outputs never sits in memory whole.
        with tempfile.SpooledTemporaryFile(max_size=1 << 20) as spool:
            await asyncio.to_thread(self.services.sessions.notebook, self.own(session_id), cast(BinaryIO, spool))
            self.set_header("Content-Type", "application/x-ipynb+json")
            self.set_header("Content-Disposition", f"attachment; filename*=UTF-8''{quote(session_id)}.ipynb")
            self.set_header("X-Content-Type-Options", "nosniff")
            self.set_header("Content-Length", str(spool.tell()))
            spool.seek(0)
            while chunk := await asyncio.to_thread(spool.read, 1 << 20):
                self.write(chunk)
                await self.flush()
        self.finish()


class PublicArtifactHandler(BaseHandler):
    """Local-store download links: signed and expiring, so they need no bearer token."""

    public = True

    async def get(self, key: str) -> None:
        store = self.services.artifact_store
        if not isinstance(store, LocalStore):
            raise web.HTTPError(404, "artifacts are served by the S3 store's own links")
        key = unquote(key)
        if not store.verify(key, self.get_query_argument("expires", ""), self.get_query_argument("sig", "")):
            raise Forbidden("this download link is invalid or has expired: ask for a fresh one "
                            "(GET /v1/sessions/{id}/artifacts)")
        try:
            data = await store.get(key)
        except StoreError as e:
            raise NotFound(str(e)) from e
        mime = store.content_type(key)
        self.set_header("Content-Type", mime)
        self.set_header("X-Content-Type-Options", "nosniff")
        name = key.rsplit("/", 1)[-1]
        if mime in _ACTIVE_TYPES:
            self.set_header("Content-Disposition", f"attachment; filename*=UTF-8''{quote(name)}")
        self.finish(data)


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
