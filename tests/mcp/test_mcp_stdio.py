"""`kernelmode mcp` over stdio, driven by the real mcp SDK client: the embedded service (started
by the command, gone with it) and the bridge to a running `kernelmode serve`."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

from tests.conftest import REPO, Server

KERNELMODE = [sys.executable, "-m", "kernelmode.cli", "mcp"]


def params(*args: str, env: dict[str, str] | None = None) -> StdioServerParameters:
    return StdioServerParameters(command=KERNELMODE[0], args=[*KERNELMODE[1:], *args],
                                 env={**os.environ, **(env or {})}, cwd=str(REPO))


def _parent(pid: int) -> int:
    try:  # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _started_by_this_test(pid: int) -> bool:
    while pid > 1:
        pid = _parent(pid)
        if pid == os.getpid():
            return True
    return False


def own_embedded_dir() -> Path:
    """The data dir of the embedded service this test launched: its owner.pid names a process
    started from this one. Other test runs on the machine make their own kernelmode-mcp-* dirs
    at the same time, so counting new ones is not enough."""
    own = []
    for d in Path("/tmp").glob("kernelmode-mcp-*"):
        try:
            owner = int((d / "owner.pid").read_text())
        except (OSError, ValueError):
            continue  # another's, being made or swept
        if _started_by_this_test(owner):
            own.append(d)
    assert len(own) == 1, own  # a data dir of its own
    return own[0]


def mounts_under(prefix: str) -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(prefix)]


def text(result) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


async def test_embedded_keeps_variables_and_cleans_up_when_the_client_goes() -> None:
    async with Client(stdio_client(params())) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert {"run_python", "get_run", "upload_file", "read_artifact"} <= names
        first = await client.call_tool("run_python", {"code": "import os\nx = 41\nos.getpid()"})
        assert not first.is_error, text(first)
        sid = first.structured_content["session_id"]
        again = await client.call_tool("run_python", {"code": "x + 1"})
        assert again.structured_content["result"] == "42"
        assert again.structured_content["session_id"] == sid
        data_dir = own_embedded_dir()
        err = await client.call_tool("run_python", {"code": "1/0"})
        assert err.is_error and "ZeroDivisionError" in text(err)
        # The sandbox is the same as serve's: no host files.
        leak = await client.call_tool("run_python", {"code": "open('/etc/shadow').read()"})
        assert leak.is_error
    assert_cleaned_up(data_dir)


async def test_embedded_without_a_chosen_sandbox_uses_bwrap_and_asks_no_docker_engine(tmp_path: Path) -> None:
    """`auto` (nothing chosen): the embedded service starts on bubblewrap, the sandbox that starts
    fastest, and never probes a Docker engine (a probe costs seconds at every launch)."""
    engine = tmp_path / "docker.sock"
    calls: list[int] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        calls.append(1)  # somebody asked the "engine"
        writer.close()

    listener = await asyncio.start_unix_server(answer, path=str(engine))
    env = {k: v for k, v in os.environ.items() if k != "KERNELMODE_SANDBOX__BACKEND"}
    env["DOCKER_HOST"] = f"unix://{engine}"
    try:
        chosen = StdioServerParameters(command=KERNELMODE[0], args=KERNELMODE[1:], env=env, cwd=str(REPO))
        async with Client(stdio_client(chosen)) as client:
            run = await client.call_tool("run_python", {"code": "1+1"})
            assert not run.is_error and run.structured_content["result"] == "2", text(run)
    finally:
        listener.close()
    assert calls == []


def assert_cleaned_up(data_dir: Path) -> None:
    """Gone with the client: no data dir, no mounted volume, no kernel process."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (data_dir.exists() or mounts_under(str(data_dir))):
        time.sleep(0.2)
    assert not data_dir.exists()
    assert mounts_under(str(data_dir)) == []
    ps = subprocess.run(["pgrep", "-f", str(data_dir)], capture_output=True, text=True)
    assert ps.stdout.strip() == ""


