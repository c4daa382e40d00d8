"""Sessions through the REST API, against the real gateway and sandboxed kernels."""

from __future__ import annotations

import pytest

from kernelmode.client import Client
from tests.unit.test_lean_flush import STARVED_IOPUB


def test_variables_imports_and_files_persist(session_factory, run):
    sid = session_factory()
    r1 = run(sid, "import math\nx = 41\nopen('note.txt', 'w').write('hi')")
    assert r1["status"] == "ok", r1
    r2 = run(sid, "print(open('/mnt/data/note.txt').read())\nmath.floor(x + 1.5)")
    assert r2["status"] == "ok", r2
    assert r2["stdout"] == "hi\n"
    assert r2["result"] == "42"
    assert r2["execution_count"] == 2
    assert r2["state_lost"] is False


def test_create_returns_201_with_times_and_get_lists_it(api, session_factory):
    sid = session_factory(session_id="my-session_1", ttl_seconds=120)
    info = api.get(f"/v1/sessions/{sid}").json()
    assert info["session_id"] == "my-session_1"
    assert info["status"] == "idle"
    assert info["ttl_seconds"] == 120
    assert info["created_at"] and info["expires_at"]
    ids = [s["session_id"] for s in api.get("/v1/sessions").json()["sessions"]]
    assert sid in ids


def test_generated_id_and_duplicate_is_409(api, session_factory):
    sid = session_factory()
    assert len(sid) >= 16
    r = api.post("/v1/sessions", json={"session_id": sid})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "session_exists"


def test_error_is_status_error_with_plain_traceback_and_session_survives(session_factory, run):
    sid = session_factory()
    run(sid, "y = 5")
    r = run(sid, "def f():\n    return 1 / 0\nf()")
    assert r["status"] == "error"
    assert r["error"]["ename"] == "ZeroDivisionError"
    assert "division by zero" in r["error"]["evalue"]
    assert "\x1b[" not in r["error"]["traceback"]
    assert "return 1 / 0" in r["error"]["traceback"]
    assert run(sid, "y * 2")["result"] == "10"


def test_stdout_stderr_and_rich_outputs(session_factory, run):
    sid = session_factory()
    r = run(sid, "import sys\nfrom IPython.display import display, HTML\n"
                 "print('out'); print('err', file=sys.stderr)\ndisplay(HTML('<b>hi</b>'))")
    assert r["status"] == "ok"
    assert r["stdout"] == "out\n"
    assert r["stderr"] == "err\n"
    assert r["outputs"][0]["data"]["text/html"] == "<b>hi</b>"


def test_output_of_a_cell_ending_while_iopub_is_starved_is_not_lost(session_factory, run):
    """Issue 32: under load, `print('ok')` answered ok with stdout empty. The kernel's IOPub
    thread took the output and was starved before queueing it; the cell's idle status went out
    first and the run ended without it. Made certain here (the reproduction holds the IOPub
    thread in that window until the cell's end has queued something behind it)."""
    sid = session_factory()
    r = run(sid, STARVED_IOPUB)
    assert r["status"] == "ok", r
    assert r["stdout"] == "ok\n", r
    assert run(sid, "print('next')")["stdout"] == "next\n"


