"""Which manager serves a request (api/forwarding.py's Router), against stand-ins of the
manager's live map, the store and the ownership: a session live here never costs a store call;
a forwarded request is never forwarded again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kernelmode.api.forwarding import Router
from kernelmode.errors import ServerBusy, SessionOwnedElsewhere

OTHER = "http://10.0.0.2:8888"


class NoStore:
    """A store that must not be asked (the local path)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the store was asked ({name}) for a session live here")


class Owners:
    manager_id = "me"

    def __init__(self, owners: dict[str, str]) -> None:
        self.owners = owners
        self.asked: list[str] = []

    def owner_url(self, session_id: str) -> str | None:
        self.asked.append(session_id)
        return self.owners.get(session_id)


def router(live: set[str], owners: dict[str, str], store: Any = None, runs: dict[str, Any] | None = None) -> tuple[Router, Owners]:
    sessions = SimpleNamespace(peek=lambda sid: object() if sid in live else None,
                               runner=SimpleNamespace(runs=runs or {}))
    own = Owners(owners)

    async def make() -> Router:
        return Router(sessions, store if store is not None else NoStore(), own, 10)  # type: ignore[arg-type]

    return asyncio.run(make()), own


def test_a_session_live_here_is_served_here_without_a_store_call() -> None:
    r, own = router({"s1"}, {"s1": OTHER})
    assert r.for_session("s1", forwarded=False) is None
    assert r.for_session("s1", forwarded=True) is None
    assert own.asked == []


def test_a_session_owned_elsewhere_is_forwarded_once() -> None:
    r, own = router(set(), {"s2": OTHER})
    assert r.for_session("s2", forwarded=False) == OTHER
    with pytest.raises(SessionOwnedElsewhere, match="send it again"):
        r.for_session("s2", forwarded=True)
    assert r.for_session("nobodys", forwarded=True) is None  # served (adopted) here


def test_a_run_in_flight_here_costs_no_store_call_and_a_finished_one_is_served_anywhere() -> None:
    r, _ = router({"s1"}, {}, runs={"r1": SimpleNamespace(stored=False)})
    assert r.for_run("r1", forwarded=False) is None
    done = SimpleNamespace(get_run=lambda rid: SimpleNamespace(status="ok", session_id="s2"))
    r, own = router(set(), {"s2": OTHER}, store=done)
    assert r.for_run("r9", forwarded=False) is None and own.asked == []
    running = SimpleNamespace(get_run=lambda rid: SimpleNamespace(status="running", session_id="s2"))
    r, _ = router(set(), {"s2": OTHER}, store=running)
    assert r.for_run("r9", forwarded=False) == OTHER


def test_an_unknown_run_goes_to_the_manager_its_id_names_and_a_made_up_one_nowhere() -> None:
    from kernelmode.sessions.runs import new_run_id, run_tag

    managers = SimpleNamespace(live=lambda: {"me": "http://me", "b": OTHER, "c": "http://c"})
    r, _ = router(set(), {}, store=SimpleNamespace(managers=managers))
    assert r.find_run(new_run_id(run_tag("b"))) == OTHER
    assert r.find_run(new_run_id(run_tag("me"))) is None  # this manager's own: not here, nowhere
    assert r.find_run("0" * 32) is None and r.find_run("") is None
    assert len(new_run_id(run_tag("b"))) == len(new_run_id("")) == 32


def test_a_jupyter_kernel_id_names_its_session() -> None:
    sid = "0123456789abcdef0123456789abcdef"
    r, _ = router(set(), {sid: OTHER})
    assert r.for_kernel("01234567-89ab-cdef-0123-456789abcdef", forwarded=False) == OTHER
    assert r.for_kernel("not-a-uuid", forwarded=False) is None


def test_an_owner_read_from_the_store_is_remembered_briefly_and_forgotten_when_gone() -> None:
    """A client behind a balancer sends a session's requests through the same non-owner again and
    again: the store is asked once per OWNER_CACHE_SECONDS, not per request; an owner that does
    not answer is forgotten at once; nobody's session is never remembered (served, so adopted, here)."""
    r, own = router(set(), {"s3": OTHER})
    assert [r.for_session("s3", forwarded=False) for _ in range(5)] == [OTHER] * 5
    assert own.asked == ["s3"]
    r.gone(OTHER, OSError("refused"))
    assert r.for_session("s3", forwarded=False) == OTHER
    assert own.asked == ["s3", "s3"]
    assert r.for_session("nobodys", forwarded=False) is None
    assert r.for_session("nobodys", forwarded=False) is None
    assert own.asked == ["s3", "s3", "nobodys", "nobodys"]


def test_forwarding_slots_refuse_at_once_past_the_bound_and_come_back() -> None:
    r, _ = router(set(), {})
    fw = r.forwarder
    fw.max_connections = 2
    fw.take()
    with fw.slot():
        with pytest.raises(ServerBusy, match="passing 2 requests on"):
            fw.take()
    fw.take()  # the slot's own came back
    fw.give()
    fw.give()
    assert fw.in_use == 0


def test_an_mcp_call_for_a_session_elsewhere_sends_only_the_callers_token_marked_forwarded() -> None:
    """remote.py: the owner gets the caller's own Authorization and the forwarding mark (so it
    never passes the call on), nothing else of the MCP request; stdio (no headers) or no token:
    served here."""
    from kernelmode.api.forwarding import FORWARDED_HEADER
    from kernelmode.mcp.remote import owner_of

    r, _ = router(set(), {"s2": OTHER})
    headers = {"authorization": "Bearer caller", "x-kernelmode-tenant": "alpha", "cookie": "a=1",
               "mcp-session-id": "m1"}
    owner = owner_of(r, headers, "s2")
    assert owner is not None and owner.base_url == OTHER
    assert owner.headers == {"Authorization": "Bearer caller", FORWARDED_HEADER: "me"}
    assert owner_of(r, None, "s2") is None
    assert owner_of(r, {"x-kernelmode-tenant": "alpha"}, "s2") is None
    assert owner_of(None, headers, "s2") is None
    assert owner_of(r, headers, "nobodys") is None


def test_a_change_that_broke_off_after_it_was_sent_says_to_look_before_sending_it_again() -> None:
    """A run that reached a manager which then died may have run: "send it again" would run its
    code twice. Only a read, or a connection that never opened, is simply sent again."""
    r, _ = router(set(), {})
    url = "http://10.0.0.2:8888"
    broke = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    refused = httpx.ConnectError("All connection attempts failed")
    for error, method in ((refused, "POST"), (broke, "GET"), (httpx.ConnectTimeout("t"), "PUT")):
        gone = r.gone(url, error, method)
        assert gone.code == "manager_gone" and "send the request again then" in gone.message, (method, error)
        assert not gone.details.get("maybe_done")
    for method in ("POST", "PUT", "DELETE"):
        gone = r.gone(url, broke, method)
        assert gone.details["maybe_done"] is True and gone.details["retry_after_seconds"] == 10
        assert "may have been carried out" in gone.message and "/notebook" in gone.message
        assert "send the request again then" not in gone.message
