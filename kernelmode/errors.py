"""The exceptions of kernelmode: one tree, each with a stable ``code`` and ``http_status``.

::

    KernelmodeError                  (500 internal)
    ├── ConfigError                  (500 config_invalid)     a bad kernelmode.yaml / env var
    ├── SetupFailed                  (500 setup_failed)       `kernelmode setup` could not build
    ├── InvalidRequest               (422 invalid_request)    a request that fails validation
    │   ├── BadJSON                  (400 bad_json)
    │   ├── WebsocketRequired        (400 websocket_required) a plain GET of a /channels route
    │   ├── LimitExceeded            (422 limit_exceeded)     a limit asked above its ceiling
    │   └── NoWheel                  (422 no_wheel)           no wheel for the kernel's interpreter
    ├── Unauthorized                 (401 unauthorized)
    ├── Forbidden                    (403 forbidden)          a bad or expired download link
    │   ├── PackageRefused           (403 package_refused)    the package policy, or a kernel package
    │   ├── EgressRefused            (403 egress_refused)     an egress policy wider than allowed
    │   └── EgressCapReached         (403 egress_cap_reached) a session's egress bytes are spent
    │                                                           (egress/streams.py; the connection is cut)
    ├── NotFound                     (404 not_found)
    │   ├── SessionNotFound          (404 session_not_found)
    │   ├── RunNotFound              (404 run_not_found)
    │   ├── ApprovalNotFound         (404 approval_not_found) no such pending tool call
    │   ├── CheckpointNotFound       (404 checkpoint_not_found)
    │   ├── FileNotFound             (404 file_not_found)     in the session's workspace
    │   └── KernelSpecNotFound       (404 kernelspec_not_found) the Jupyter API
    ├── MethodNotAllowed             (405 method_not_allowed)
    ├── Conflict                     (409 conflict)
    │   ├── SessionExists            (409 session_exists)
    │   ├── CheckpointFailed         (409 checkpoint_failed)  nothing was saved
    │   │   └── CheckpointAnswerRefused (502 checkpoint_answer_refused) the kernel's snapshot answer is malformed
    │   ├── FileExists               (409 file_exists)
    │   ├── ApprovalDecided          (409 approval_decided)   answered, timed out or withdrawn
    │   ├── WorkspaceChanged         (409 workspace_changed)  kernel code moved the folder
    │   └── HostOnly                 (409 host_only)          needs the manager's disk; kernels on gateway.url
    ├── PayloadTooLarge              (413 payload_too_large)
    │   ├── WorkspaceFull            (413 workspace_full)
    │   └── ImageTooLarge            (413 image_too_large)    MCP: cannot be shown inline
    ├── TooManyRequests              (429 too_many_requests)  REST adds a Retry-After header
    │   ├── TooManySessions          (429 too_many_sessions)
    │   └── QuotaExceeded            (429 quota_exceeded)     a tenant's sessions or runs per minute
    ├── SandboxUnavailable           (503 sandbox_unavailable)
    ├── ServerBusy                   (503 server_busy)        too many kernel starts queued; REST adds Retry-After
    ├── GatewayError                 (502 gateway_error)      the Kernel Gateway failed us
    │   ├── GatewayForbidden         (502 gateway_forbidden)  the gateway answered 403
    │   └── GatewayUnavailable       (503 gateway_unavailable)
    ├── KernelUnavailable            (503 kernel_unavailable) the session's kernel cannot run code
    │   ├── FilesTimeout             (503 files_timeout)      no answer to a file request in time
    │   ├── RestartCut               (503 restart_cut)        a restart cut a kernel's readying short
    │   │                                                       (sessions/readying.py; answered in place)
    │   └── SessionOwnedElsewhere    (503 session_owned_elsewhere) another manager owns the session,
    │                                                           or will once it adopts it (retry)
    ├── StoreError                   (502 store_error)        the artifact store failed
    ├── SessionStoreUnavailable      (503 session_store_unavailable) PostgreSQL (store.url) did not answer
    ├── ManagerGone                  (503 manager_gone)       the session's manager does not answer;
    │                                                           another adopts it within the lease
    ├── FileTransferFailed           (502 file_transfer_failed) the kernel's file agent answered wrongly
    ├── ToolFailed                   (502 tool_failed)        a host tool gave no result
    ├── PackageFetchFailed           (502 package_fetch_failed) the package index or pip failed
    ├── MessageTooLarge              (500 message_too_large)  an MCP answer over the cap
    ├── IllegalTransition            (500 illegal_transition) a kernel state change the table forbids
    ├── FrameError                   (400 bad_frame)          a refused websocket frame
    ├── BridgeError                  (502 bridge_error)       the console's websocket
    └── ServerUnreachable            (0 unreachable)          the client got no answer

Every class lives here, and ``ERRORS`` names each by its code, so that a process that imports
only the client knows every code the server sends (after docker-py's ``errors.py``). A code
this side does not know (a newer server) gets the class for its HTTP status (``from_wire``).
Nothing else is raised on purpose, with one exception by design: the kernel side
(``kernel/preamble.py``, stdlib only, runs where kernelmode is not installed) raises its own
``tools.ToolError`` (and its subclass ``ToolDenied``, a call that needed approval and was
denied) inside kernels, the in-kernel face of ``ToolFailed``.

A failure of user code is never an exception: it is a RunResult with ``status="error"``.
Front doors map these to their own wire format at one point each: REST and the Jupyter API in
``api/handlers.py`` (``BaseHandler.write_error``: HTTP status + ``{"error": {"code",
"message"}}``; the Jupyter API adds its keys in ``error_document``), their websockets in
``api/channels.py`` (``_refuse``), MCP in ``mcp/tools.py`` (``error_result``: an ``isError``
result with the same ``{"error": ...}`` as structured content; ``protocol_error`` when the
service could not start). The client turns the wire form back into these (``from_wire``).
"""