def test_matplotlib_figure_is_a_png_output(session_factory, run):
    sid = session_factory()
    r = run(sid, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
    assert r["status"] == "ok", r
    assert any("image/png" in o["data"] for o in r["outputs"])


def test_input_fails_fast_instead_of_hanging(session_factory, run):
    sid = session_factory()
    r = run(sid, "input('name? ')", timeout_seconds=20)
    assert r["status"] == "error"
    assert r["error"]["ename"] == "NoInteractiveInput"
    assert "no interactive input" in r["error"]["evalue"]


def test_output_over_cap_is_truncated(session_factory, run):
    sid = session_factory()
    r = run(sid, "print('x' * 3_000_000)")
    assert r["status"] == "ok"
    assert r["truncated"] is True
    assert 1024 * 1024 - 10 <= len(r["stdout"]) <= 1024 * 1024


def test_timeout_interrupts_and_keeps_state(session_factory, run):
    sid = session_factory()
    run(sid, "kept = 'yes'")
    r = run(sid, "import time\nprint('started', flush=True)\ntime.sleep(30)", timeout_seconds=1)
    assert r["status"] == "timeout"
    assert r["state_lost"] is False
    assert "started" in r["stdout"]
    assert r["error"]["ename"] == "TimeoutError"
    after = run(sid, "kept")
    assert after["status"] == "ok" and after["result"] == "'yes'"
    assert after["state_lost"] is False


def test_timeout_that_ignores_interrupts_restarts_the_kernel(session_factory, run):
    sid = session_factory()
    run(sid, "kept = 1")
    code = ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "end = time.time() + 60\nwhile time.time() < end:\n    pass")
    r = run(sid, code, timeout_seconds=1)
    assert r["status"] == "timeout"
    assert r["state_lost"] is True
    after = run(sid, "'kept' in globals()")
    assert after["status"] == "ok" and after["result"] == "False"


def test_kernel_exit_reports_cause_then_state_lost(session_factory, run):
    sid = session_factory()
    run(sid, "x = 1")
    r = run(sid, "import os\nos._exit(3)", timeout_seconds=30)
    assert r["status"] == "kernel_died"
    assert r["cause"] == {"kind": "exit", "exit_code": 3, "signal": None}
    assert r["state_lost"] is True
    nxt = run(sid, "'x' in globals()", timeout_seconds=30)
    assert nxt["status"] == "ok" and nxt["result"] == "False"
    assert nxt["state_lost"] is True
    assert run(sid, "1")["state_lost"] is False


def test_segfault_reports_signal(session_factory, run):
    sid = session_factory()
    r = run(sid, "import ctypes\nctypes.string_at(0)", timeout_seconds=30)
    assert r["status"] == "kernel_died"
    assert r["cause"]["kind"] == "signal" and r["cause"]["signal"] == 11
    assert run(sid, "2 + 2", timeout_seconds=30)["result"] == "4"


def test_out_of_memory_reports_oom(session_factory, run):
    sid = session_factory(limits={"memory_mb": 200})
    r = run(sid, "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))",
            timeout_seconds=60)
    # With a memory cgroup the kernel is OOM-killed; with the rlimit fallback it is a MemoryError.
    # Either way the answer names the limit and how to ask for more (kernel/hints.py).
    if r["status"] == "kernel_died":
        assert r["cause"]["kind"] == "oom"
        assert "200 MiB (limits.memory_mb)" in r["cause"]["detail"], r["cause"]
    else:
        assert r["status"] == "error" and r["error"]["ename"] == "MemoryError"
        assert "200 MiB (limits.memory_mb)" in r["error"]["evalue"], r["error"]
    assert run(sid, "1 + 1", timeout_seconds=30)["result"] == "2"


