"""A kernel that dies as it starts is reported as dead, with its cause, as soon as the gateway
has given it up: not after the websocket's 30 s opening timeout, three times over (one per
launch attempt), as before. Here the sandbox really kills every kernel: the server's bwrap is a
wrapper that runs the start-up check's sandbox but refuses every kernel's (it prints a line to
stderr and exits 3), as a broken bubblewrap or kernel environment would; on Docker, the kernel
image's entrypoint does the same (a container that exits at once)."""

from __future__ import annotations

import io
import json
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import BACKEND, Server, start_server, wait_for
from tests.mcp.conftest import mcp_client

SAID = "kmtest: this sandbox refuses kernels"
TENANT = "tenant-" + secrets.token_hex(8)  # a tenant's token on the broken server
TENANTS = {"KERNELMODE_SERVER__TENANTS": f"[{{name: alpha, token: '{TENANT}'}}]"}
KERNEL_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-")  # a kernel's entries in the runtime dir


# A kernel's sandbox runs the egress bridge first; the start-up check's does not.
REFUSE = f'case "$*" in *egress-bridge.py*) echo "{SAID}" >&2; exit 3;; esac'
IMAGE = "kernelmode/kernel:kmtest-dies-at-start"


@pytest.fixture(scope="module")
def broken() -> Iterator[Server]:
    """bwrap: a wrapper as the server's bwrap; Docker: an image whose entrypoint does the same."""
    if BACKEND == "docker":
        import docker

        engine = docker.from_env()
        entrypoint = json.dumps(["/bin/sh", "-c", REFUSE + '; exec "$@"', "sh"])
        dockerfile = f"FROM kernelmode/kernel:latest\nENTRYPOINT {entrypoint}\n"
        engine.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=IMAGE, rm=True, network_mode="none")
        srv = start_server({"KERNELMODE_SANDBOX__DOCKER_IMAGE": IMAGE, "KERNELMODE_SESSIONS__POOL_SIZE": "1",
                            **TENANTS})
        yield srv
        srv.discard()
        engine.images.remove(IMAGE, force=True)
        return
    # The launcher runs bwrap as a kernel's uid: the wrapper must be reachable by it (tmp_path is not).
    exe_dir = Path(tempfile.mkdtemp(prefix="km-bwrap-", dir="/tmp"))
    exe_dir.chmod(0o755)
    wrapper = exe_dir / "bwrap"
    wrapper.write_text(f'#!/bin/sh\n{REFUSE}\nexec {shutil.which("bwrap") or "/usr/bin/bwrap"} "$@"\n')
    wrapper.chmod(0o755)
    srv = start_server({"KERNELMODE_SANDBOX__BWRAP_PATH": str(wrapper), "KERNELMODE_SESSIONS__POOL_SIZE": "1",
                        **TENANTS})
    yield srv
    srv.discard()
    shutil.rmtree(exe_dir)


def test_a_create_whose_kernel_dies_at_start_says_why(broken: Server) -> None:
    with broken.client() as c:
        r = c.post("/v1/sessions", json={})
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        message = error["message"]
        assert error["code"] == "sandbox_unavailable", error  # not retried: it would die again
        assert "died as it started" in message and "exit status 3" in message, message
        assert SAID in message, message  # the kernel's last output, from the provisioner's record
        assert "kernelmode doctor" in message, message  # what to do next
        # Not the opening timeout's error (before: "... timed out during opening handshake").
        assert "handshake" not in message and "timed out" not in message, message
        assert error["details"]["cause"] == {"kind": "exit", "exit_code": 3, "signal": None}, error
        assert error["details"]["output"] == SAID, error
        assert c.get("/v1/sessions").json()["sessions"] == []  # nothing half-made is left


def test_a_tenant_is_told_the_cause_but_not_the_kernels_output(broken: Server) -> None:
    """What the sandbox printed may name the host's paths: the operator's (admin token, log)."""
    with broken.client(TENANT) as c:
        r = c.post("/v1/sessions", json={})
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "sandbox_unavailable" and "exit status 3" in error["message"], error
    assert SAID not in r.text and "in the server's log" in error["message"], error
    assert "output" not in error["details"], error
    assert SAID in broken.log()


async def test_run_python_gets_the_same_cause(broken: Server) -> None:
    async with mcp_client(broken, close=False) as client:
        result = await client.call_tool("run_python", {"code": "1 + 1"})
    text = "\n".join(getattr(c, "text", "") for c in result.content)
    assert result.is_error, text
    assert "died as it started" in text and "exit status 3" in text and SAID in text, text
    assert "handshake" not in text, text


