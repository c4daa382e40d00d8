"""A Jupyter-gateway-compatible API on the serve port, so JupyterLab (``jupyter lab
--gateway-url``), Notebook 7 and VS Code ("existing Jupyter server") attach to live sessions.

Routes are those Jupyter Server's ``GatewayClient`` calls (jupyter_server/gateway/): kernelspecs,
kernels (list, start, get, delete, interrupt, restart) and ``/api/kernels/{id}/channels``; plus
``GET /api`` (the version) and ``GET /api/sessions`` for clients that read them first.

A kernel is a session: its id is the session id as a UUID (jupyter_server's own routes only take
UUID-shaped kernel ids), see ``kernel_id_of``. Tokens and tenants are the REST API's (either
``Authorization: Bearer`` or ``token``); another tenant's kernel is answered like an unknown id.
Errors carry Jupyter's ``message``/``reason`` beside kernelmode's ``error`` object.

DELETE stops only a kernel that was started here (``POST /api/kernels``): a session an agent
started over REST or MCP is detached from, never deleted, by a person's JupyterLab (which also
deletes every kernel it knows when it exits).
"""

from __future__ import annotations

import contextlib
import json
import uuid
import weakref
from datetime import timezone
from importlib import metadata
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from tornado import web

from ..audit import audit
from ..errors import InvalidRequest, KernelmodeError, KernelSpecNotFound, NotFound, SessionNotFound
from ..models import SessionCreate, SessionInfo
from ..sessions import SessionManager
from ..tenants import Principal
from .channels import ChannelsHandler
from .handlers import BaseHandler

KID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_NAMESPACE = uuid.UUID("6f1c3f55-3d4e-4d0b-9d55-6b65726e656c")  # for session ids that are no UUID
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"  # the one GatewayKernelManager.refresh_model parses
_STATES = {"starting": "starting", "idle": "idle", "busy": "busy", "restarting": "restarting",
           "dead": "dead", "lost": "dead",
           "hibernated": "idle"}  # no kernel process, but attaching or running wakes it
# Sessions started through POST /api/kernels, per manager (the only ones DELETE stops).
_started_here: weakref.WeakKeyDictionary[SessionManager, set[str]] = weakref.WeakKeyDictionary()


def kernel_id_of(session_id: str) -> str:
    """The kernel id of a session: its id as a UUID when it is 32 hex digits (kernelmode's own
    ids), else a UUID derived from it (name-based, so the same session keeps the same id)."""
    try:
        if len(session_id) == 32:
            return str(uuid.UUID(hex=session_id))
    except ValueError:
        pass
    return str(uuid.uuid5(_NAMESPACE, session_id))


def spec_name(backend: str) -> str:
    """The kernelspec of a sandbox flavour."""
    return f"kernelmode-{backend}"


class KernelCreate(BaseModel):
    """Body of ``POST /api/kernels`` (Jupyter's: ``env`` and other keys are ignored; a kernel's
    environment is the sandbox's, never the client's)."""

    model_config = ConfigDict(extra="ignore")
    name: str | None = Field(None, description="A kernelspec name from GET /api/kernelspecs.")


