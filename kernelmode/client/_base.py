"""Everything the two client flavours share that does no I/O (after httpx's ``BaseClient``).

Settings (URL, token, timeouts, retries), the retry policy, error mapping (``errors.from_wire``,
on the explicit code table of ``errors.ERRORS``), and the steps of long-polling a run.
``Client`` and ``AsyncClient`` add only the sending; ``Session`` and ``AsyncSession`` only the
delegation.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, TypeVar

import httpx

from .. import errors
from ..errors import ServerUnreachable
from ..models import RunProgress, RunResult, SessionInfo
from ._routes import Call

T = TypeVar("T")
DEFAULT_URL = "http://127.0.0.1:8888"
_RETRYABLE_STATUS = {502, 503, 504}
MAX_RETRY_AFTER = 60.0  # longest a retry waits on a server's Retry-After


def _code(r: httpx.Response) -> str | None:
    """The error code of an answer, if it is one of ours."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(r.json()["error"]["code"])
    return None


def _ran(r: httpx.Response) -> bool:
    """Whether a refusal names a run that did start (``details.run_id``: its manager lost the
    session mid-run, and the new owner ended it): that request is not sent again."""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return bool(r.json()["error"]["details"]["run_id"])
    return False


def error_from_response(r: httpx.Response) -> errors.KernelmodeError:
    """The server's ``{"error": {"code", "message"}}`` as the matching exception."""
    try:
        body = r.json()["error"]
        code, message, details = str(body["code"]), str(body["message"]), body.get("details")
    except (ValueError, KeyError, TypeError):  # not ours (a proxy's page): the class of its status
        code, message, details = "http_error", f"HTTP {r.status_code}: {r.text[:300]}", None
    return errors.from_wire(message, code=code, status=r.status_code, details=details)


def final(p: RunProgress) -> RunResult:
    """The RunResult of a run that is done, or the exception of a run that could not complete."""
    if p.result is not None:
        return p.result
    failure = p.failure
    if failure is None:
        raise errors.KernelmodeError("the run ended without a result")
    raise errors.from_wire(failure.message, code=failure.code, details=failure.details)


class BaseClient:
    """Connection settings and the rules for answers and retries."""

    def __init__(self, url: str | None, token: str | None, timeout: float, retries: int) -> None:
        self.url = (url or os.environ.get("KERNELMODE_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("KERNELMODE_TOKEN")
        self.timeout = timeout
        self.retries = retries

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _timeout(self, call: Call[Any]) -> httpx.Timeout:
        return httpx.Timeout(self.timeout, read=call.timeout or self.timeout)

    @staticmethod
    def _finish(call: Call[T], r: httpx.Response) -> T:
        if r.status_code not in call.route.ok:
            raise error_from_response(r)
        return call.route.parse(r)

    def _should_retry(self, call: Call[Any], attempt: int, r: httpx.Response | None,
                      exc: Exception | None) -> bool:
        if attempt >= self.retries:
            return False
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return True  # the request never reached the server
        if r is not None and r.status_code == 503 and _code(r) in ("server_busy", "session_owned_elsewhere"):
            return not _ran(r)  # refused before anything was done (a burst, a takeover): any request may come again
        return r is not None and call.route.retry_safe and r.status_code in _RETRYABLE_STATUS

    @staticmethod
    def _backoff(attempt: int, r: httpx.Response | None = None) -> float:
        """The server's Retry-After (seconds, at most MAX_RETRY_AFTER), else an exponential back-off."""
        with contextlib.suppress(ValueError, TypeError):
            if r is not None and "retry-after" in r.headers:
                return min(MAX_RETRY_AFTER, max(0.0, float(r.headers["retry-after"])))
        return 0.2 * 2 ** attempt

    @staticmethod
    def _unreachable(url: str, exc: Exception) -> ServerUnreachable:
        return ServerUnreachable(f"cannot reach the kernelmode server at {url}: {exc}")

    @staticmethod
    def _artifact_bytes(r: httpx.Response) -> bytes:
        if r.status_code != 200:
            raise error_from_response(r)
        return r.content


class BaseSession:
    """What a session handle is: its client, its id and the SessionInfo last seen."""

    def __init__(self, info: SessionInfo) -> None:
        self.info = info
        self.id = info.session_id

    def __repr__(self) -> str:
        return f"<kernelmode {type(self).__name__} {self.id}>"
