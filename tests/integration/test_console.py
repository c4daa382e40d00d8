"""`kernelmode console` driven for real in a pseudo-terminal (pexpect), against a real server:
the person and the agent share one live kernel, through kernelmode and its token."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pexpect
import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from tests.conftest import REPO, Server, attached_frontend, start_server

PROMPT = r"In \[[^\]]*\]:"  # the prompt, with the colour codes prompt_toolkit puts inside it
CONFIG = 'tools:\n  - {name: add, function: "tests.integration.host_tools:add"}\n'
KM = [sys.executable, "-m", "kernelmode.cli"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text(CONFIG)
    s = start_server(args=["--config", str(cfg)])
    yield s
    s.discard()


@pytest.fixture()
def api(srv: Server) -> Iterator[httpx.Client]:
    with srv.client() as c:
        yield c


@pytest.fixture()
def sid(api: httpx.Client) -> Iterator[str]:
    session_id = api.post("/v1/sessions", json={}).json()["session_id"]
    yield session_id
    api.delete(f"/v1/sessions/{session_id}")


def execute(api: httpx.Client, sid: str, code: str) -> dict:
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code})
    assert r.status_code == 200, r.text
    return r.json()


def console(srv: Server, sid: str, *args: str, token: str | None = None) -> pexpect.spawn:
    # No cursor-position requests: pexpect's terminal does not answer them, and on a busy machine
    # prompt_toolkit then stops at "Press ENTER to continue..." (its CPR warning).
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1"}
    child = pexpect.spawn(KM[0], [*KM[1:], "console", sid, "--url", srv.url, "--token", token or srv.token, *args],
                          encoding="utf-8", timeout=60, dimensions=(40, 200), cwd=str(REPO), env=env)
    return child


def test_console_shares_the_agents_kernel(srv: Server, api: httpx.Client, sid: str) -> None:
    execute(api, sid, "from_agent = 'set by REST'")
    # Warm the kernel's completer: jedi's first completion imports and parses for seconds on a busy
    # machine, longer than the console waits for a Tab's answer.
    execute(api, sid, "from IPython.core.completer import provisionalcompleter\n"
                      "with provisionalcompleter():\n    list(get_ipython().Completer.completions('from_ag', 7))")
    child = console(srv, sid)
    try:
        child.expect(PROMPT)
        child.sendline("print(from_agent.upper())")
        child.expect("SET BY REST")  # the agent's variable is there
        child.expect(PROMPT)
        child.sendline("from_person = 6 * 7")
        child.expect(PROMPT)
        child.sendline("tools.add(a=2, b=3)")  # host tools work from the console too
        child.expect(r"Out\[[^\]]*\]:[^\n]*5")
        child.expect(PROMPT)
        # Tab completion and ? inspection go to the kernel.
        child.send("from_pe\t")
        if child.expect(["from_person", pexpect.TIMEOUT], timeout=15) == 1:
            child.send("\t")  # a Tab answered too late is dropped (console/app.py): the next one counts
            child.expect("from_person")
        child.sendline("")
        child.expect(PROMPT)
        child.sendline("from_agent?")
        child.expect("Type:")
        child.expect("str")
        child.expect(PROMPT)
        # Ctrl-C interrupts a long loop (through kernelmode: the stock console cannot).
        child.sendline("exec(\"import time\\nprint('spin' + 'ning', flush=True)\\nwhile True: time.sleep(0.05)\")")
        child.expect("spinning")  # the loop runs (the echo of the line says 'spin' + 'ning')
        time.sleep(0.3)
        child.sendintr()
        child.expect("KeyboardInterrupt")
        child.expect(PROMPT)
        child.sendline("exit")
        child.expect("keeping kernel alive")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    # The person's variable is seen by the agent's next call; the kernel was never restarted.
    after = execute(api, sid, "from_person")
    assert after["result"] == "42" and not after["state_lost"]
    assert api.get(f"/v1/sessions/{sid}").json()["status"] == "idle"
    # The console's runs are in the session's history (the notebook export).
    nb = api.get(f"/v1/sessions/{sid}/notebook").json()
    sources = ["".join(c["source"]) for c in nb["cells"][1:]]
    assert "from_person = 6 * 7" in sources and "tools.add(a=2, b=3)" in sources


def test_ctrl_d_leaves_the_kernel_running(srv: Server, api: httpx.Client, sid: str) -> None:
    child = console(srv, sid)
    try:
        child.expect(PROMPT)
        child.sendline("z = 'still here'")
        child.expect(PROMPT)
        # A ^D typed while the terminal is still in cooked mode (between the prompt's drawing
        # and prompt_toolkit's switch to raw mode) is swallowed by the line discipline: repeat.
        for _ in range(6):
            child.sendcontrol("d")
            if child.expect([pexpect.EOF, pexpect.TIMEOUT], timeout=5) == 0:
                break
        else:
            raise AssertionError("the console did not exit on ^D")
    finally:
        child.close(force=True)
    assert execute(api, sid, "z")["result"] == "'still here'"


def test_wrong_token_and_unknown_session_say_so(srv: Server, sid: str) -> None:
    bad = subprocess.run([*KM, "console", sid, "--url", srv.url, "--token", "wrong"], capture_output=True,
                         text=True, timeout=60, cwd=str(REPO))
    assert bad.returncode == 2 and "refused the token" in bad.stderr
    missing = subprocess.run([*KM, "console", "nope", "--url", srv.url, "--token", srv.token],
                             capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert missing.returncode == 2 and "no session 'nope'" in missing.stderr


def test_channels_websocket_requires_the_token(srv: Server, sid: str) -> None:
    url = f"{srv.url}/v1/sessions/{sid}/channels"
    headers = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    r = httpx.get(url, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    r = httpx.get(url, headers={**headers, "Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.get(f"{srv.url}/v1/sessions/nope/channels",
                  headers={**headers, "Authorization": f"Bearer {srv.token}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    # The websocket's refusals and tornado's own come out as REST's (errors.from_wire's table).
    auth = {"Authorization": f"Bearer {srv.token}"}
    r = httpx.get(url, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "websocket_required", r.text
    r = httpx.post(url, headers=auth)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    r = httpx.put(f"{srv.url}/v1/sessions", headers=auth)  # a REST route's
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text


def test_sessions_table(srv: Server, sid: str) -> None:
    out = subprocess.run([*KM, "sessions", "--url", srv.url, "--token", srv.token], capture_output=True,
                         text=True, timeout=60, cwd=str(REPO))
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split() == ["SESSION", "STATUS", "AGE", "LAST", "ACTIVE", "RUNS", "MEMORY"]
    row = next(r for r in rows if r.startswith(sid))
    assert re.search(r"\d+ MB$", row), row  # the kernel's memory, from its cgroup
    listed = subprocess.run([*KM, "console", "--list", "--url", srv.url, "--token", srv.token],
                            capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert sid in listed.stdout


def test_connection_file_for_other_frontends(srv: Server, api: httpx.Client, sid: str) -> None:
    """--connection-file: any Jupyter frontend (here jupyter_client itself) attaches to the bridge."""
    execute(api, sid, "shared = [1, 2, 3]")
    outputs: list[dict] = []
    proc = subprocess.Popen([*KM, "console", sid, "--url", srv.url, "--token", srv.token, "--connection-file"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        path = line.rsplit(": ", 1)[1].strip()
        info = json.loads(open(path).read())
        assert info["transport"] == "ipc"  # no port opened, even on loopback
        kc = BlockingKernelClient(connection_file=path)
        kc.load_connection_file()
        kc.start_channels()
        try:
            reply = kc.execute_interactive("sum(shared)", timeout=30, output_hook=outputs.append)
            kc.shutdown()  # a frontend may not stop the session's kernel: the server drops this
        finally:
            kc.stop_channels()
        assert reply["content"]["status"] == "ok"
        time.sleep(1)
        still = execute(api, sid, "shared")
        assert still["result"] == "[1, 2, 3]" and not still["state_lost"]
    finally:
        proc.terminate()
        proc.wait(30)
    results = [m["content"]["data"]["text/plain"] for m in outputs if m["msg_type"] == "execute_result"]
    assert results == ["6"]


def test_a_frontend_gets_the_sessions_history_kept_in_memory(srv: Server, api: httpx.Client, sid: str) -> None:
    """IPython's history database lives in the kernel's memory (the kernelspec's
    ``--HistoryManager.hist_file=:memory:``: no sqlite write in a thread after every cell), and
    everything that reads it still sees every cell: a frontend's history requests (tail: a
    console's up-arrow; search), %history, In and Out."""
    execute(api, sid, "agent_marker = 6 * 7")
    execute(api, sid, "agent_marker + 1")
    kept = execute(api, sid, "hm = get_ipython().history_manager\n"
                             "(str(hm.hist_file), hm.save_thread is None, In[-2], Out[len(In) - 2])")
    assert kept["result"] == "(':memory:', True, 'agent_marker + 1', 43)", kept
    # The kernel env's own IPython config (`kernelmode setup` writes it; the only one Enterprise
    # Gateway's kernels get) is read inside the sandbox as well: the flag's twin.
    loaded = execute(api, sid, "import sys\nfrom ipykernel.kernelapp import IPKernelApp\n"
                               "[f[len(sys.prefix):] for f in IPKernelApp.instance().loaded_config_files]")
    assert loaded["result"] == "['/etc/ipython/ipython_kernel_config.json']", (loaded, "run `make setup`")
    assert "agent_marker = 6 * 7" in execute(api, sid, "%history -g agent_marker")["stdout"]
    with attached_frontend(srv, sid) as kc:
        kc.history(hist_access_type="tail", n=10)
        tail = kc.get_shell_msg(timeout=30)["content"]
        kc.history(hist_access_type="search", pattern="agent_marker*")
        found = kc.get_shell_msg(timeout=30)["content"]
    assert tail["status"] == "ok" and found["status"] == "ok"
    assert {"agent_marker = 6 * 7", "agent_marker + 1"} <= {cell for _, _, cell in tail["history"]}
    assert [cell for _, _, cell in found["history"]] == ["agent_marker = 6 * 7", "agent_marker + 1"]