def test_a_pool_whose_kernels_die_at_start_backs_off(broken: Server) -> None:
    """The warm pool does not spin starting kernels that die: its retries back off (0.5 s,
    doubling), and /readyz says it is failing, and why."""
    with broken.client() as c:
        r = wait_for(lambda: (r := c.get("/readyz")).json()["checks"]["pool"]["state"] == "failing" and r,
                     "the pool to be failing")
        pool = r.json()["checks"]["pool"]  # type: ignore[union-attr]
        assert "died as it started" in pool["error"] and "exit status 3" in pool["error"], pool
        # /readyz is public: the kernel's own output stays in the server's log
        assert SAID not in pool["error"] and "in the server's log" in pool["error"], pool
    assert SAID in broken.log()
    wait_for(lambda: "retrying in 1.0 s" in broken.log(), "the pool's second failed start")
    # Each kernel the gateway gave up is released (its directory, log, uid, cgroup or container):
    # no more than the one being started is left (before, one set per failed start stayed).
    run = broken.data_dir / "run"
    wait_for(lambda: len({p.name.split(".")[0] for p in run.iterdir() if KERNEL_ID.match(p.name)}) <= 1,
             "the given-up kernels to be released", timeout=60)
    delays = [line.split("retrying in ")[1].split(" s")[0] for line in broken.log().splitlines()
              if "warm pool: could not start a kernel" in line]
    assert delays[:2] == ["0.5", "1.0"], delays


@pytest.fixture()
def gated() -> Iterator[tuple[Server, Path]]:
    """A broken sandbox whose kernels wait to die until ``go`` exists in the returned dir (each
    leaves a mark in ``marks/`` first): a create can be sent while the pool's first start is
    still under way."""
    if BACKEND == "docker":
        pytest.skip("the pool's claim is the same on both backends: the bwrap wrapper shows it")
    exe_dir = Path(tempfile.mkdtemp(prefix="km-bwrap-", dir="/tmp"))
    exe_dir.chmod(0o755)
    marks = exe_dir / "marks"
    marks.mkdir()
    marks.chmod(0o777)  # written as the kernels' uids
    wrapper = exe_dir / "bwrap"
    wait = (f'*egress-bridge.py*) touch {marks}/$$; while [ ! -e {exe_dir}/go ]; do sleep 0.05; done; '
            f'echo "{SAID}" >&2; exit 3;;')
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in {wait} esac\n'
                       f'exec {shutil.which("bwrap") or "/usr/bin/bwrap"} "$@"\n')
    wrapper.chmod(0o755)
    srv = start_server({"KERNELMODE_SANDBOX__BWRAP_PATH": str(wrapper), "KERNELMODE_SESSIONS__POOL_SIZE": "1"})
    yield srv, exe_dir
    (exe_dir / "go").touch()
    srv.discard()
    shutil.rmtree(exe_dir)


def test_a_create_that_waited_for_the_pools_dying_start_answers_its_error(gated: tuple[Server, Path]) -> None:
    """A create that waits for the pool's first start takes that start's death as its answer:
    no start of its own (it would die the same way, after the same wait)."""
    srv, gate = gated
    wait_for(lambda: any((gate / "marks").iterdir()), "the pool's first kernel to start")
    with srv.client(timeout=120) as c, ThreadPoolExecutor(1) as pool:
        create = pool.submit(c.post, "/v1/sessions", json={"session_id": "first"})
        # 409 once "first" is being created (it then waits for the pool's kernel); before, the
        # unknown tool's 422 refuses this probe before it takes anything.
        wait_for(lambda: c.post("/v1/sessions", json={"session_id": "first", "tools": ["nope"]}).status_code == 409,
                 "the create to wait for the pool's kernel")
        (gate / "go").touch()
        r = create.result()
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "sandbox_unavailable", error
    assert "died as it started" in error["message"] and "exit status 3" in error["message"], error
    assert SAID in error["message"], error
    failed = [e for e in _events(srv) if e["event"] == "kernel_start_failed"]
    assert [e["session_id"] for e in failed if e["session_id"] != "pool"] == [], failed  # none of its own
    assert any(e["session_id"] == "pool" for e in failed), failed  # the one it waited for


def _events(srv: Server) -> list[dict[str, object]]:
    return [json.loads(x) for x in srv.log().splitlines() if x.startswith('{"ts"')]