from __future__ import annotations


class KernelmodeError(Exception):
    """Root of every error kernelmode raises on purpose."""

    code = "internal"
    http_status = 500

    def __init__(self, message: str, *, details: object | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, object]:
        body: dict[str, object] = {"code": self.code, "message": self.message}
        if self.details is not None:
            body["details"] = self.details
        return body


class ConfigError(KernelmodeError):
    code = "config_invalid"


class SetupFailed(KernelmodeError):
    code = "setup_failed"


class InvalidRequest(KernelmodeError):
    """A request that fails validation (named apart from pydantic's ``ValidationError``)."""

    code = "invalid_request"
    http_status = 422


class BadJSON(InvalidRequest):
    code = "bad_json"
    http_status = 400


class WebsocketRequired(InvalidRequest):
    """A plain GET of a websocket route (it would open the kernel's channels for nothing)."""

    code = "websocket_required"
    http_status = 400


class LimitExceeded(InvalidRequest):
    code = "limit_exceeded"


class NoWheel(InvalidRequest):
    """No wheel for the kernel's interpreter and platform: kernelmode never builds on the host."""

    code = "no_wheel"


class Unauthorized(KernelmodeError):
    code = "unauthorized"
    http_status = 401


class Forbidden(KernelmodeError):
    code = "forbidden"
    http_status = 403


class PackageRefused(Forbidden):
    """A package the policy refuses (the message names the rule), or one that would replace a
    package of the kernel's own environment."""

    code = "package_refused"


class EgressRefused(Forbidden):
    """A session asked for egress its tenant (or the server) does not allow: the message names
    the host pattern."""

    code = "egress_refused"


class EgressCapReached(Forbidden):
    """A session's egress byte cap (``egress.max_bytes_per_session``) was reached mid-transfer: the
    proxy cuts that connection (new ones get a 403 that says so)."""

    code = "egress_cap_reached"


class NotFound(KernelmodeError):
    code = "not_found"
    http_status = 404


class SessionNotFound(NotFound):
    code = "session_not_found"


class RunNotFound(NotFound):
    code = "run_not_found"


class ApprovalNotFound(NotFound):
    code = "approval_not_found"


class CheckpointNotFound(NotFound):
    code = "checkpoint_not_found"


class FileNotFound(NotFound):
    code = "file_not_found"


