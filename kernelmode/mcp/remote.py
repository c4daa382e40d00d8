"""MCP tool calls about a session another manager owns, served by that owner.

An MCP connection lives in the manager that opened it (http.py), but the session a tool call
names may be another manager's (a failover: the connection was opened anew on B, the session was
adopted by C). The tool still runs here; what it does to the session is the REST call a client
would make, sent to the owner with the caller's own ``Authorization`` header (the MCP request's,
from the SDK's public ``Context.headers``) and marked forwarded (api/forwarding.py), so the owner
checks the token as for any request and never passes the call on. The owner's answer is rendered
here by the same code as a local call's (answers.py), so the text, the isError texts and the
output budget are the same; a run's output comes as progress while it is followed, and its
approvals are asked of this client, as for a local run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mcp_types import CallToolResult

from ..errors import ApprovalDecided, ApprovalNotFound, KernelmodeError, from_wire
from ..models import RunError, RunProgress, RunResult
from ..tools.approvals import Asker
from .answers import RunAnswers
from .elicit import asker
from .render import clip

# httpx (~40 ms of imports) is imported where used: only several managers forward, and every
# start (the embedded `kernelmode mcp` at each launch of its host) would pay for it.
if TYPE_CHECKING:
    import httpx

    from ..api.forwarding import Router

_MAX_POLL_SECONDS = 60  # GET /v1/runs/{id} waits at most this long per request
_NO_OUTPUT = 1 << 62  # an offset no run reaches: the owner's wait then ends on the run's end only


class Owner:
    """REST calls on the manager that owns a session, as the MCP caller."""

    def __init__(self, router: Router, base_url: str, authorization: str) -> None:
        # Imported here: the embedded server's start imports no REST layer (test_start_imports).
        from ..api.forwarding import FORWARDED_HEADER

        self.router = router
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": authorization, FORWARDED_HEADER: router.manager_id}

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """The owner's JSON answer; its error as the KernelmodeError of its code (the same
        message a local call raises), ManagerGone if it does not answer, ServerBusy if this
        manager's forwarding connections are all in use."""
        import httpx
        forwarder = self.router.forwarder
        with forwarder.slot():
            try:
                r = await forwarder.client.request(method, self.base_url + path, headers=self.headers, **kwargs)
            except httpx.PoolTimeout as e:  # the slot should have said so: answered alike
                raise forwarder.busy(waited=True) from e
            except httpx.HTTPError as e:
                raise self.router.gone(self.base_url, e, method) from e
        if r.status_code >= 400:
            raise wire_error(r)
        return r.json() if r.content else None


def wire_error(r: httpx.Response) -> KernelmodeError:
    """An error answer of the owner (``{"error": {"code", "message", "details"}}``) as the
    exception it raised."""
    with contextlib.suppress(ValueError, TypeError, KeyError):
        err = r.json()["error"]
        return from_wire(str(err["message"]), code=str(err["code"]), status=r.status_code,
                         details=err.get("details"))
    return from_wire(r.text or r.reason_phrase, status=r.status_code)


def _caller(router: Router | None, headers: Mapping[str, str] | None) -> tuple[Router, str] | None:
    """The router and the caller's ``Authorization`` header, if a call can go to another manager.
    Over stdio (no headers) there is no caller token to send: served here (refused when owned
    elsewhere)."""
    if router is None or headers is None or not (auth := headers.get("authorization")):
        return None
    return router, auth


def owner_of(router: Router | None, headers: Mapping[str, str] | None, session_id: str) -> Owner | None:
    """The owner of ``session_id`` when it is another live manager (None: served here)."""
    if (caller := _caller(router, headers)) is None:
        return None
    url = caller[0].for_session(session_id, False)  # the hop to the owner is marked: it goes no further
    return Owner(caller[0], url, caller[1]) if url is not None else None


def run_owner(router: Router | None, headers: Mapping[str, str] | None, run_id: str, unknown: bool) -> Owner | None:
    """The manager that runs ``run_id`` when it is another one (a run in flight there; one
    ``unknown`` here and to the store may be queued there, not yet written: its id names that manager)."""
    if (caller := _caller(router, headers)) is None:
        return None
    r, auth = caller
    url = r.for_run(run_id, False) or (r.find_run(run_id) if unknown else None)
    return Owner(r, url, auth) if url is not None else None


def snapshot(progress: RunProgress, events: list[dict[str, Any]]) -> RunResult:
    """A run still going, as the owner's snapshot gives it (``LiveRun.snapshot``): its output so
    far, from its events, and what the owner cut of it (the flags the answer's notes read)."""
    stdout = "".join(e["text"] for e in events if e.get("type") == "stream" and e.get("name") == "stdout")
    stderr = "".join(e["text"] for e in events if e.get("type") == "stream" and e.get("name") == "stderr")
    outputs, result, error = [], None, None
    for e in events:
        kind = e.get("type")
        if kind in ("display_data", "update_display_data") or (
                kind == "execute_result" and set(e.get("data", {})) - {"text/plain"}):
            outputs.append(e)
        if kind == "execute_result":
            result = e.get("data", {}).get("text/plain")
        elif kind == "error":
            error = RunError(ename=e.get("ename", ""), evalue=e.get("evalue", ""), traceback=e.get("traceback", ""))
    return RunResult(run_id=progress.run_id, session_id=progress.session_id, status=progress.status,
                     stdout=stdout, stderr=stderr, outputs=outputs, result=result, error=error,
                     pending_approvals=progress.pending_approvals, truncated=progress.truncated,
                     outputs_dropped=progress.outputs_dropped)


