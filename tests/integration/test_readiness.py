"""``/readyz`` reports the workspace quota and the warm pool as they are: a pool refilling as it
should is ready, one whose kernels cannot start is not (with the last error, its paths redacted:
the route is public), and so is a quota whose volumes cannot be made; both are ready again once
the cause is gone."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, start_server, wait_for


def test_readyz_says_what_the_pool_and_the_quota_are_doing(api: httpx.Client) -> None:
    """The shared server: its pool full or refilling (both ready), its quota's real mechanism."""
    r = api.get("/readyz")
    assert r.status_code == 200, r.text
    pool, quota = r.json()["checks"]["pool"], r.json()["checks"]["workspace_quota"]
    assert pool["ok"] is True and pool["state"] in ("full", "refilling") and pool["error"] is None, pool
    # the adaptive pool may hold more than its floor after a burst, never more than its ceiling
    # (the test servers' sessions.pool_max: tests/support/server.py); its target lies between
    assert pool["ready"] <= 4 and pool["size"] <= pool["target"] <= 4, pool
    assert quota["ok"] is True and quota["error"] is None, quota
    assert quota["enforced"] is quota["mechanism"].startswith("ext4"), quota


@pytest.fixture(scope="module")
def breakable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A server (pool of 1) whose mkfs.ext4 fails while the returned flag file exists: every new
    workspace volume, and so every kernel start, fails the way a host out of loop devices does."""
    real = shutil.which("mkfs.ext4")
    if real is None or os.getuid() != 0 or not os.path.exists("/dev/loop-control"):
        pytest.skip("workspace volumes need root, mkfs.ext4 and loop devices")
    bin_dir = tmp_path_factory.mktemp("bin")
    flag = bin_dir / "broken"
    wrapper = bin_dir / "mkfs.ext4"
    wrapper.write_text(f'#!/bin/sh\nif [ -e "{flag}" ]; then echo "no free loop device for $*" >&2; exit 1; fi\n'
                       f'exec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    srv = start_server({"KERNELMODE_SESSIONS__POOL_SIZE": "1",
                        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"})
    yield srv, flag
    srv.discard()


def _ready(c: httpx.Client, data_dir: Path | None = None) -> tuple[int, dict]:
    r = c.get("/readyz")
    if data_dir is not None:  # a public route: its errors name no path of the data dir
        assert str(data_dir) not in r.text, r.text
    return r.status_code, r.json()["checks"]


def test_a_pool_that_cannot_start_kernels_is_not_ready(breakable: tuple[Server, Path]) -> None:
    srv, flag = breakable
    with srv.client() as c:
        wait_for(lambda: _ready(c)[1]["pool"]["state"] == "full", "the pool at its floor")
        code, checks = _ready(c)
        assert code == 200 and checks["workspace_quota"]["enforced"] is True, checks
        flag.touch()
        try:
            # The pool's kernel goes to a session; its replacement cannot get a workspace.
            assert c.post("/v1/sessions", json={}).json()["from_pool"] is True
            wait_for(lambda: _ready(c)[1]["pool"]["state"] == "failing", "the pool to fail to refill")
            code, checks = _ready(c, srv.data_dir)
            assert code == 503, checks
            assert "<data dir>/" in checks["pool"]["error"], checks  # mkfs.ext4's image, redacted
            assert checks["pool"]["ok"] is False and "no free loop device" in checks["pool"]["error"], checks
            assert checks["workspace_quota"]["ok"] is False, checks
            assert "no free loop device" in checks["workspace_quota"]["error"], checks
        finally:
            flag.unlink(missing_ok=True)
        # Loop devices are back: the pool refills (its retries back off) and all is ready again.
        wait_for(lambda: _ready(c)[1]["pool"]["state"] == "full", "the pool to refill")
        code, checks = _ready(c)
        assert code == 200, checks
        assert checks["pool"]["error"] is None and checks["workspace_quota"]["ok"] is True, checks
