"""The real thing started for tests and benchmarks alike: `kernelmode serve` (a real Kernel
Gateway, real ipykernels in the real sandbox) as a subprocess (``start_server``), ``wait_for``,
and a Jupyter frontend attached to a session (``attached_frontend``)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kernelmode.artifacts.volume import detach_all

# Agent-framework packages (CrewAI) imported by any test send telemetry to the internet on
# import unless told not to: tests send traffic to loopback only.
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

REPO = Path(__file__).resolve().parents[2]
CANARY = "KM_CANARY_" + secrets.token_hex(8)
# The sandbox every server the tests start uses (`make docker-test` sets docker); pinned, so that
# `auto` never picks a backend by what happens to be installed.
BACKEND = os.environ.get("KM_TEST_BACKEND", "bwrap")
os.environ["KERNELMODE_SANDBOX__BACKEND"] = BACKEND
# The session store of every server the tests start (`KM_TEST_STORE=postgresql`: a database of
# its own per data dir, in one throwaway cluster, so a restart on the same data dir finds its
# store); a test that sets store.url itself keeps it.
STORE = os.environ.get("KM_TEST_STORE", "sqlite")
_pg: Any = None  # the cluster (tests/support/postgres.py), made on first use
_store_urls: dict[Path, str] = {}


def _store_env(data_dir: Path, env_extra: dict[str, str] | None) -> dict[str, str]:
    if STORE != "postgresql" or "KERNELMODE_STORE__URL" in (env_extra or {}):
        return {}
    global _pg
    if _pg is None:
        from tests.support.postgres import PgCluster

        _pg = PgCluster()
    if data_dir not in _store_urls:
        _store_urls[data_dir] = _pg.create_database("serve")
    return {"KERNELMODE_STORE__URL": _store_urls[data_dir]}


@dataclass
class Server:
    url: str
    token: str
    data_dir: Path
    proc: subprocess.Popen[str]
    log_path: Path
    sessions: list[str] = field(default_factory=list)

    def client(self, token: str | None = None, timeout: float = 120) -> httpx.Client:
        tok = self.token if token is None else token
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def discard(self) -> None:
        """Stop it (killed if it will not stop) and remove what it left: volumes still mounted
        in its data dir (a killed manager's: rmtree cannot remove a mount point), the data dir
        and its log. Safe to call again, and on a server already stopped."""
        try:
            self.stop()
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        detach_all(self.data_dir)
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)


# Every server start_server made: each is discarded when the test session ends at the latest
# (``discard_all``, from tests/conftest.py), also those a test stopped and left, or killed on purpose.
_STARTED: list[Server] = []


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 120, every: float = 0.2) -> object:
    """``predicate()``'s first truthy value, polled every ``every`` s; AssertionError naming
    ``what`` when ``timeout`` passes first (a failing test, never a hang)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def start_server(env_extra: dict[str, str] | None = None, data_dir: Path | None = None,
                 args: list[str] | None = None, cwd: Path | None = None) -> Server:
    """Start `kernelmode serve` on a free port; its data dir must be reachable by sandbox uids.
    ``cwd``: the checkout whose code it runs (the benchmarks' A/B; default this one)."""
    made = data_dir is None
    if data_dir is None:
        data_dir = Path(tempfile.mkdtemp(prefix="kmtest-", dir="/tmp"))
    data_dir.chmod(0o711)
    # Never starting with "-": `--token <token>` on a command line would read as an option
    # (1 run in 64 failed test_console.py that way)
    token = "t" + secrets.token_urlsafe(16)
    env = {
        **os.environ,
        "KERNELMODE_TOKEN": token,
        "KERNELMODE_SESSIONS__REAP_INTERVAL_SECONDS": "0.5",
        # An interrupt that works must not lose a race with the grace on a loaded machine.
        "KERNELMODE_SESSIONS__INTERRUPT_GRACE_SECONDS": "6",
        # The suite starts hundreds of servers and pool kernels on two cores: no pandas import
        # in each pool kernel and a small pool ceiling, unless a test asks (test_burst.py does).
        "KERNELMODE_SESSIONS__POOL_PREIMPORT": "[]",
        "KERNELMODE_SESSIONS__POOL_MAX": "4",
        # A stop mid-run is a restart in most tests (the run ends interrupted): no drain, unless a
        # test asks (test_managers.py's SIGTERM test).
        "KERNELMODE_SERVER__DRAIN_SECONDS": "0",
        # Canary secrets in the server's environment: no kernel may ever see them.
        "KM_SECRET_CANARY": CANARY,
        "AWS_SECRET_ACCESS_KEY": CANARY,
        **_store_env(data_dir, env_extra),
        **(env_extra or {}),
    }
    log_path = data_dir.with_suffix(".log")
    logf = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelmode.cli", "serve", "--port", "0", "--data-dir", str(data_dir),
         *(args or [])],
        stdout=subprocess.PIPE, stderr=logf, text=True, env=env, cwd=str(cwd or REPO),
    )
    logf.close()  # the child holds its own copy
    deadline = time.monotonic() + 120
    url = None
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        proc.wait(30)
        tail = log_path.read_text()[-4000:]
        if made:  # nothing to keep: the log's tail is in the error
            Server(url="", token=token, data_dir=data_dir, proc=proc, log_path=log_path).discard()
        raise RuntimeError(f"kernelmode serve did not start:\n{tail}")
    srv = Server(url=url, token=token, data_dir=data_dir, proc=proc, log_path=log_path)
    _STARTED.append(srv)
    return srv


@contextlib.contextmanager
def attached_frontend(srv: Server, sid: str) -> Iterator[Any]:
    """A Jupyter frontend (jupyter_client's BlockingKernelClient, channels started) attached to
    session ``sid`` through `kernelmode console --connection-file`; detached after."""
    from jupyter_client import BlockingKernelClient

    proc = subprocess.Popen([sys.executable, "-m", "kernelmode.cli", "console", sid, "--url", srv.url,
                             "--token", srv.token, "--connection-file"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        assert proc.stdout is not None
        kc = BlockingKernelClient(connection_file=proc.stdout.readline().rsplit(": ", 1)[1].strip())
        kc.load_connection_file()
        kc.start_channels()
        try:
            yield kc
        finally:
            kc.stop_channels()
    finally:
        proc.terminate()
        proc.wait(30)


def discard_all() -> None:
    """Discard every server ``start_server`` made (the test session's end; a benchmark's)."""
    global _pg
    while _STARTED:
        _STARTED.pop().discard()
    if _pg is not None:
        _pg.stop()
        _pg = None