class JupyterHandler(BaseHandler):
    """Errors with Jupyter's ``message`` and ``reason`` too (GatewayClient shows them)."""

    def error_document(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"error": body, "message": body.get("message", ""), "reason": body.get("code", "")}

    @property
    def backend(self) -> str:
        return self.services.settings.sandbox.backend

    def spec(self) -> dict[str, Any]:
        """The kernelspec of this server's sandbox flavour, naming its default limits and ceilings."""
        sb = self.services.settings.sandbox
        lim = self.principal.limits(None, sb)
        name = spec_name(self.backend)
        return {"name": name, "resources": {}, "spec": {
            "argv": [], "env": {}, "language": "python", "interrupt_mode": "message",
            "display_name": f"Python (kernelmode, {self.backend} sandbox: {lim.memory_mb} MB, "
                            f"{lim.cpu_seconds} cpu-s, {lim.pids} pids)",
            "metadata": {"kernelmode": {"sandbox": self.backend, "limits": lim.model_dump(),
                                        "max_limits": sb.max_limits.model_dump()}}}}

    def kernel_model(self, info: SessionInfo, elsewhere: bool = False) -> dict[str, Any]:
        """A session as Jupyter's kernel model (``elsewhere``: another manager owns it; its
        record is the store's)."""
        live = self.services.sessions.peek(info.session_id)  # a listing never wakes a hibernated one
        if live is None and info.status != "hibernated" and not elsewhere:
            self.services.sessions.live_session(info.session_id)  # lost: KernelUnavailable
        state = _STATES.get(str(info.status), "idle")
        if state == "idle" and live is not None and live.console_cells > 0:
            state = "busy"  # a person's cell runs
        return {"id": kernel_id_of(info.session_id), "name": spec_name(info.sandbox),
                "last_activity": info.last_activity.astimezone(timezone.utc).strftime(_TIME_FORMAT),
                "execution_state": state, "connections": live.attached if live is not None else 0,
                "kernelmode": {"session_id": info.session_id, "tenant": info.tenant, "status": info.status}}

    def kernel_models(self) -> list[dict[str, Any]]:
        """The caller's sessions that have a kernel (lost ones have none), as kernel models:
        this manager's, and those other managers own (their requests are forwarded there)."""
        found: list[tuple[SessionInfo, bool]] = [(i, False) for i in self.services.sessions.with_kernels(self.principal)]
        found += [(i, True) for i in self.owned_elsewhere({i.session_id for i, _ in found})]
        models = []
        for info, elsewhere in sorted(found, key=lambda f: (f[0].created_at, f[0].session_id)):
            if info.status != "lost":
                with contextlib.suppress(KernelmodeError):  # gone meanwhile
                    models.append(self.kernel_model(info, elsewhere))
        return models

    def owned_elsewhere(self, known: set[str]) -> list[SessionInfo]:
        """Several managers: the caller's sessions another manager holds (store records)."""
        router, sessions = self.services.router, self.services.sessions
        if router is None:
            return []
        infos = []
        for sid in sorted(router.store.leases.held_elsewhere(router.manager_id) - known):
            if sessions.peek(sid) is None and sessions.may_see(self.principal, sid) \
                    and (info := router.store.get(sid)) is not None and info.status not in ("lost", "hibernated"):
                infos.append(info)
        return infos

    def session_of(self, kernel_id: str) -> SessionInfo:
        return find_session(self.services.sessions, self.principal, kernel_id)


def find_session(sessions: SessionManager, principal: Principal, kernel_id: str) -> SessionInfo:
    """The caller's live session with this kernel id (another tenant's: SessionNotFound)."""
    wanted = kernel_id.lower()
    # kernelmode's own ids (32 hex digits) are the kernel id itself: one lookup, not a listing
    # of every session (a listing reads each live session's cgroup).
    with contextlib.suppress(ValueError, SessionNotFound):
        sid = uuid.UUID(wanted).hex
        if kernel_id_of(sid) == wanted and sessions.may_see(principal, sid):
            info = sessions.get(sid)
            if info.status != "lost":
                return info
    for info in sessions.with_kernels(principal):  # a lost session has no kernel to find
        if info.status != "lost" and kernel_id_of(info.session_id) == wanted:
            return info
    raise SessionNotFound(f"no kernel {kernel_id!r}")


class ApiVersionHandler(JupyterHandler):
    async def get(self) -> None:
        try:
            version = metadata.version("jupyter_server")
        except metadata.PackageNotFoundError:
            version = "2.0.0"
        self.send({"version": version, "kernelmode": True})


class KernelSpecsHandler(JupyterHandler):
    async def get(self) -> None:
        spec = self.spec()
        self.send({"default": spec["name"], "kernelspecs": {spec["name"]: spec}})


