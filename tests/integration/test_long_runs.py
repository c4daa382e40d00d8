"""Long runs over REST: ``wait_seconds`` returns ``running`` and the run goes on; GET /v1/runs/{id}
returns output since an offset and the final result, so a client that stops waiting loses nothing."""

from __future__ import annotations

import time

import httpx

LOOP = "import time\nfor i in range(6):\n    print(f'tick {i}', flush=True)\n    time.sleep(0.4)\n'done'"


def poll_until_done(api: httpx.Client, run_id: str) -> tuple[list[dict], dict]:
    """Follow a run with offsets until it ends; return every event seen and the final progress."""
    events: list[dict] = []
    offset = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = api.get(f"/v1/runs/{run_id}", params={"offset": offset, "wait_seconds": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["offset"] == offset
        events += body["events"]
        offset = body["next_offset"]
        if body["done"]:
            return events, body
    raise AssertionError("the run did not end")


def test_wait_seconds_returns_running_then_polling_loses_nothing(api: httpx.Client, session_factory, run) -> None:
    sid = session_factory()
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": LOOP, "wait_seconds": 0.5})
    assert r.status_code == 202, r.text
    first = r.json()
    assert first["status"] == "running"
    assert r.headers["Location"] == f"/v1/runs/{first['run_id']}"
    events, final = poll_until_done(api, first["run_id"])
    text = "".join(e["text"] for e in events if e["type"] == "stream")
    assert text == "".join(f"tick {i}\n" for i in range(6))
    assert final["status"] == "ok" and final["result"]["status"] == "ok"
    assert final["result"]["result"] == "'done'"
    assert final["result"]["stdout"] == text
    assert events[-1] == {"type": "execute_result", "data": {"text/plain": "'done'"}, "metadata": {}}
    # The session is usable again, and the run counted in its history.
    assert run(sid, "i")["result"] == "5"


def test_a_fast_run_with_wait_seconds_is_an_ordinary_result(api: httpx.Client, session_factory) -> None:
    sid = session_factory()
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1+1", "wait_seconds": 30})
    assert r.status_code == 200 and r.json()["result"] == "2"
    # A finished run stays readable by id, from any offset.
    progress = api.get(f"/v1/runs/{r.json()['run_id']}", params={"offset": 5}).json()
    assert progress["done"] and progress["result"]["result"] == "2"
    assert progress["offset"] == progress["next_offset"] == 1 and progress["events"] == []


def test_a_queued_run_waits_behind_the_running_one(api: httpx.Client, session_factory) -> None:
    sid = session_factory()
    a = api.post(f"/v1/sessions/{sid}/execute", json={"code": "import time; time.sleep(1.5); x = 1",
                                                      "wait_seconds": 0}).json()
    b = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x + 1", "wait_seconds": 0}).json()
    assert a["status"] == b["status"] == "running"
    _, final_b = poll_until_done(api, b["run_id"])
    assert final_b["result"]["result"] == "2"  # ran after a, in order
    assert api.get(f"/v1/runs/{a['run_id']}").json()["result"]["status"] == "ok"


def test_an_interrupted_long_run_reports_interrupted(api: httpx.Client, session_factory) -> None:
    sid = session_factory()
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "import time\nwhile True: time.sleep(0.05)",
                                                      "wait_seconds": 0.5})
    assert r.status_code == 202
    api.post(f"/v1/sessions/{sid}/interrupt")
    _, final = poll_until_done(api, r.json()["run_id"])
    assert final["result"]["status"] == "interrupted"
    assert final["result"]["error"]["ename"] == "KeyboardInterrupt"


def test_an_interrupt_before_the_cell_starts_still_lands(api: httpx.Client, session_factory) -> None:
    """Interrupt at once, while the kernel is still being readied for a fresh session's first
    run: ipykernel ignores SIGINT between cells, so the manager sends it again at the cell's
    start. (Lost, the loop below would run into its timeout.)"""
    for _ in range(3):
        sid = session_factory()
        r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "while True: pass", "wait_seconds": 0,
                                                          "timeout_seconds": 20})
        assert r.status_code == 202
        assert api.post(f"/v1/sessions/{sid}/interrupt").status_code == 200
        _, final = poll_until_done(api, r.json()["run_id"])
        assert final["result"]["status"] == "interrupted", final
        assert final["result"]["state_lost"] is False


def test_deleting_the_session_ends_its_run_with_a_failure(api: httpx.Client, session_factory) -> None:
    sid = session_factory()
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "import time; time.sleep(30)", "wait_seconds": 0.3})
    assert r.status_code == 202
    api.delete(f"/v1/sessions/{sid}")
    _, final = poll_until_done(api, r.json()["run_id"])
    assert final["result"] is None
    assert final["failure"]["code"] == "session_not_found"


def test_run_polling_rejects_bad_input(api: httpx.Client, server) -> None:
    assert api.get("/v1/runs/" + "0" * 32).json()["error"]["code"] == "run_not_found"
    assert api.get("/v1/runs/not-a-run-id").status_code == 404
    sid = api.post("/v1/sessions", json={}).json()["session_id"]
    try:
        run_id = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).json()["run_id"]
        for params in ({"offset": "-1"}, {"offset": "x"}, {"wait_seconds": "61"}, {"wait_seconds": "nan"}):
            r = api.get(f"/v1/runs/{run_id}", params=params)
            assert r.status_code == 422, (params, r.text)
        r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1", "wait_seconds": -1})
        assert r.status_code == 422
        assert server.client(token="wrong").get(f"/v1/runs/{run_id}").status_code == 401
    finally:
        api.delete(f"/v1/sessions/{sid}")