def test_concurrent_calls_run_one_at_a_time_in_arrival_order(server, session_factory):
    import threading
    import time

    sid = session_factory()
    with server.client() as c:
        c.post(f"/v1/sessions/{sid}/execute", json={"code": "order = []"})
    results: dict[int, dict] = {}
    clients = [server.client() for _ in range(4)]
    for c in clients:  # connections open before the race, so each call is one quick send
        assert c.get("/healthz").status_code == 200

    def call(i: int) -> None:
        code = f"import time\nstart = time.time()\ntime.sleep(0.8)\norder.append({i})\n(start, time.time())"
        results[i] = clients[i].post(f"/v1/sessions/{sid}/execute", json={"code": code}).json()

    threads = []
    for i in range(4):
        t = threading.Thread(target=call, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(0.4)  # fix the arrival order (each call still arrives while another runs)
    for t in threads:
        t.join(60)
    for c in clients:
        c.close()
    assert all(results[i]["status"] == "ok" for i in range(4))
    spans = sorted(eval(results[i]["result"]) for i in range(4))  # (start, end) per run
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end  # no overlap
    with server.client() as c:
        r = c.post(f"/v1/sessions/{sid}/execute", json={"code": "order"}).json()
    assert r["result"] == "[0, 1, 2, 3]"


def test_interrupt_endpoint_stops_a_run(server, session_factory):
    import threading
    import time

    sid = session_factory()
    box: dict[str, dict] = {}

    def call() -> None:
        with server.client() as c:
            box["r"] = c.post(f"/v1/sessions/{sid}/execute",
                              json={"code": "import time\ntime.sleep(30)", "timeout_seconds": 60}).json()

    t = threading.Thread(target=call)
    t.start()
    time.sleep(1.0)
    with server.client() as c:
        assert c.post(f"/v1/sessions/{sid}/interrupt").status_code == 200
    t.join(30)
    assert box["r"]["status"] == "interrupted"
    assert box["r"]["error"]["ename"] == "KeyboardInterrupt"
    assert box["r"]["state_lost"] is False


def test_restart_endpoint_clears_state(api, session_factory, run):
    sid = session_factory()
    run(sid, "z = 3")
    r = api.post(f"/v1/sessions/{sid}/restart")
    assert r.status_code == 200 and r.json()["status"] == "idle"
    nxt = run(sid, "'z' in globals()")
    assert nxt["result"] == "False"
    assert nxt["state_lost"] is True


def test_delete_removes_kernel_and_workspace_then_404(server, api, run):
    sid = api.post("/v1/sessions", json={}).json()["session_id"]
    run(sid, f"open('f.txt', 'w').write('marker-{sid}')")
    [workspace] = [f.parent for f in (server.data_dir / "workspaces").glob("*/f.txt")
                   if f.read_text() == f"marker-{sid}"]
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    assert not workspace.exists()
    for method, path in [("GET", ""), ("DELETE", ""), ("POST", "/execute")]:
        r = api.request(method, f"/v1/sessions/{sid}{path}", json={"code": "1"} if method == "POST" else None)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["code"] == "session_not_found"


def test_code_too_large_is_413(session_factory, api):
    sid = session_factory()
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "#" * (1024 * 1024 + 1)})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"


def test_validation_errors_are_json_4xx(api, session_factory):
    cases = [
        ("POST", "/v1/sessions", b"{not json", 400, "bad_json"),
        ("POST", "/v1/sessions", b"[1, 2]", 422, "invalid_request"),
        ("POST", "/v1/sessions", b'{"session_id": ""}', 422, "invalid_request"),
        ("POST", "/v1/sessions", b'{"session_id": "a/b"}', 422, "invalid_request"),
        ("POST", "/v1/sessions", b'{"session_id": "' + b"a" * 65 + b'"}', 422, "invalid_request"),
        ("POST", "/v1/sessions", b'{"ttl_seconds": -1}', 422, "invalid_request"),
        ("POST", "/v1/sessions", b'{"limits": {"memory_mb": "lots"}}', 422, "invalid_request"),
        ("POST", "/v1/sessions", b'{"surprise": 1}', 422, "invalid_request"),
    ]
    sid = session_factory()
    cases += [
        ("POST", f"/v1/sessions/{sid}/execute", b"{}", 422, "invalid_request"),
        ("POST", f"/v1/sessions/{sid}/execute", b'{"code": 5}', 422, "invalid_request"),
        ("POST", f"/v1/sessions/{sid}/execute", b'{"code": "1", "timeout_seconds": -3}', 422, "invalid_request"),
        ("POST", f"/v1/sessions/{sid}/execute", b'{"code": "1", "timeout_seconds": 1e9}', 422, "invalid_request"),
    ]
    for method, path, body, status, code in cases:
        r = api.request(method, path, content=body)
        assert r.status_code == status, (path, body[:40], r.text)
        assert r.json()["error"]["code"] == code, (path, body[:40], r.text)
    # The session is untouched by all of this.
    assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).json()["status"] == "ok"


