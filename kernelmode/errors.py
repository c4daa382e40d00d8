"""The exceptions of kernelmode: one tree, each with a stable ``code`` and ``http_status``.

::

    KernelmodeError                  (500 internal)
    ├── ConfigError                  (500 config_invalid)     a bad kernelmode.yaml / env var
    ├── SetupFailed                  (500 setup_failed)       `kernelmode setup` could not build
    ├── InvalidRequest               (422 invalid_request)    a request that fails validation
    │   ├── BadJSON                  (400 bad_json)
    │   ├── LimitExceeded            (422 limit_exceeded)     a limit asked above its ceiling
    │   └── NoWheel                  (422 no_wheel)           packages/errors.py: no wheel for the kernel
    ├── Unauthorized                 (401 unauthorized)
    ├── Forbidden                    (403 forbidden)          a bad or expired download link
    │   └── PackageRefused           (403 package_refused)    packages/errors.py: the policy, or a kernel package
    ├── NotFound                     (404 not_found)
    │   ├── SessionNotFound          (404 session_not_found)
    │   ├── RunNotFound              (404 run_not_found)
    │   ├── ApprovalNotFound         (404 approval_not_found) tools/approvals.py: no such pending call
    │   ├── CheckpointNotFound       (404 checkpoint_not_found) sessions/checkpoints.py
    │   ├── FileNotFound             (404 file_not_found)     artifacts/workspace.py
    │   └── KernelSpecNotFound       (404 kernelspec_not_found) api/jupyter_api.py: the Jupyter API
    ├── Conflict                     (409 conflict)
    │   ├── SessionExists            (409 session_exists)
    │   ├── CheckpointFailed         (409 checkpoint_failed)  sessions/snapshot_call.py: nothing was saved
    │   │   └── CheckpointAnswerRefused (502 checkpoint_failed) the kernel's snapshot answer is malformed
    │   ├── FileExists               (409 file_exists)        artifacts/workspace.py
    │   ├── ApprovalDecided          (409 approval_decided)   tools/approvals.py: answered, timed out or withdrawn
    │   ├── WorkspaceChanged         (409 workspace_changed)  artifacts/workspace.py: kernel code moved the folder
    │   └── HostOnly                 (409 host_only)          needs the manager's disk; kernels on gateway.url
    ├── PayloadTooLarge              (413 payload_too_large)
    │   ├── WorkspaceFull            (413 workspace_full)     artifacts/workspace.py
    │   └── ImageTooLarge            (413 image_too_large)    mcp/images.py: cannot be shown inline
    ├── TooManySessions              (429 too_many_sessions)  REST adds a Retry-After header
    ├── QuotaExceeded                (429 quota_exceeded)     a tenant's sessions or runs per minute (Retry-After too)
    ├── SandboxUnavailable           (503 sandbox_unavailable)
    ├── GatewayError                 (502 gateway_error)      the Kernel Gateway failed us
    │   ├── GatewayForbidden         (502 gateway_forbidden)  the gateway answered 403
    │   └── GatewayUnavailable       (503 gateway_unavailable)
    ├── KernelUnavailable            (503 kernel_unavailable) the session's kernel cannot run code
    │   └── FilesTimeout             (503 files_timeout)      artifacts/channel.py: no answer to a file request in time
    ├── StoreError                   (502 store_error)        artifacts/base.py: the artifact store failed
    ├── FileTransferFailed           (502 file_transfer_failed) artifacts/channel.py: the kernel's file agent answered wrongly
    ├── ToolFailed                   (502 tool_failed)        tools/base.py: a host tool gave no result
    │   └── ToolDenied               (403 tool_denied)        tools/broker.py: a call needing approval was denied
    ├── PackageFetchFailed           (502 package_fetch_failed) packages/errors.py: the index or pip failed
    ├── MessageTooLarge              (500 message_too_large)  mcp/budget.py: an MCP answer over the cap
    ├── FrameError                   (400 bad_frame)          gateway/frames.py: a refused websocket frame
    ├── BridgeError                  (502 bridge_error)       console/bridge.py: the console's websocket
    └── ServerUnreachable            (0 unreachable)          client.py: the client got no answer

Each class lives next to the code that raises it (the module named); this module holds the
ones every room shares. Nothing else is raised on purpose, with one exception by design: the
kernel side (``kernel/preamble.py``, stdlib only, runs where kernelmode is not installed) raises
its own ``tools.ToolError`` (and its subclass ``ToolDenied``) inside kernels, the in-kernel face
of ``ToolFailed``.

A failure of user code is never an exception: it is a RunResult with ``status="error"``.
Front doors map these to their own wire format at one point each: REST in
``api/handlers.py`` (``BaseHandler.write_error``: HTTP status + ``{"error": {"code",
"message"}}``), MCP in ``mcp/tools.py`` (``tool_errors``: an ``isError`` result with the same
``{"error": ...}`` as structured content).
"""

from __future__ import annotations

import warnings


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


class LimitExceeded(InvalidRequest):
    code = "limit_exceeded"


class Unauthorized(KernelmodeError):
    code = "unauthorized"
    http_status = 401


class Forbidden(KernelmodeError):
    code = "forbidden"
    http_status = 403


class NotFound(KernelmodeError):
    code = "not_found"
    http_status = 404


class SessionNotFound(NotFound):
    code = "session_not_found"


class RunNotFound(NotFound):
    code = "run_not_found"


class Conflict(KernelmodeError):
    code = "conflict"
    http_status = 409


class SessionExists(Conflict):
    code = "session_exists"


class HostOnly(Conflict):
    """A feature that needs the session's workspace on the manager's own disk (checkpoints of
    workspace files, package layers) asked for while the kernels run on a remote gateway."""

    code = "host_only"


class PayloadTooLarge(KernelmodeError):
    code = "payload_too_large"
    http_status = 413


class TooManySessions(KernelmodeError):
    code = "too_many_sessions"
    http_status = 429
    # A hint for Retry-After when the error has no details.retry_after_seconds of its own: a
    # session is freed when a client deletes one or the reaper ends an idle one.
    retry_after_seconds = 15


class QuotaExceeded(KernelmodeError):
    code = "quota_exceeded"
    http_status = 429
    retry_after_seconds = 15  # as for TooManySessions; a run-rate refusal gives its own


class SandboxUnavailable(KernelmodeError):
    code = "sandbox_unavailable"
    http_status = 503


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


def __getattr__(name: str) -> type[InvalidRequest]:
    """``ValidationError``: the old name of ``InvalidRequest``, kept while callers move over."""
    if name == "ValidationError":
        warnings.warn("kernelmode.errors.ValidationError is now InvalidRequest", DeprecationWarning,
                      stacklevel=2)
        return InvalidRequest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
