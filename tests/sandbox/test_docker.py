"""The Docker backend seen from the engine: how kernel containers are made, labelled and cleaned
up. Runs when the suite runs against Docker (`make docker-test`, KM_TEST_BACKEND=docker)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import BACKEND, REPO, Server, start_server

pytestmark = pytest.mark.skipif(BACKEND != "docker", reason="runs with KM_TEST_BACKEND=docker (make docker-test)")

docker = pytest.importorskip("docker")


def containers(**labels: str) -> list:
    filters = {"label": ["app=kernelmode", *(f"{k}={v}" for k, v in labels.items())]}
    return docker.from_env().containers.list(all=True, filters=filters)


def session_container(api, sid: str):
    """The container of the session's kernel (a pool kernel's label says `pool`: it started
    before its session existed; the kernel id is the link)."""
    kernel_id = api.get(f"/v1/sessions/{sid}").json()["kernel_id"]
    return docker.from_env().containers.get(f"kernelmode-{kernel_id}")


def test_container_is_locked_down(api, session_factory, run) -> None:
    sid = session_factory(limits={"memory_mb": 512, "pids": 64})
    assert run(sid, "1")["status"] == "ok"
    c = session_container(api, sid)
    host = c.attrs["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"] and not host.get("CapAdd")
    assert "no-new-privileges" in host["SecurityOpt"]
    # The engine's default seccomp profile applies (nothing asks for unconfined).
    assert not any("unconfined" in opt for opt in host["SecurityOpt"])
    assert any("seccomp" in opt for opt in docker.from_env().info()["SecurityOptions"])
    assert host["Privileged"] is False
    assert host["PidsLimit"] == 64
    assert host["Memory"] == 512 * 1024 * 1024 and host["MemorySwap"] == host["Memory"]
    assert host["NanoCpus"] > 0
    assert host["Init"] is True
    assert "/tmp" in host["Tmpfs"] and "size=" in host["Tmpfs"]["/tmp"]
    uid = int(c.attrs["Config"]["User"].split(":")[0])
    assert uid >= 200_000  # not root, and not another kernel's uid
    # Nothing of the host but the workspace, the kernel's socket directory, the session's package
    # layer (read-only), its egress dir and the egress bridge (read-only) and two tiny files.
    mounts = {m["Destination"]: m for m in c.attrs["Mounts"]}
    assert set(mounts) == {"/mnt/data", mounts_kdir(mounts), "/opt/kernelmode/packages", "/etc/hosts",
                           "/etc/resolv.conf", "/run/kernelmode/egress", "/run/kernelmode/egress-bridge.py"}
    assert mounts["/mnt/data"]["RW"] is True and mounts["/etc/hosts"]["RW"] is False
    for ro in ("/opt/kernelmode/packages", "/run/kernelmode/egress", "/run/kernelmode/egress-bridge.py"):
        assert mounts[ro]["RW"] is False, ro
    assert not any("docker.sock" in m["Source"] for m in c.attrs["Mounts"])
    labels = c.labels
    assert labels["app"] == "kernelmode" and labels["kernelmode.session_id"] in (sid, "pool")
    assert labels["kernelmode.kernel_id"] == c.name.removeprefix("kernelmode-") and labels["kernelmode.server"]
    assert api.get(f"/v1/sessions/{sid}").json()["sandbox"] == "docker"


def mounts_kdir(mounts: dict) -> str:
    (kdir,) = [d for d in mounts if (d.startswith("/tmp/") or "/run/" in d) and not d.startswith("/run/kernelmode/")]
    return kdir


def test_no_container_left_after_close_or_death(api, session_factory, run) -> None:
    sid = session_factory()
    assert run(sid, "1")["status"] == "ok"
    first = session_container(api, sid)
    kernel_id = first.labels["kernelmode.kernel_id"]
    assert run(sid, "import os; os._exit(1)")["status"] == "kernel_died"
    assert run(sid, "2")["status"] == "ok"
    # The dead kernel's container is gone; the restarted kernel has exactly one, a new one.
    ours = containers(**{"kernelmode.kernel_id": kernel_id})
    assert len(ours) == 1 and ours[0].id != first.id and ours[0].status == "running"
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    deadline = time.monotonic() + 60  # a busy engine stops and removes slowly
    while containers(**{"kernelmode.kernel_id": kernel_id}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert containers(**{"kernelmode.kernel_id": kernel_id}) == []


def test_orphans_of_a_killed_server_are_removed_at_start() -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="kmdock-", dir="/tmp"))
    srv = start_server(data_dir=data_dir)
    try:
        with srv.client() as api:
            sid = api.post("/v1/sessions", json={}).json()["session_id"]
            assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).json()["status"] == "ok"
            c = session_container(api, sid)
            server_label = c.labels["kernelmode.server"]
        # SIGKILL of everything of ours at once (gateway, launchers, manager): nobody is left to
        # clean up, and the containers are not our processes' children.
        gateway = subprocess.run(["pgrep", "-P", str(srv.proc.pid)], capture_output=True, text=True).stdout.split()
        launchers = subprocess.run(["pgrep", "-f", f"docker_launcher.py.*{data_dir}"], capture_output=True,
                                   text=True).stdout.split()
        for pid in [*gateway, *launchers, str(srv.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        srv.proc.wait(30)
        c.reload()
        assert c.status == "running"  # an orphan
        srv2 = start_server(data_dir=data_dir)  # the next serve on the same data dir removes it
        try:
            assert "kernel container(s) left by an earlier run" in srv2.log()
            with pytest.raises(docker.errors.NotFound):
                c.reload()
        finally:
            srv2.stop()
        deadline = time.monotonic() + 60  # a busy engine stops and removes slowly
        while containers(**{"kernelmode.server": server_label}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert containers(**{"kernelmode.server": server_label}) == []  # a clean stop leaves none
    finally:
        if srv.proc.poll() is None:
            srv.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def _serve_once(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    data_dir = tempfile.mkdtemp(prefix="kmdock-", dir="/tmp")
    try:
        return subprocess.run([sys.executable, "-m", "kernelmode.cli", "serve", "--port", "0", "--data-dir", data_dir],
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=60, cwd=str(REPO))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_missing_image_refuses_to_start() -> None:
    proc = _serve_once({"KERNELMODE_SANDBOX__BACKEND": "docker", "KERNELMODE_SANDBOX__DOCKER_IMAGE": "kernelmode/nope:0"})
    assert proc.returncode == 2
    assert "kernelmode/nope:0 does not exist" in proc.stderr and "make docker-setup" in proc.stderr


@pytest.mark.parametrize(("image", "chosen"), [("kernelmode/kernel:latest", "docker"), ("kernelmode/nope:0", "bwrap")])
def test_auto_picks_docker_when_usable(image: str, chosen: str) -> None:
    srv: Server = start_server({"KERNELMODE_SANDBOX__BACKEND": "auto", "KERNELMODE_SANDBOX__DOCKER_IMAGE": image})
    try:
        with srv.client() as api:
            info = api.post("/v1/sessions", json={}).json()
            assert info["sandbox"] == chosen
        assert f"sandbox backend: {chosen} (auto" in srv.log()
    finally:
        srv.stop()
        shutil.rmtree(srv.data_dir, ignore_errors=True)