async def follow(ctx: Any, owner: Owner, run_id: str, wait: float, ask: Asker | None,
                 first: RunProgress, fresh: bool) -> RunResult:
    """``RunAnswers.follow`` for a run on ``owner``: wait up to ``wait`` s for its end (longer
    while a person is asked), sending its output as progress. ``first``: its state now, events
    from 0 (a look that did not wait: an approval already pending ends no later wait on the
    owner). ``fresh``: the run started with this call (its output so far is news, and so is an
    approval that nobody here can answer)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    progress, events = first, list(first.events)
    offset = first.next_offset
    shows = getattr(ctx, "sends_progress", True)  # else output does not wake the wait (fastcall.py)
    if fresh and shows:
        await _report(ctx, offset, first.events)
    asked = {p.call_id for p in first.pending_approvals} if ask is None and not fresh else set()
    while not progress.done:
        pending = [p for p in progress.pending_approvals if p.call_id not in asked]
        if pending and ask is None:
            break  # an approval came that nobody here can answer: the answer says so
        for p in pending:  # as the run's gate would: each asked once, the wait going on meanwhile
            asked.add(p.call_id)
            approve, reason = await ask(p)  # type: ignore[misc]
            with contextlib.suppress(ApprovalDecided, ApprovalNotFound):  # timed out or withdrawn
                await owner.call("POST", f"/v1/runs/{run_id}/approvals/{p.call_id}",
                                 json={"approve": approve, "reason": reason})
        remaining = deadline - loop.time()
        if remaining <= 0 and not pending:
            break
        progress = RunProgress.model_validate(await owner.call("GET", f"/v1/runs/{run_id}", params={
            "offset": offset if shows else _NO_OUTPUT,
            "wait_seconds": f"{min(max(remaining, 0), _MAX_POLL_SECONDS):.3f}",
            # An approval that came after the last look ends the wait too (not only one during it).
            "approvals_version": progress.approvals_version}))
        if shows:
            events += progress.events
            offset = progress.next_offset
            await _report(ctx, offset, progress.events)
    if progress.failure is not None:  # a KernelmodeError on the owner: the same here
        f = progress.failure
        raise from_wire(f.message, code=f.code, details=f.details)
    if progress.done and progress.result is not None:
        return progress.result
    if not shows:  # the output that came meanwhile, for the snapshot
        rest = RunProgress.model_validate(await owner.call("GET", f"/v1/runs/{run_id}", params={"offset": offset}))
        events += rest.events
        if rest.done and rest.result is not None:
            return rest.result
    return snapshot(progress, events)


async def _report(ctx: Any, offset: int, new: list[dict[str, Any]]) -> None:
    """New output as a progress notification, as ``RunAnswers.follow`` sends it."""
    text = "".join(e["text"] for e in new if e.get("type") == "stream")
    if text:
        with contextlib.suppress(Exception):  # a client that asked for no progress, or left
            await ctx.report_progress(float(offset), None, clip(text, 2000, "progress"))


async def first_look(owner: Owner, run_id: str) -> RunProgress:
    """The run's events so far (from 0) and its state, at once."""
    return RunProgress.model_validate(await owner.call("GET", f"/v1/runs/{run_id}", params={"offset": 0}))


async def run_python(ctx: Any, owner: Owner, answers: RunAnswers, key: str | None, session_id: str,
                     code: str, timeout_seconds: float | None, wait: float, note: str | None) -> CallToolResult:
    """run_python in a session ``owner`` holds: its ``execute``, then its run followed there."""
    ask = asker(ctx, session_id)
    follows = getattr(ctx, "sends_progress", True) or ask is not None
    # Nothing to relay meanwhile: the owner waits, and its answer is the result (or its snapshot).
    started = RunResult.model_validate(await owner.call("POST", f"/v1/sessions/{session_id}/execute", json={
        "code": code, "timeout_seconds": timeout_seconds, "wait_seconds": 0 if follows else wait}))
    result = started
    if follows and started.status in ("running", "awaiting_approval"):
        first = await first_look(owner, started.run_id)
        result = await follow(ctx, owner, started.run_id, wait, ask, first, fresh=True)
    return await answers.result(key, result, note)


async def get_run(ctx: Any, owner: Owner, answers: RunAnswers, key: str | None, run_id: str,
                  wait: float) -> CallToolResult:
    """get_run of a run in flight on ``owner``."""
    first = await first_look(owner, run_id)
    if not first.done and answers.backlog(key, snapshot(first, first.events)):
        wait = 0  # more than a page waits for this reader: the next one at once
    result = await follow(ctx, owner, run_id, wait, asker(ctx, first.session_id), first, fresh=False)
    return await answers.result(key, result, None)
