"""Fixtures that start the real thing: `kernelmode serve` (a real Kernel Gateway, real
ipykernels in the real bubblewrap sandbox) as a subprocess, and HTTP clients for it. The
helpers themselves live in tests/support/server.py (the benchmarks share them); re-exported
here for the tests that import them from ``tests.conftest``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.support.postgres import any_store, pg_cluster, pg_url  # noqa: F401  (fixtures)
from tests.support.server import (  # noqa: F401  (re-exported)
    BACKEND,
    CANARY,
    REPO,
    Server,
    attached_frontend,
    discard_all,
    start_server,
    wait_for,
)


@pytest.fixture(scope="session", autouse=True)
def _discard_every_server() -> Iterator[None]:
    yield
    discard_all()


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    srv = start_server()
    yield srv
    srv.discard()


@pytest.fixture()
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture()
def session_factory(server: Server) -> Iterator[Callable[..., str]]:
    """Create sessions (REST) that are deleted after the test."""
    created: list[str] = []
    client = server.client()

    def make(**body: object) -> str:
        r = client.post("/v1/sessions", json=body)
        assert r.status_code == 201, r.text
        sid = r.json()["session_id"]
        created.append(sid)
        return sid

    yield make
    for sid in created:
        client.delete(f"/v1/sessions/{sid}")
    client.close()


@pytest.fixture()
def run(api: httpx.Client) -> Callable[..., dict]:
    """run(session_id, code, **opts) -> RunResult dict (asserts HTTP 200)."""

    def _run(sid: str, code: str, **opts: object) -> dict:
        r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, **opts})
        assert r.status_code == 200, r.text
        return r.json()

    return _run