def test_an_interrupt_before_the_runs_cell_starts_is_held_for_it(srv: Server, api: httpx.Client, sid: str) -> None:
    """The kernel is busy with something else (here a frontend's silent request) when an agent's
    run arrives, and the agent interrupts at once: the signal waits for the run's own cell
    (sent now, it would hit the other request, and the run's endless loop would time out)."""
    proc = subprocess.Popen([*KM, "console", sid, "--url", srv.url, "--token", srv.token, "--connection-file"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        assert proc.stdout is not None
        kc = BlockingKernelClient(connection_file=proc.stdout.readline().rsplit(": ", 1)[1].strip())
        kc.load_connection_file()
        kc.start_channels()
        try:
            busy = kc.execute("import time; time.sleep(3)", silent=True)
            time.sleep(0.5)  # the kernel is in the silent request
            r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "while True: pass", "wait_seconds": 0,
                                                              "timeout_seconds": 30})
            assert r.status_code == 202
            assert api.post(f"/v1/sessions/{sid}/interrupt").status_code == 200
            reply = kc.get_shell_msg(timeout=30)
            assert reply["parent_header"]["msg_id"] == busy
            assert reply["content"]["status"] == "ok"  # the silent request was not interrupted
        finally:
            kc.stop_channels()
        deadline = time.monotonic() + 60
        while not (final := api.get(f"/v1/runs/{r.json()['run_id']}", params={"wait_seconds": 10}).json())["done"]:
            assert time.monotonic() < deadline, final
        assert final["result"]["status"] == "interrupted", final
        assert final["result"]["state_lost"] is False
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_failing_run_does_not_abort_a_console_cell_queued_behind_it(srv: Server, api: httpx.Client, sid: str) -> None:
    """A person's cell that waits in the kernel's queue behind an agent's failing run still runs:
    the manager's runs do not ask the kernel to abort what is queued after them."""
    proc = subprocess.Popen([*KM, "console", sid, "--url", srv.url, "--token", srv.token, "--connection-file"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        assert proc.stdout is not None
        kc = BlockingKernelClient(connection_file=proc.stdout.readline().rsplit(": ", 1)[1].strip())
        kc.load_connection_file()
        kc.start_channels()
        try:
            r = api.post(f"/v1/sessions/{sid}/execute", json={
                "code": "import time\nprint('started', flush=True)\ntime.sleep(2)\n1/0",
                "wait_seconds": 0, "timeout_seconds": 60})
            assert r.status_code == 202, r.text
            run_id = r.json()["run_id"]
            seen, offset = "", 0
            deadline = time.monotonic() + 60
            while "started" not in seen:  # the run's cell is in the kernel: the next one queues
                assert time.monotonic() < deadline, seen
                part = api.get(f"/v1/runs/{run_id}", params={"wait_seconds": 5, "offset": offset}).json()
                seen += "".join(e.get("text", "") for e in part["events"] if e["type"] == "stream")
                offset = part["next_offset"]
                assert not part["done"], part
            cell = kc.execute("person = 6 * 7\nperson")
            reply = kc.get_shell_msg(timeout=60)
            assert reply["parent_header"]["msg_id"] == cell
            assert reply["content"]["status"] == "ok", reply["content"]  # not "aborted"
        finally:
            kc.stop_channels()
        final = api.get(f"/v1/runs/{run_id}", params={"wait_seconds": 30}).json()
        assert final["done"] and final["result"]["status"] == "error", final
        assert final["result"]["error"]["ename"] == "ZeroDivisionError"
        assert execute(api, sid, "person")["result"] == "42"  # the person's cell ran
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_unreadable_tool_request_from_a_console_cell_is_refused_not_passed_on(
        srv: Server, api: httpx.Client, sid: str) -> None:
    """A tool request too large to be read arrives at the tap without its prompt: the tap refuses
    it (the call fails at once in the kernel) instead of showing the console an empty prompt."""
    asked: list[dict] = []
    outputs: list[dict] = []
    code = ("import kernelmode_preamble as kp\n"
            "try:\n    kp._bridge.call('add', {'a': 'x' * 30_000_000, 'b': 1})\n"
            "except kp.ToolError as e:\n    print('refused:', e)\n")
    with attached_frontend(srv, sid) as kc:
        reply = kc.execute_interactive(code, timeout=120, allow_stdin=True, output_hook=outputs.append,
                                       stdin_hook=lambda msg: (asked.append(msg), kc.input(""))[0])
    assert reply["content"]["status"] == "ok", reply["content"]
    assert asked == []  # the console was never asked
    printed = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
    assert "refused:" in printed and "over the limit" in printed, printed