class KernelSpecHandler(JupyterHandler):
    async def get(self, name: str) -> None:
        spec = self.spec()
        if name not in (spec["name"], "python3"):
            raise KernelSpecNotFound(f"no kernelspec {name!r}: this server offers {spec['name']!r}")
        self.send(spec)


class KernelSpecResourceHandler(JupyterHandler):
    """Logos and the like: none (the clients fall back to their own)."""

    async def get(self, name: str, path: str) -> None:
        raise NotFound(f"no resource {path!r} for kernelspec {name!r}")


class KernelsHandler(JupyterHandler):
    async def get(self) -> None:
        self.send_list(self.kernel_models())

    def send_list(self, items: list[dict[str, Any]]) -> None:
        self.set_status(200)
        self.finish(json.dumps(items))

    async def post(self) -> None:
        req = self.body_model(KernelCreate)
        name = spec_name(self.backend)
        if req.name not in (None, name, "python3"):
            raise InvalidRequest(f"no kernelspec {req.name!r}: this server offers {name!r}")
        info = await self.services.sessions.create(SessionCreate(), self.principal)
        _started_here.setdefault(self.services.sessions, set()).add(info.session_id)
        model = self.kernel_model(info)
        self.set_header("Location", f"/api/kernels/{model['id']}")
        self.send(model, 201)


class KernelHandler(JupyterHandler):
    forward_by = "kernel"

    async def get(self, kernel_id: str) -> None:
        self.send(self.kernel_model(self.session_of(kernel_id)))

    async def delete(self, kernel_id: str) -> None:
        info = self.session_of(kernel_id)
        ours = _started_here.get(self.services.sessions, set())
        if info.session_id in ours:
            await self.services.sessions.delete(info.session_id)
            ours.discard(info.session_id)
        else:  # an agent's session: the person detaches, the session stays
            audit("jupyter_detached", session_id=info.session_id, tenant=info.tenant)
        self.set_status(204)
        self.finish()


class KernelInterruptHandler(JupyterHandler):
    forward_by = "kernel"

    async def post(self, kernel_id: str) -> None:
        await self.services.sessions.interrupt(self.session_of(kernel_id).session_id)
        self.set_status(204)
        self.finish()


class KernelRestartHandler(JupyterHandler):
    forward_by = "kernel"

    async def post(self, kernel_id: str) -> None:
        info = await self.services.sessions.restart(self.session_of(kernel_id).session_id)
        self.send(self.kernel_model(info))


class SessionsListHandler(JupyterHandler):
    """Jupyter's notebook sessions live in the client's own server: none here."""

    async def get(self) -> None:
        self.set_status(200)
        self.finish("[]")


class JupyterChannelsHandler(ChannelsHandler):
    """``/api/kernels/{id}/channels``: the console channel's machinery (tap, bounds, queue) for
    Jupyter clients, in the v1 binary protocol or the legacy JSON one."""

    allow_legacy = True
    forward_by = "kernel"

    def session_of(self, principal: Principal, ref: str) -> str:
        return find_session(self.services.sessions, principal, ref).session_id


def jupyter_routes() -> list[tuple[str, type[web.RequestHandler]]]:
    """(URL pattern, handler) of the Jupyter API."""
    return [
        (r"/api/?", ApiVersionHandler),
        (r"/api/kernelspecs/?", KernelSpecsHandler),
        (r"/api/kernelspecs/([^/]+)/?", KernelSpecHandler),
        (r"/kernelspecs/([^/]+)/(.+)", KernelSpecResourceHandler),
        (r"/api/kernels/?", KernelsHandler),
        (rf"/api/kernels/({KID})/?", KernelHandler),
        (rf"/api/kernels/({KID})/interrupt", KernelInterruptHandler),
        (rf"/api/kernels/({KID})/restart", KernelRestartHandler),
        (rf"/api/kernels/({KID})/channels", JupyterChannelsHandler),
        (r"/api/sessions/?", SessionsListHandler),
    ]
