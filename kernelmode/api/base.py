"""The base of every REST handler: the token checked before the body is read, bodies bounded and
validated, answers and errors (one ``write_error``: ``{"error": {"code", "message"}}``)."""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from tornado import web
from tornado.http1connection import HTTP1Connection

from ..errors import (
    BadJSON,
    InvalidRequest,
    KernelmodeError,
    ManagerGone,
    ServerBusy,
    SessionOwnedElsewhere,
    Unauthorized,
    from_wire,
)
from ..models import (
    SESSION_ID_PATTERN,
)
from ..protocol.frames import refuse_lone_surrogates
from ..services import Services
from ..tenants import ADMIN, Principal
from .forwarding import FORWARDED_HEADER, Relay, open_relay

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
    # What the first URL argument names, for forwarding to the session's owner (forwarding.py):
    # "session", "run" or "kernel" (a Jupyter kernel id); None: served by whichever manager.
    forward_by: str | None = None
    relay: Relay | None = None  # the request is being forwarded to the session's owner
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
            if self._forward_elsewhere():
                return
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

    def forward_target(self) -> str | None:
        """The base URL of the manager that owns what this request is about, if another."""
        router = self.services.router
        if router is None or self.forward_by is None or not self.path_args:
            return None
        find = {"session": router.for_session, "run": router.for_run, "kernel": router.for_kernel}
        return find[self.forward_by](self.path_args[0], FORWARDED_HEADER in self.request.headers)

    def forward_body_limit(self) -> int | None:
        """The cap on a forwarded body (None: the server's max_body_bytes); the owner checks it too."""
        return None

    def _forward_elsewhere(self) -> bool:
        """Start forwarding the request if another manager owns its session (the body streams on)."""
        target = self.forward_target()
        if target is None or self.services.router is None:
            return False
        self.relay = open_relay(self, self.services.router, target, self.forward_body_limit())
        setattr(self, self.request.method.lower(), self._answer_from_owner)  # as _drain_then_answer
        return True

    async def _answer_from_owner(self, *_args: Any, **_kwargs: Any) -> None:
        assert self.relay is not None
        await self.relay.answer()

    async def forward_whole(self, target: str) -> None:
        """Forward a request whose body was read here (a create that names another's session)."""
        assert self.services.router is not None
        self.relay = Relay(self, self.services.router, target, body=self.body)
        await self.relay.answer()

    async def forward_unknown_run(self, run_id: str) -> bool:
        """A run unknown here and to the store: forwarded to the manager its id names, if that is
        another live one (queued there, not yet written; it answers 404 if it has no such run);
        False if none is named."""
        router = self.services.router
        if router is None or FORWARDED_HEADER in self.request.headers:
            return False
        target = router.find_run(run_id)
        if target is None:
            return False
        await self.forward_whole(target)
        return True

    def on_connection_close(self) -> None:
        if self.relay is not None:
            self.relay.cancel()
        super().on_connection_close()

    def data_received(self, chunk: bytes) -> Any:
        if self.relay is not None:
            return self.relay.feed(chunk)  # awaited by tornado: the owner's pace
        if not self.rejected:  # the server's max_body_bytes caps the total
            self._body_chunks.append(chunk)
        return None

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
        if status == 429 or isinstance(error, (ServerBusy, ManagerGone, SessionOwnedElsewhere)):  # when to come back: the error's own figure, else its class's hint
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
        if isinstance(value, (ServerBusy, SessionOwnedElsewhere)):  # refused before anything ran: retried
            log.info("%s %s: %s (%s)", self.request.method, self.request.uri, value.code, value)
            return
        super().log_exception(typ, value, tb)