class KernelSpecNotFound(NotFound):
    """An unknown kernelspec name (an unknown kernel is SessionNotFound)."""

    code = "kernelspec_not_found"


class MethodNotAllowed(KernelmodeError):
    code = "method_not_allowed"
    http_status = 405


class Conflict(KernelmodeError):
    code = "conflict"
    http_status = 409


class SessionExists(Conflict):
    code = "session_exists"


class CheckpointFailed(Conflict):
    """Nothing was saved (the kernel is busy or dead, the store failed, the file is too large)."""

    code = "checkpoint_failed"


class CheckpointAnswerRefused(CheckpointFailed):
    """The kernel answered the snapshot request with something malformed: nothing was saved."""

    code = "checkpoint_answer_refused"
    http_status = 502


class FileExists(Conflict):
    code = "file_exists"


class ApprovalDecided(Conflict):
    code = "approval_decided"


class WorkspaceChanged(Conflict):
    """Kernel code removed or replaced the upload's folder while it was written."""

    code = "workspace_changed"


class HostOnly(Conflict):
    """A feature that needs the session's workspace on the manager's own disk (checkpoints of
    workspace files, package layers) asked for while the kernels run on a remote gateway."""

    code = "host_only"


class PayloadTooLarge(KernelmodeError):
    code = "payload_too_large"
    http_status = 413


class WorkspaceFull(PayloadTooLarge):
    code = "workspace_full"


class ImageTooLarge(PayloadTooLarge):
    """An image that cannot be shown inline within its budget (too many pixels, undecodable)."""

    code = "image_too_large"


class TooManyRequests(KernelmodeError):
    code = "too_many_requests"
    http_status = 429
    # A hint for Retry-After when the error has no details.retry_after_seconds of its own: a
    # session is freed when a client deletes one or the reaper ends an idle one.
    retry_after_seconds = 15


class TooManySessions(TooManyRequests):
    code = "too_many_sessions"


class QuotaExceeded(TooManyRequests):
    code = "quota_exceeded"  # a run-rate refusal gives its own retry_after_seconds


class SandboxUnavailable(KernelmodeError):
    code = "sandbox_unavailable"
    http_status = 503


class ServerBusy(KernelmodeError):
    """A create that would wait longer than ``sessions.create_queue_seconds`` for its kernel
    (a burst); ``details.retry_after_seconds`` says when to try again."""

    code = "server_busy"
    http_status = 503
    retry_after_seconds = 2


class GatewayError(KernelmodeError):
    code = "gateway_error"
    http_status = 502


class GatewayForbidden(GatewayError):
    """The gateway refused a request with 403 (Enterprise Gateway: a listing it does not allow,
    a KERNEL_USERNAME it does not authorize)."""

    code = "gateway_forbidden"


class GatewayUnavailable(GatewayError):
    code = "gateway_unavailable"
    http_status = 503


class KernelUnavailable(KernelmodeError):
    code = "kernel_unavailable"
    http_status = 503


class FilesTimeout(KernelUnavailable):
    """The kernel did not answer a file request in time: busy with a cell, or dead."""

    code = "files_timeout"


class RestartCut(KernelUnavailable):
    """A restart cancelled the kernel's start or restore under way; whoever holds the session's
    lock restarts the kernel in its place (sessions/readying.py), so it never reaches a client."""

    code = "restart_cut"


class SessionOwnedElsewhere(KernelUnavailable):
    """Another manager sharing the store owns the session (or its dead owner's lease has not
    expired yet, and a live manager adopts it soon): retry in a moment (sessions/ownership.py)."""

    code = "session_owned_elsewhere"


class StoreError(KernelmodeError):
    """The store could not keep or find an object (outage, refused, missing)."""

    code = "store_error"
    http_status = 502


class SessionStoreUnavailable(KernelmodeError):
    """The session store's database (PostgreSQL, ``store.url``) could not be reached or did not
    answer in time; the next call connects again."""

    code = "session_store_unavailable"
    http_status = 503


