"""The client honours a 503 server_busy's Retry-After (a create refused in a burst is sent again
after it), and exposes it when it gives up."""

from __future__ import annotations

import httpx
import pytest

from kernelmode.client import Client
from kernelmode.errors import ServerBusy

BUSY = {"error": {"code": "server_busy", "message": "busy", "details": {"retry_after_seconds": 0}}}
INFO = {"session_id": "s1", "status": "idle", "created_at": "2026-01-01T00:00:00Z",
        "last_activity": "2026-01-01T00:00:00Z", "ttl_seconds": 60, "sandbox": "bwrap",
        "limits": {"memory_mb": 1024, "cpu_seconds": 600, "pids": 128, "disk_mb": 1024}}


def client(answers: list[httpx.Response], retries: int = 2) -> tuple[Client, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers.pop(0)

    return Client("http://km.test", token="t", retries=retries, transport=httpx.MockTransport(handle)), seen


def test_a_create_refused_as_busy_is_sent_again_after_retry_after() -> None:
    km, seen = client([httpx.Response(503, json=BUSY, headers={"Retry-After": "0"}), httpx.Response(201, json=INFO)])
    assert km.create_session().id == "s1"
    assert [r.method for r in seen] == ["POST", "POST"]


def test_past_its_retries_the_client_raises_server_busy_with_when_to_come_back() -> None:
    km, seen = client([httpx.Response(503, json=BUSY, headers={"Retry-After": "0"})] * 2, retries=1)
    with pytest.raises(ServerBusy) as e:
        km.create_session()
    assert e.value.details == {"retry_after_seconds": 0} and len(seen) == 2


def test_another_503_of_a_create_is_not_sent_again() -> None:
    km, seen = client([httpx.Response(503, json={"error": {"code": "kernel_unavailable", "message": "x"}})])
    with pytest.raises(Exception, match="x"):
        km.create_session()
    assert len(seen) == 1


def test_a_run_refused_as_owned_elsewhere_is_sent_again() -> None:
    """A run forwarded between managers while the session's lease moved (api/forwarding.py):
    nothing was run, so even a POST is sent again, to whichever manager answers next."""
    moved = {"error": {"code": "session_owned_elsewhere", "message": "send it again"}}
    done = {"run_id": "r" * 32, "session_id": "s1", "status": "ok"}
    km, seen = client([httpx.Response(503, json=moved, headers={"Retry-After": "0"}), httpx.Response(200, json=done)])
    assert km.execute("s1", "1").status == "ok"
    assert [r.method for r in seen] == ["POST", "POST"]


def test_a_run_its_manager_lost_mid_run_is_not_sent_again() -> None:
    """A manager frozen past its lease while the run was in flight: the new owner ended the run
    (interrupted) and the refusal names it (details.run_id): sending it again would run it twice."""
    lost = {"error": {"code": "session_owned_elsewhere", "message": "taken over mid-run",
                      "details": {"run_id": "r" * 32}}}
    km, seen = client([httpx.Response(503, json=lost, headers={"Retry-After": "0"})])
    with pytest.raises(Exception, match="taken over mid-run"):
        km.execute("s1", "1")
    assert len(seen) == 1
