"""`kernelmode serve` on a PostgreSQL store (store.url, a real server the tests start): a session
created and run through one serve is found, with its history, by the next serve on the same
database, started on a data dir of its own (so nothing comes from a SQLite file)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import start_server, wait_for


def test_a_restarted_serve_finds_the_sessions_and_runs_kept_in_postgresql(pg_url: str) -> None:
    env = {"KERNELMODE_STORE__URL": pg_url, "KERNELMODE_SESSIONS__POOL_SIZE": "0"}
    first = start_server(env)
    try:
        with first.client() as c:
            assert c.post("/v1/sessions", json={"session_id": "kept"}).status_code == 201
            run = c.post("/v1/sessions/kept/execute", json={"code": "x = 21 * 2\nprint(x)"}).json()
            assert run["status"] == "ok" and run["stdout"] == "42\n"
        assert "session store: PostgreSQL postgres@/tmp/kmpg-" in first.log()
    finally:
        assert first.stop() == 0
    assert not (first.data_dir / "sessions.sqlite3").exists()

    second = start_server(env)  # a new data dir: the same database
    try:
        assert second.data_dir != first.data_dir and not (second.data_dir / "sessions.sqlite3").exists()
        with second.client() as c:
            # Its kernel went with the first serve (and its gateway): the session is lost, its
            # history is not.
            info = wait_for(lambda: (r := c.get("/v1/sessions/kept")).status_code == 200 and r.json(),
                            "the session from the store", 30)
            assert isinstance(info, dict) and info["status"] == "lost"
            kept = c.get(f"/v1/runs/{run['run_id']}").json()
            assert kept["done"] and kept["result"]["status"] == "ok" and kept["result"]["stdout"] == "42\n"
            assert [e.get("text") for e in kept["events"]] == ["42\n"]  # its output events, in order
            notebook = c.get("/v1/sessions/kept/notebook")
            assert notebook.status_code == 200 and "x = 21 * 2" in notebook.text and "42" in notebook.text
            assert [s["session_id"] for s in c.get("/v1/sessions").json()["sessions"]] == ["kept"]
    finally:
        second.stop()
    for srv in (first, second):
        srv.discard()
    assert not Path(first.data_dir).exists()
