"""A burst of sessions (issue 33): 50 concurrent creates all succeed, or get a clean 503
server_busy with Retry-After and succeed when the client sends them again after it; each session
keeps its own state and sees no other's. Runs on both backends (the Makefile's DOCKER_SUITES).
No timing is asserted: how fast a burst is served is bench/burst.py's business."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from kernelmode.client import AsyncClient
from tests.conftest import Server, start_server, wait_for

N = 50


@pytest.fixture(scope="module")
def burst_server() -> Iterator[Server]:
    # A short create queue, so that part of the burst is refused and sent again; cheap imports in
    # the pool's kernels and a small pool ceiling, to keep the test's CPU down.
    srv = start_server({"KERNELMODE_SESSIONS__MAX_SESSIONS": str(N + 5),
                        "KERNELMODE_SESSIONS__CREATE_QUEUE_SECONDS": "3",
                        # A small stdlib module nothing else imports, and one the kernel lacks.
                        "KERNELMODE_SESSIONS__POOL_PREIMPORT": '["colorsys", "no_such_module_kmtest"]',
                        "KERNELMODE_SESSIONS__POOL_MAX": "4"})  # the test server's floor is less
    yield srv
    srv.discard()


def test_a_pool_kernel_has_its_imports_done_and_leaves_no_name_behind(burst_server: Server) -> None:
    """The pool's kernels import ``pool_preimport`` before a session takes one; a module the
    kernel environment lacks is skipped, and the pool does not fail for it."""
    with burst_server.client() as c:
        def full() -> bool:
            pool = c.get("/readyz").json()["checks"]["pool"]
            assert pool["state"] != "failing", pool
            return pool["state"] == "full"

        wait_for(full, "the warm pool to fill")
        r = c.post("/v1/sessions", json={})
        assert r.status_code == 201 and r.json()["from_pool"], r.text
        sid = r.json()["session_id"]
        x = c.post(f"/v1/sessions/{sid}/execute", json={"code": (
            "import sys\n"
            "('colorsys' in sys.modules, 'no_such_module_kmtest' in sys.modules,"
            " [k for k in globals() if 'preimport' in k], len(In))")}).json()
        assert x["status"] == "ok", x
        # imported; the missing one skipped; no helper left; the silent cell is not in the history
        assert x["result"] == "(True, False, [], 2)", x
        c.delete(f"/v1/sessions/{sid}")


class Watch(httpx.AsyncBaseTransport):
    """The real transport, keeping every 503 answer to a create."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.busy: list[httpx.Response] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        r = await self.inner.handle_async_request(request)
        if r.status_code == 503:
            await r.aread()
            self.busy.append(r)
        return r

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_fifty_concurrent_creates_all_get_a_session_of_their_own(burst_server: Server) -> None:
    watch = Watch()
    km = AsyncClient(burst_server.url, token=burst_server.token, timeout=300, retries=50, transport=watch)
    try:
        sessions = await asyncio.gather(*(km.create_session() for _ in range(N)))
        assert len({s.id for s in sessions}) == N
        assert len({s.info.kernel_id for s in sessions}) == N  # a kernel each, none handed out twice

        async def mark(i: int) -> str | None:
            s = sessions[i]
            r = await s.run(f"seen = sorted(k for k in globals() if k.startswith('burst_mark_'))\n"
                            f"burst_mark_{i} = {i}\nseen")
            assert r.status == "ok", r
            return r.result

        seen = await asyncio.gather(*(mark(i) for i in range(N)))
        assert seen == ["[]"] * N  # no session sees another's variables
        again = await asyncio.gather(*(s.run(f"burst_mark_{i}") for i, s in enumerate(sessions)))
        assert [r.result for r in again] == [str(i) for i in range(N)]  # each kept its own
        for r in watch.busy:  # every refusal was the clean one, saying when to come back
            assert r.json()["error"]["code"] == "server_busy", r.text
            assert int(r.headers["Retry-After"]) >= 1
        await asyncio.gather(*(s.close() for s in sessions))
    finally:
        await km.aclose()
    # After the burst the pool grows to what it asked for, up to its ceiling (pool_max 4).
    with burst_server.client() as c:
        pool = wait_for(lambda: (p := c.get("/readyz").json()["checks"]["pool"])["ready"] >= 4 and p,
                        "the pool to grow after the burst")
        assert pool["target"] == 4 and pool["size"] < 4, pool