def test_auth_on_every_route_but_probes(server):
    with server.client(token="") as anon, server.client(token="wrong") as wrong:
        for c in (anon, wrong):
            for method, path in [("GET", "/v1/sessions"), ("POST", "/v1/sessions"), ("GET", "/v1/sessions/x"),
                                 ("DELETE", "/v1/sessions/x"), ("POST", "/v1/sessions/x/execute"),
                                 ("POST", "/v1/sessions/x/interrupt"), ("POST", "/v1/sessions/x/restart"),
                                 ("GET", "/openapi.json"), ("GET", "/nope")]:
                r = c.request(method, path)
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.json()["error"]["code"] == "unauthorized"
        assert anon.get("/healthz").status_code == 200
        assert anon.get("/readyz").status_code == 200
        assert anon.get("/readyz").json()["checks"]["gateway"]["ok"] is True


def test_openapi_document(api):
    doc = api.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert "/v1/sessions/{session_id}/execute" in doc["paths"]
    assert "RunResult" in doc["components"]["schemas"]
    assert "state_lost" in doc["components"]["schemas"]["RunResult"]["properties"]


def test_idle_session_is_reaped_after_ttl(server, api, session_factory, run):
    """After the idle TTL plus a reaping interval nothing of the session is left (processes,
    container, workspace, its mount) but its artifacts and its notebook."""
    import time
    from pathlib import Path

    from tests.conftest import BACKEND
    from tests.integration.test_recovery import _containers_of
    from tests.support.procfs import processes_mentioning

    sid = session_factory(ttl_seconds=10)
    r = run(sid, "import subprocess\n"
                 "subprocess.Popen(['sleep', '3600'], start_new_session=True)\n"
                 "open('/mnt/data/kept.txt', 'w').write('kept')")
    assert r["status"] == "ok" and [a["path"] for a in r["artifacts"]] == ["/mnt/data/kept.txt"]
    kernel_id = api.get(f"/v1/sessions/{sid}").json()["kernel_id"]
    workspace = server.data_dir / "workspaces" / kernel_id
    assert workspace.is_dir()
    uid = workspace.stat().st_uid  # the kernel's own host uid (as root)

    def processes_of_uid() -> list[str]:
        found = []
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                real = next(x for x in status.read_text().splitlines() if x.startswith("Uid:")).split()[1]
            except (OSError, StopIteration):
                continue
            if int(real) == uid:
                found.append(status.parent.name)
        return found

    if uid != 0:
        assert processes_of_uid()  # the kernel and its detached `sleep`
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and api.get(f"/v1/sessions/{sid}").status_code == 200:
        time.sleep(0.5)
    assert api.get(f"/v1/sessions/{sid}").status_code == 404
    deadline = time.monotonic() + 15  # the kernel's shutdown may take a moment after the 404
    while time.monotonic() < deadline and (workspace.exists() or processes_mentioning(kernel_id)
                                           or (uid != 0 and processes_of_uid())):
        time.sleep(0.2)
    assert not workspace.exists() and not workspace.with_name(kernel_id + ".img").exists()
    assert processes_mentioning(kernel_id) == []
    if uid != 0:
        assert processes_of_uid() == []  # not even the detached `sleep`
    assert str(workspace) not in Path("/proc/self/mountinfo").read_text()
    if BACKEND == "docker":
        assert _containers_of(kernel_id) == []
    artifacts = api.get(f"/v1/sessions/{sid}/artifacts").json()["artifacts"]
    assert {a["path"] for a in artifacts} == {"/mnt/data/kept.txt", "notebook.ipynb"}


def test_delete_during_a_run_ends_the_run_and_the_session_stays_gone(server, api):
    import threading
    import time

    sid = api.post("/v1/sessions", json={}).json()["session_id"]
    box: dict[str, object] = {}

    def call() -> None:
        with server.client() as c:
            box["r"] = c.post(f"/v1/sessions/{sid}/execute",
                              json={"code": "import time\ntime.sleep(30)", "timeout_seconds": 60})

    t = threading.Thread(target=call)
    t.start()
    time.sleep(1.0)
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    t.join(30)
    assert not t.is_alive()
    assert box["r"].status_code == 404  # type: ignore[union-attr]
    assert api.get(f"/v1/sessions/{sid}").status_code == 404
    assert sid not in [s["session_id"] for s in api.get("/v1/sessions").json()["sessions"]]


