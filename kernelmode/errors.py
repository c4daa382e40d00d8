"""The exceptions of kernelmode, each with a stable machine-readable ``code``.

::

    KernelmodeError                  (500 internal)
    ├── ConfigError                  (500 config_invalid)    a bad kernelmode.yaml / env var
    ├── SetupFailed                  (500 setup_failed)      `kernelmode setup` could not build
    ├── ValidationError              (422 invalid_request)   a request that fails validation
    │   ├── BadJSON                  (400 bad_json)
    │   └── LimitExceeded            (422 limit_exceeded)     a limit asked above its ceiling
    ├── Unauthorized                 (401 unauthorized)
    ├── Forbidden                    (403 forbidden)          a bad or expired download link
    ├── NotFound                     (404 not_found)
    │   ├── SessionNotFound          (404 session_not_found)
    │   └── RunNotFound              (404 run_not_found)
    ├── Conflict                     (409 conflict)
    │   └── SessionExists            (409 session_exists)
    ├── PayloadTooLarge              (413 payload_too_large)
    ├── TooManySessions              (429 too_many_sessions)  REST adds a Retry-After header
    ├── QuotaExceeded                (429 quota_exceeded)     a tenant's sessions or runs per minute (Retry-After too)
    ├── SandboxUnavailable           (503 sandbox_unavailable)
    ├── GatewayError                 (502 gateway_error)      the Kernel Gateway failed us
    │   └── GatewayUnavailable       (503 gateway_unavailable)
    └── KernelUnavailable            (503 kernel_unavailable) the session's kernel cannot run code

A failure of user code is never an exception: it is a RunResult with ``status="error"``.
Front doors map these to their own wire format (REST: HTTP status + JSON body).
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


class ValidationError(KernelmodeError):
    code = "invalid_request"
    http_status = 422


class BadJSON(ValidationError):
    code = "bad_json"
    http_status = 400


class LimitExceeded(ValidationError):
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


class GatewayUnavailable(GatewayError):
    code = "gateway_unavailable"
    http_status = 503


class KernelUnavailable(KernelmodeError):
    code = "kernel_unavailable"
    http_status = 503