def test_stdout_carries_only_the_protocol() -> None:
    """Raw JSON-RPC over the pipe: every stdout line is a JSON-RPC message, logs go to stderr."""
    lines = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "run_python", "arguments": {"code": "import sys; print('to stdout'); sys.__stdout__.write('raw\\n'); 7"}}},
    ]
    proc = subprocess.Popen([*KERNELMODE, "--log-level", "info"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    assert proc.stdin is not None and proc.stdout is not None
    for msg in lines:
        proc.stdin.write(json.dumps(msg) + "\n")
        proc.stdin.flush()
    replies = {}
    while len(replies) < 2:
        line = proc.stdout.readline()
        assert line, "kernelmode mcp closed stdout early"
        msg = json.loads(line)  # anything but JSON-RPC here would fail
        assert msg["jsonrpc"] == "2.0"
        if "id" in msg:
            replies[msg["id"]] = msg
    rest, err = proc.communicate(timeout=60)  # closes stdin: the client goes
    assert proc.returncode == 0
    assert all(json.loads(line)["jsonrpc"] == "2.0" for line in rest.splitlines() if line.strip())
    assert replies[1]["result"]["serverInfo"]["name"] == "kernelmode"
    result = replies[2]["result"]
    assert result["structuredContent"]["result"] == "7"
    assert result["structuredContent"]["stdout"] == "to stdout\n"
    assert "kernel gateway ready" in err  # logs went to stderr


def gateway_config(dest: Path, prelude: str) -> Path:
    """A gateway config dir whose config runs ``prelude`` (in the gateway process) before the
    real one: a gateway held back, or one that cannot start."""
    from kernelmode.config import GATEWAY_CONFIG_DIR

    dest.mkdir()
    shutil.copy(GATEWAY_CONFIG_DIR / "kernelspec.json", dest)
    real = GATEWAY_CONFIG_DIR / "kernel_gateway_config.py"
    (dest / "kernel_gateway_config.py").write_text(
        f"{prelude}\nexec(compile(open({str(real)!r}).read(), {str(real)!r}, 'exec'))\n")
    return dest


async def test_initialize_does_not_wait_for_the_gateway_and_a_first_run_waits_for_it(tmp_path: Path) -> None:
    """The embedded service answers initialize and lists its tools while the gateway starts; a
    run_python sent at once waits for the gateway and its kernel, then answers."""
    go = tmp_path / "go"
    # Held until `go` exists; a server that waited for it before answering initialize would never
    # see `go`, and its start fails when the hold gives up.
    held = gateway_config(tmp_path / "gw", "import os, time\n"
                          "deadline = time.monotonic() + 120\n"
                          f"while not os.path.exists({str(go)!r}):\n"
                          "    if time.monotonic() > deadline:\n"
                          "        raise SystemExit('kmtest: held gateway never released')\n"
                          "    time.sleep(0.05)")
    async with Client(stdio_client(params(env={"KERNELMODE_GATEWAY__CONFIG_DIR": str(held)}))) as client:
        # Connected (initialize answered) while the gateway cannot be up: its config waits for `go`.
        assert {"run_python", "list_tools"} <= {t.name for t in (await client.list_tools()).tools}
        host_tools = await client.call_tool("list_tools", {})
        assert not host_tools.is_error, text(host_tools)
        run = asyncio.create_task(client.call_tool("run_python", {"code": "6 * 7"}))
        await asyncio.sleep(0)  # the request is on its way
        assert not go.exists() and not run.done()
        go.touch()  # the gateway may start now
        result = await run
        assert not result.is_error, text(result)
        assert result.structured_content["result"] == "42"


async def test_initialize_comes_before_the_session_layer_and_a_run_sent_at_once_waits(tmp_path: Path) -> None:
    """An MCP host waits for initialize at each launch: it is answered with only the MCP SDK and
    the tools imported; the session layer is imported after it (in the background, as the gateway
    and the first kernel start). A run_python sent at once waits for all that, then answers."""
    errlog = tmp_path / "stderr"
    # -X importtime: each import's line goes to stderr as it ends, in order with the log lines.
    launch = StdioServerParameters(command=KERNELMODE[0], args=["-X", "importtime", *KERNELMODE[1:], "--log-level", "info"],
                                   env=dict(os.environ), cwd=str(REPO))
    with errlog.open("w") as err:
        async with Client(stdio_client(launch, errlog=err)) as client:
            result = await client.call_tool("run_python", {"code": "x = 6 * 7\nx"})
            assert not result.is_error, text(result)
            assert result.structured_content["result"] == "42"
            again = await client.call_tool("run_python", {"code": "x + 1"})
            assert again.structured_content["result"] == "43"
    lines = errlog.read_text().splitlines()

    def imported(module: str) -> int:
        return next(i for i, line in enumerate(lines)
                    if line.startswith("import time:") and line.split("|")[-1].strip() == module)

    answered = next(i for i, line in enumerate(lines) if "greeting is answered" in line)
    assert imported("kernelmode.mcp.tools") < answered < imported("kernelmode.sessions.manager")


async def test_a_start_that_fails_answers_initialize_and_each_run_with_what_to_do() -> None:
    """No kernel environment where the settings say (a real misconfiguration): initialize and the
    tool list are answered; run_python answers isError naming the problem and what to do, every
    time (no hang, no crash); and the process cleans up and exits when the client goes."""
    env = {"KERNELMODE_SANDBOX__KERNEL_PYTHON": "/nonexistent/kernel-venv/bin/python"}
    async with Client(stdio_client(params(env=env))) as client:
        assert "run_python" in {t.name for t in (await client.list_tools()).tools}
        for _ in range(2):
            failed = await client.call_tool("run_python", {"code": "1+1"})
            message = text(failed)
            assert failed.is_error, message
            assert "could not start" in message and "/nonexistent/kernel-venv/bin/python" in message, message
            assert "kernelmode setup" in message and "restart the MCP server" in message, message
            assert failed.structured_content["error"]["code"] == "sandbox_unavailable"
        data_dir = own_embedded_dir()
    assert_cleaned_up(data_dir)  # stdin closed: kernels, gateway and data dir gone


def test_the_process_exits_cleanly_when_stdin_closes_after_a_failed_start() -> None:
    env = {**os.environ, "KERNELMODE_SANDBOX__KERNEL_PYTHON": "/nonexistent/kernel-venv/bin/python"}
    init = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    proc = subprocess.run(KERNELMODE, input=init + "\n", capture_output=True, text=True, timeout=120,
                          env=env, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0])["result"]["serverInfo"]["name"] == "kernelmode"


async def test_a_gateway_that_cannot_start_gives_run_python_a_clear_error(tmp_path: Path) -> None:
    broken = gateway_config(tmp_path / "gw", "raise SystemExit('kmtest: this gateway refuses to start')")
    async with Client(stdio_client(params(env={"KERNELMODE_GATEWAY__CONFIG_DIR": str(broken)}))) as client:
        failed = await client.call_tool("run_python", {"code": "1"})
        message = text(failed)
        assert failed.is_error and "could not start" in message and "gateway" in message, message
        assert "restart the MCP server" in message  # what to do
        # ... with the error as REST gives it, for a program (mcp/app.py start_failed)
        data = failed.structured_content
        assert isinstance(data, dict) and data["error"]["code"] != "internal", data
        assert data["error"]["message"] in message, data
        # The server still answers (and says the same again), it does not hang or die.
        assert not (await client.call_tool("list_tools", {})).is_error
        again = await client.call_tool("run_python", {"code": "2"})
        assert again.is_error and "could not start" in text(again)


def test_stale_data_dir_of_a_killed_embedded_service_is_swept() -> None:
    stale = Path("/tmp/kernelmode-mcp-stale-test")
    stale.mkdir(exist_ok=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (stale / "owner.pid").write_text(str(dead.pid))
    (stale / "workspaces").mkdir(exist_ok=True)
    live = Path("/tmp/kernelmode-mcp-live-test")
    live.mkdir(exist_ok=True)
    (live / "owner.pid").write_text(str(os.getpid()))  # this test process: alive
    try:
        proc = subprocess.Popen(KERNELMODE, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=str(REPO))
        _, err = proc.communicate("", timeout=120)  # EOF at once: start, sweep, stop
        assert proc.returncode == 0, err
        assert not stale.exists()
        assert live.exists()
    finally:
        import shutil
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


async def test_bridge_to_a_running_server(server: Server) -> None:
    env = {"KERNELMODE_URL": server.url, "KERNELMODE_TOKEN": server.token}
    async with Client(stdio_client(params(env=env))) as a, Client(stdio_client(params(env=env))) as b:
        ra = await a.call_tool("run_python", {"code": "v = 'from a'"})
        assert not ra.is_error, text(ra)
        assert (await a.call_tool("run_python", {"code": "v"})).structured_content["result"] == "'from a'"
        # Each bridge is its own connection to the server, so its own session.
        rb = await b.call_tool("run_python", {"code": "v"})
        assert rb.is_error and "NameError" in text(rb)
        assert rb.structured_content["session_id"] != ra.structured_content["session_id"]
        # The session lives in the server: REST sees it.
        with server.client() as api:
            sid = ra.structured_content["session_id"]
            assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "v"}).json()["result"] == "'from a'"


@pytest.mark.parametrize("token", ["wrong-token", None])
def test_bridge_with_a_bad_token_fails_clearly(server: Server, token: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KERNELMODE_TOKEN"}
    args = [*KERNELMODE, "--url", server.url] + (["--token", token] if token else [])
    init = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    proc = subprocess.run(args, input=init + "\n", capture_output=True, text=True, timeout=60, env=env,
                          cwd=str(REPO))
    # Refused at once with a message saying why (on stderr), not a hang or a silent close.
    assert proc.returncode == 2
    assert "token" in proc.stderr and proc.stdout == ""


def test_bridge_to_nothing_fails_clearly() -> None:
    proc = subprocess.run([*KERNELMODE, "--url", "http://127.0.0.1:9", "--token", "x"], input="",
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert proc.returncode == 2 and "cannot reach" in proc.stderr