def test_warm_pool_hands_out_fresh_kernels_only(api, run):
    import time

    deadline = time.monotonic() + 60
    while api.get("/readyz").json()["checks"]["pool"]["ready"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    a = api.post("/v1/sessions", json={}).json()
    assert a["from_pool"] is True
    run(a["session_id"], "secret_of_a = 1\nopen('a.txt', 'w').write('a')")
    assert api.delete(f"/v1/sessions/{a['session_id']}").status_code == 204
    deadline = time.monotonic() + 60
    while api.get("/readyz").json()["checks"]["pool"]["ready"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    b = api.post("/v1/sessions", json={}).json()
    assert b["from_pool"] is True
    r = run(b["session_id"], "import os\n('secret_of_a' in globals(), os.listdir('.'))")
    assert r["result"] == "(False, [])" and r["execution_count"] == 1
    # Non-default limits need a kernel of their own.
    c = api.post("/v1/sessions", json={"limits": {"pids": 99}}).json()
    assert c["from_pool"] is False
    assert run(c["session_id"], "1 + 1")["result"] == "2"
    for sid in (b["session_id"], c["session_id"]):
        api.delete(f"/v1/sessions/{sid}")


def test_exit_in_code_does_not_stop_the_kernel(session_factory, run):
    """exit()/quit() would stop ipykernel's loop; the session's kernel is not the code's to end."""
    sid = session_factory()
    run(sid, "kept = 'yes'")
    for code in ("exit()", "quit()", "exit"):
        assert run(sid, code)["status"] == "ok", code
    res = run(sid, "kept")
    assert res["result"] == "'yes'" and res["state_lost"] is False


def _walk(api, limit: int) -> list[list[str]]:
    """Every page of the listing, ``limit`` sessions at a time, as lists of ids."""
    pages, cursor = [], None
    while True:
        r = api.get("/v1/sessions", params={"limit": limit, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["sessions"]) <= limit
        pages.append([s["session_id"] for s in body["sessions"]])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages


def test_listing_pages_walk_to_the_end_without_loss_or_repeat(server, api, session_factory):
    made = [session_factory(session_id=f"page-{i}") for i in range(5)]
    whole = api.get("/v1/sessions").json()  # no paging asked: the first page, and a cursor if more
    assert set(whole) == {"sessions", "next_cursor"}
    everything = [s["session_id"] for s in api.get("/v1/sessions", params={"limit": 1000}).json()["sessions"]]
    assert [s for s in everything if s in made] == made  # creation order
    pages = _walk(api, 2)
    walked = [sid for p in pages for sid in p]
    assert walked == everything and len(set(walked)) == len(walked)
    assert len(pages) == -(-len(everything) // 2) and all(len(p) == 2 for p in pages[:-1])
    # A session deleted between two pages shifts nothing: the next page starts after the cursor.
    first = api.get("/v1/sessions", params={"limit": 1}).json()
    gone = made[2]  # after the first page's session, whichever that is
    assert api.delete(f"/v1/sessions/{gone}").status_code == 204
    rest = api.get("/v1/sessions", params={"limit": 1000, "cursor": first["next_cursor"]}).json()
    assert [s["session_id"] for s in rest["sessions"]] == [s for s in everything[1:] if s != gone]
    # The client walks the same pages.
    with Client(server.url, server.token) as km:
        assert [i.session_id for i in km.iter_sessions(page_size=3)] == [s for s in everything if s != gone]
        page = km.sessions_page(limit=1)
        assert len(page.sessions) == 1 and page.next_cursor


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "1001"}, {"limit": "ten"}, {"limit": "-3"},
                                    {"limit": "2.5"}, {"cursor": "not-a-cursor"}, {"cursor": "e30"}])
def test_bad_listing_limit_or_cursor_is_invalid_request(api, params):
    r = api.get("/v1/sessions", params=params)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request"
    assert ("limit must be an integer from 1 to 1000" if "limit" in params else "cursor is not one") in err["message"]