class ManagerGone(KernelmodeError):
    """The manager that owns the session (its lease) did not take the forwarded request
    (connection refused or timed out): nothing was done; another manager adopts the session once
    the lease expires (api/forwarding.py). REST adds a Retry-After of the lease bound."""

    code = "manager_gone"
    http_status = 503
    retry_after_seconds = 10


class FileTransferFailed(KernelmodeError):
    """The kernel's file agent answered something this manager refuses (bad shape, a path
    outside the workspace, more bytes than asked or announced, a wrong checksum)."""

    code = "file_transfer_failed"
    http_status = 502


class ToolFailed(KernelmodeError):
    """A tool could not give a result; the message is shown to kernel code as ToolError."""

    code = "tool_failed"
    http_status = 502


class PackageFetchFailed(KernelmodeError):
    """The download failed for another reason (index unreachable, pip failed)."""

    code = "package_fetch_failed"
    http_status = 502


class MessageTooLarge(KernelmodeError):
    """An answer that is not a tool result is over the cap (nothing of ours sends one)."""

    code = "message_too_large"


class IllegalTransition(KernelmodeError):
    """A kernel was asked to move to a state its transition table does not allow from where it
    is (sessions/kernel_state.py): a bug in the manager, refused rather than done silently."""

    code = "illegal_transition"


class FrameError(KernelmodeError, ValueError):
    """A frame refused: malformed, or over one of its bounds (the message says which)."""

    code = "bad_frame"
    http_status = 400


class BridgeError(KernelmodeError):
    """The console's websocket to the server could not be opened or was refused."""

    code = "bridge_error"
    http_status = 502


class ServerUnreachable(KernelmodeError):
    """The request could not reach the server (refused, timed out, connection dropped)."""

    code = "unreachable"
    http_status = 0


# Every class by its code, written out (tests/unit/test_error_tree.py checks that it names
# every subclass, and the client test that a bare client knows them all).
ERRORS: dict[str, type[KernelmodeError]] = {cls.code: cls for cls in (
    KernelmodeError, ConfigError, SetupFailed,
    InvalidRequest, BadJSON, WebsocketRequired, LimitExceeded, NoWheel,
    Unauthorized, Forbidden, PackageRefused, EgressRefused, EgressCapReached,
    NotFound, SessionNotFound, RunNotFound, ApprovalNotFound, CheckpointNotFound, FileNotFound,
    KernelSpecNotFound, MethodNotAllowed,
    Conflict, SessionExists, CheckpointFailed, CheckpointAnswerRefused, FileExists, ApprovalDecided, WorkspaceChanged, HostOnly,
    PayloadTooLarge, WorkspaceFull, ImageTooLarge,
    TooManyRequests, TooManySessions, QuotaExceeded,
    SandboxUnavailable, ServerBusy, GatewayError, GatewayForbidden, GatewayUnavailable,
    KernelUnavailable, FilesTimeout, RestartCut, SessionOwnedElsewhere, StoreError, SessionStoreUnavailable,
    ManagerGone,
    FileTransferFailed, ToolFailed, PackageFetchFailed,
    MessageTooLarge, IllegalTransition, FrameError, BridgeError, ServerUnreachable,
)}

# The class for an HTTP status when the code is unknown (a newer server, a proxy's own answer).
STATUS_ERRORS: dict[int, type[KernelmodeError]] = {
    400: InvalidRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 405: MethodNotAllowed,
    409: Conflict, 413: PayloadTooLarge, 422: InvalidRequest, 429: TooManyRequests,
}


def from_wire(message: str, *, code: str | None = None, status: int | None = None,
              details: object | None = None) -> KernelmodeError:
    """The exception for an error seen on the wire: the class of its ``code``, else of its HTTP
    ``status``, else the root. The code and status are the wire's own, even where the class has
    others (a code this side does not know is kept; no code at all is ``http_error``)."""
    cls = ERRORS.get(code) if code is not None else None
    if cls is None:
        cls = STATUS_ERRORS.get(status, KernelmodeError) if status is not None else KernelmodeError
    exc = cls(message, details=details)
    if code is not None:
        exc.code = code
    elif cls is KernelmodeError:
        exc.code = "http_error"
    if status is not None:
        exc.http_status = status
    return exc
