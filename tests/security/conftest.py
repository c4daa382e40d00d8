"""Helpers of the attack suite: run probe code in a kernel and read back its JSON report."""

from __future__ import annotations

import json
import re
import secrets
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, start_server

# Prepended to every probe: the kernel's own directory on the host path (it is bound there),
# read from the `-f <connection file>` argument of the kernel's command line.
PRELUDE = """\
import errno as _errno, json as _json, os as _os
def _kernel_dir():
    argv = open('/proc/self/cmdline', 'rb').read().split(b'\\0')
    f = argv[argv.index(b'-f') + 1].decode()
    return _os.path.dirname(f)
def _err(e):
    return _errno.errorcode.get(getattr(e, 'errno', None) or 0, type(e).__name__)
"""


def report(result: dict) -> dict:
    """The JSON object a probe printed on its last stdout line."""
    assert result["status"] == "ok", result
    lines = result["stdout"].strip().splitlines()
    assert lines, result
    return json.loads(lines[-1])


@pytest.fixture()
def probe(run: Callable[..., dict]) -> Callable[..., dict]:
    """probe(sid, code, **opts): run dedented `code` (after PRELUDE) and return its JSON report."""

    def _probe(sid: str, code: str, **opts: object) -> dict:
        opts.setdefault("timeout_seconds", 60)
        return report(run(sid, PRELUDE + textwrap.dedent(code), **opts))

    return _probe


# The tenants of ``tenant_server``: alpha and beta attack each other; small has ceilings of its
# own (max_limits), plain has none. An MCP connection cap per tenant small enough to reach.
ALPHA, BETA, SMALL, PLAIN = (secrets.token_urlsafe(18) for _ in range(4))
SMALL_CEILINGS = {"memory_mb": 256, "pids": 64, "disk_mb": 16, "open_files": 256}
MCP_PER_TENANT = 2
_TENANTS = (f"[{{name: alpha, token: '{ALPHA}'}}, {{name: beta, token: '{BETA}'}}, "
            f"{{name: small, token: '{SMALL}', max_limits: {json.dumps(SMALL_CEILINGS)}}}, "
            f"{{name: plain, token: '{PLAIN}'}}]")


@pytest.fixture(scope="session")
def tenant_server() -> Iterator[Server]:
    """One server with the tenants above, shared by the modules that attack across tenants (each
    cleans up the sessions and connections it makes)."""
    s = start_server({"KERNELMODE_SERVER__TENANTS": _TENANTS, "KERNELMODE_SESSIONS__POOL_SIZE": "1",
                      "KERNELMODE_MCP__MAX_SESSIONS_PER_TENANT": str(MCP_PER_TENANT),
                      # refuses only cells with its markers (test_policy_everywhere.py)
                      "KERNELMODE_POLICY__MODULE": "tests.security.policy_rules:check"})
    yield s
    s.discard()


@pytest.fixture(scope="module")
def alpha(tenant_server: Server) -> Iterator[httpx.Client]:
    with tenant_server.client(ALPHA) as c:
        yield c


@pytest.fixture(scope="module")
def beta(tenant_server: Server) -> Iterator[httpx.Client]:
    with tenant_server.client(BETA) as c:
        yield c


@pytest.fixture(scope="module")
def shared_sid(server: Server) -> Iterator[str]:
    """One default session shared by the read-only probes of a module."""
    with server.client() as c:
        r = c.post("/v1/sessions", json={})
        assert r.status_code == 201, r.text
        sid = r.json()["session_id"]
        yield sid
        c.delete(f"/v1/sessions/{sid}")


def host_file_in_workspace(server: Server, name: str) -> Path:
    """The host path of a file a kernel wrote at /mnt/data/<name> (its workspace's layout on
    the host is the manager's business: search for it)."""
    found = list(server.data_dir.glob(f"workspaces/*/{name}"))
    assert len(found) == 1, found
    return found[0]


def gateway_port(server: Server) -> int | None:
    m = re.search(r"kernel gateway ready on http://127\.0\.0\.1:(\d+)", server.log())
    return int(m.group(1)) if m else None


def host_kernel_procs(server: Server) -> dict[int, dict]:
    """Host-side view of this server's sandbox processes: pid -> {cmdline, uids, gids}."""
    procs: dict[int, dict] = {}
    marker = str(server.data_dir).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            status = (d / "status").read_text()
        except OSError:
            continue
        if marker not in cmdline or b"sandbox/launcher.py" in cmdline or b"sandbox/docker_launcher.py" in cmdline:
            continue  # not the launchers: they are the server's, and drop to the kernel's uid or start its container
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        procs[int(d.name)] = {
            "cmdline": cmdline.replace(b"\0", b" ").decode(errors="replace"),
            "uids": [int(x) for x in fields["Uid"].split()],
            "gids": [int(x) for x in fields["Gid"].split()],
        }
    return procs


def run_after_restart(api: httpx.Client, sid: str, code: str) -> tuple[dict, bool]:
    """The first run after a kernel died or was restarted: (result, False).

    (It once retried a run that a manager race had lost; the race is fixed, so a lost run now
    fails the test. The second value stays for the callers.)"""
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_seconds": 15})
    assert r.status_code == 200, r.text
    return r.json(), False
