"""Limits are ceilings set by the operator, per tenant.

A session asks for at most ``sandbox.max_limits`` (a tenant's ``max_limits`` can only lower
them): above, the request is a 422 that names the limit and its ceiling, and nothing is made.
Exactly at a ceiling the kernel starts and really has the limit, read where it is enforced (the
kernel's rlimits from inside, its cgroup from the host). The shipped ceilings are the ones the
shared server runs with, so this also proves every backend grants them.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kernelmode.client import Client
from kernelmode.errors import LimitExceeded
from kernelmode.models import LimitCeilings, Limits
from kernelmode.sandbox import docker_engine
from tests.conftest import BACKEND, REPO, Server, start_server

from .conftest import PLAIN, SMALL, SMALL_CEILINGS, report

MiB = 1024 * 1024
CEILINGS = LimitCeilings()  # the shared server's: it runs with the defaults


def _session_ids(api: httpx.Client) -> set[str]:
    r = api.get("/v1/sessions", params={"limit": 1000})
    assert r.status_code == 200 and r.json()["next_cursor"] is None, r.text
    return {s["session_id"] for s in r.json()["sessions"]}


def _refused(client: httpx.Client, admin: httpx.Client, limits: dict[str, int]) -> dict:
    """POST a session with ``limits``: a 422 ``limit_exceeded``, and no session more (the admin
    sees every tenant's). Returns the error body."""
    before = _session_ids(admin)
    sid = "over-" + secrets.token_hex(4)
    r = client.post("/v1/sessions", json={"session_id": sid, "limits": limits})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "limit_exceeded", err
    assert _session_ids(admin) == before
    assert admin.get(f"/v1/sessions/{sid}").status_code == 404
    return err


def _kernel_caps(kernel_id: str) -> dict[str, int | None]:
    """Memory and process caps of the kernel's python process, read on the host: its cgroup's
    (v1 or v2) when it has one, else its RLIMIT_AS / RLIMIT_NPROC."""
    procs = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        joined = b" ".join(argv)
        if (kernel_id.encode() in joined and b"ipykernel_launcher" in joined and b"launcher.py" not in joined
                and Path(argv[0].decode(errors="replace")).name.startswith("python")):
            procs.append(d)
    assert len(procs) == 1, procs
    proc = procs[0]
    groups: dict[str, str] = {}
    for line in (proc / "cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            groups[c] = path

    def cgroup_value(controller: str, v1: str, v2: str) -> int | None:
        candidates = []
        if controller in groups:
            candidates.append(Path("/sys/fs/cgroup", controller, groups[controller].lstrip("/"), v1))
        if "" in groups:
            candidates.append(Path("/sys/fs/cgroup", groups[""].lstrip("/"), v2))
        for f in candidates:
            try:
                text = f.read_text().strip()
            except OSError:
                continue
            if text != "max" and int(text) < 2**62:  # v1 writes "unlimited" as a huge number
                return int(text)
        return None

    rlimits = {}
    for line in (proc / "limits").read_text().splitlines()[1:]:
        name, soft = line[:26].strip(), line[26:47].strip()
        rlimits[name] = None if soft == "unlimited" else int(soft)
    memory = cgroup_value("memory", "memory.limit_in_bytes", "memory.max") or rlimits["Max address space"]
    pids = cgroup_value("pids", "pids.max", "pids.max") or rlimits["Max processes"]
    return {"memory_bytes": memory, "pids": pids}


INSIDE = """
import json, os, resource
tmp = os.statvfs('/tmp')
print(json.dumps({"nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
                  "fsize": resource.getrlimit(resource.RLIMIT_FSIZE),
                  "cpu": resource.getrlimit(resource.RLIMIT_CPU),
                  "tmp_bytes": tmp.f_blocks * tmp.f_frsize}))
"""


def _assert_kernel_has(client: httpx.Client, sid: str, limits: dict[str, int]) -> None:
    info = client.get(f"/v1/sessions/{sid}").json()
    assert info["limits"] == limits, info
    res = client.post(f"/v1/sessions/{sid}/execute", json={"code": INSIDE, "timeout_seconds": 60})
    assert res.status_code == 200, res.text
    inside = report(res.json())
    assert inside["nofile"] == [limits["open_files"]] * 2, inside
    assert inside["fsize"] == [limits["disk_mb"] * MiB] * 2, inside
    assert inside["cpu"] == [limits["cpu_seconds"]] * 2, inside
    assert inside["tmp_bytes"] == limits["disk_mb"] * MiB, inside
    caps = _kernel_caps(info["kernel_id"])
    assert caps == {"memory_bytes": limits["memory_mb"] * MiB, "pids": limits["pids"]}, caps


# -- the server's ceilings ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LimitCeilings.model_fields))
def test_a_limit_above_its_ceiling_is_refused_and_nothing_is_made(api: httpx.Client, name: str) -> None:
    ceiling = getattr(CEILINGS, name)
    err = _refused(api, api, {name: ceiling + 1})
    assert err["message"] == f"{name} {ceiling + 1} is over this server's ceiling of {ceiling}"
    assert err["details"] == {"limit": name, "requested": ceiling + 1, "ceiling": ceiling}


def test_the_reported_terabyte_session_is_refused(api: httpx.Client) -> None:
    err = _refused(api, api, {"memory_mb": 1_048_576, "disk_mb": 1_048_576})
    assert err["message"] == f"memory_mb 1048576 is over this server's ceiling of {CEILINGS.memory_mb}"


def test_the_python_client_gets_the_same_refusal(server: Server, api: httpx.Client) -> None:
    before = _session_ids(api)
    with Client(server.url, server.token) as km, pytest.raises(LimitExceeded) as e:
        km.create_session(limits={"disk_mb": CEILINGS.disk_mb + 1})
    assert e.value.code == "limit_exceeded" and e.value.http_status == 422
    assert str(CEILINGS.disk_mb) in e.value.message
    assert _session_ids(api) == before


def test_at_the_ceilings_the_kernel_has_them(api: httpx.Client, session_factory) -> None:
    limits = CEILINGS.model_dump()
    sid = session_factory(limits=limits)
    _assert_kernel_has(api, sid, limits)


# -- a tenant's ceilings ----------------------------------------------------------------------------------
def test_a_tenant_is_held_to_its_own_ceilings(tenant_server: Server) -> None:
    with tenant_server.client() as admin, tenant_server.client(SMALL) as small, tenant_server.client(PLAIN) as plain:
        for name, ceiling in SMALL_CEILINGS.items():
            err = _refused(small, admin, {name: ceiling + 1})
            assert err["message"] == f"{name} {ceiling + 1} is over tenant 'small''s ceiling of {ceiling}"
            assert err["details"]["ceiling"] == ceiling
        # Its other limits are the server's ceilings; another tenant is not held to its own.
        err = _refused(small, admin, {"cpu_seconds": CEILINGS.cpu_seconds + 1})
        assert err["message"].endswith(f"this server's ceiling of {CEILINGS.cpu_seconds}")
        err = _refused(plain, admin, {"memory_mb": CEILINGS.memory_mb + 1})
        assert err["message"].endswith(f"this server's ceiling of {CEILINGS.memory_mb}")

        # Without limits asked, the defaults are lowered to the tenant's ceilings.
        r = small.post("/v1/sessions", json={"session_id": "small-default"})
        assert r.status_code == 201, r.text
        assert r.json()["limits"] == {**Limits().model_dump(), **SMALL_CEILINGS}
        _assert_kernel_has(small, "small-default", r.json()["limits"])
        assert small.delete("/v1/sessions/small-default").status_code == 204

        # At its ceilings (and the server's where it has none): accepted, and the kernel has them.
        at = {**CEILINGS.model_dump(), **SMALL_CEILINGS}
        r = small.post("/v1/sessions", json={"session_id": "small-top", "limits": at})
        assert r.status_code == 201, r.text
        _assert_kernel_has(small, "small-top", at)
        assert small.delete("/v1/sessions/small-top").status_code == 204


# -- the configuration ---------------------------------------------------------------------------------------
def _config_check(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "kernelmode.yaml"
    path.write_text(text)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no KERNELMODE_* overrides
    return subprocess.run([sys.executable, "-m", "kernelmode.cli", "config", "check", str(path)],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=60)


@pytest.mark.parametrize(("text", "named"), [
    ("sandbox:\n  limits:\n    memory_mb: 8192\n",
     "sandbox.limits.memory_mb (8192) is above its ceiling sandbox.max_limits.memory_mb (4096)"),
    ("sandbox:\n  limits:\n    open_files: 2048\n  max_limits:\n    open_files: 1024\n",
     "sandbox.limits.open_files (2048) is above its ceiling sandbox.max_limits.open_files (1024)"),
    ("server:\n  tenants:\n    - name: big\n      token: 0123456789abcdef0123\n"
     "      max_limits: {disk_mb: 4097}\n",
     "server.tenants.0.max_limits.disk_mb (4097) is above sandbox.max_limits.disk_mb (4096)"),
])
def test_a_default_or_tenant_above_its_ceiling_is_a_config_error(tmp_path: Path, text: str, named: str) -> None:
    proc = _config_check(tmp_path, text)
    assert proc.returncode == 2, proc.stdout
    assert named in proc.stderr, proc.stderr


def test_raising_a_ceiling_allows_a_larger_default(tmp_path: Path) -> None:
    proc = _config_check(tmp_path, "sandbox:\n  limits:\n    memory_mb: 8192\n  max_limits:\n    memory_mb: 8192\n")
    assert proc.returncode == 0, proc.stderr


# -- what the backend can grant (Docker) -------------------------------------------------------------------
docker_only = pytest.mark.skipif(BACKEND != "docker", reason="the Docker engine's refusals")


@docker_only
def test_ceilings_the_engine_cannot_grant_stop_serve_or_are_granted() -> None:
    """A ceiling above what the engine grants (nofile above its own hard limit: runc may not
    raise it) is refused when `serve` starts, naming the key; an engine that grants it runs a
    session at it. Either way no session can ask for what the engine refuses."""
    top = 65_536
    env = {"KERNELMODE_SANDBOX__MAX_LIMITS": f"{{open_files: {top}}}", "KERNELMODE_SESSIONS__POOL_SIZE": "0"}
    try:
        s = start_server(env)
    except RuntimeError as e:
        assert "the Docker engine cannot grant sandbox.max_limits.open_files (65536)" in str(e), e
        # The refused test container is removed, not left "Created" at every start.
        left = subprocess.run(["docker", "ps", "-aq", "--filter", "name=kernelmode-check-"],
                              capture_output=True, text=True, timeout=60).stdout.split()
        assert left == [], left
        return
    try:
        with s.client() as c:
            r = c.post("/v1/sessions", json={"session_id": "top", "limits": {"open_files": top}})
            assert r.status_code == 201, r.text
            res = c.post("/v1/sessions/top/execute", json={
                "code": "import resource; resource.getrlimit(resource.RLIMIT_NOFILE)"}).json()
            assert res["result"] == f"({top}, {top})", res
    finally:
        s.stop()


@docker_only
def test_an_engine_refusal_is_a_503_with_its_message_at_once() -> None:
    """The engine refuses every kernel container of this server (more CPUs than the host has):
    the session request gets 503 with the engine's own message (not a kernel that never
    connects, answered after the start time-out), and nothing is left behind."""
    import docker

    s = start_server({"KERNELMODE_SANDBOX__DOCKER_CPUS": "1024", "KERNELMODE_SESSIONS__POOL_SIZE": "0"})
    try:
        with s.client() as c:
            for _ in range(2):
                r = c.post("/v1/sessions", json={})
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["code"] == "sandbox_unavailable", err
                assert err["message"].startswith("the Docker engine refused the kernel's container: "), err
                assert "CPU" in err["message"], err  # the engine's words
                assert c.get("/v1/sessions").json()["sessions"] == []
            assert c.get("/healthz").status_code == 200
        server = docker_engine.server_id(s.data_dir)
        left = docker.from_env().containers.list(all=True, filters={"label": f"kernelmode.server={server}"})
        assert left == []
        assert not [p for p in (s.data_dir / "run").iterdir() if p.is_dir()], "a kernel directory was left"
    finally:
        s.stop()
