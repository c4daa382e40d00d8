"""`kernelmode serve` for the benchmarks, one or several side by side in one run (A/B).

- ``KmServer``: start a real `kernelmode serve` (tests.support.server.start_server), from this checkout
  or another one (``checkout``; ``export`` / ``before_checkout`` put a git ref's code in a
  scratch folder), with extra settings, a config and arguments; its manager and gateway pids
  (``kernel_pid``: a session's ipykernel under the gateway); stop it with everything it left
  behind. ``RestSession``: one session on one, driven like a REST client would.
- ``CpuMeter``: on-CPU time per path and role (manager, gateway, kernel, the client) over the
  batches ``harness.interleave`` runs, so that the CPU per request of two servers is measured in
  the same interleaved run as their latency.

Imported as ``servers`` by the scripts in bench/, after ``harness`` (which puts the repository
root on sys.path; isort's order does that).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from harness import (
    EXEC_BODY,
    EXPECTED,
    REAL_KERNEL_PYTHON,
    REPO,
    Http,
    Stats,
    ms_since,
)

from kernelmode.config import SessionSettings
from tests.support.procfs import (
    cmdline,
    cpu_ns,
    descendants,
    processes_mentioning,
    ptable,
    stat,
    unmount_under,
)
from tests.support.server import Server, start_server

_SESSIONS = SessionSettings()
# start_server's settings for the tests that are not the service's defaults (the reaper every
# 0.5 s, a longer interrupt grace, no pool preimport, a pool ceiling of 4) set back: an A/B of the
# manager's own work, or a burst, runs it as deployed.
AS_DEPLOYED = {"KERNELMODE_SESSIONS__REAP_INTERVAL_SECONDS": str(_SESSIONS.reap_interval_seconds),
               "KERNELMODE_SESSIONS__INTERRUPT_GRACE_SECONDS": str(_SESSIONS.interrupt_grace_seconds),
               "KERNELMODE_SESSIONS__POOL_PREIMPORT": json.dumps(_SESSIONS.pool_preimport),
               "KERNELMODE_SESSIONS__POOL_MAX": str(_SESSIONS.pool_max)}


# -- another checkout's code ---------------------------------------------------------------------


def git(*args: str) -> str:
    """The output of `git ARGS` in this checkout."""
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def export(ref: str | None, dest: Path) -> str:
    """The tree of ``ref`` (None: the merge base of HEAD and main) in ``dest`` (kernelmode runs
    from its checkout); its short commit."""
    commit = git("rev-parse", "--short", ref or git("merge-base", "HEAD", "main"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return commit


def before_checkout(ref: str | None, prefix: str) -> tuple[Path, str, str]:
    """A scratch folder (``prefix`` names it; the caller removes it) with the code of ``ref`` in
    ``before/`` (see ``export``); the short commits of ``ref`` and of HEAD."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    tmp.chmod(0o711)
    (tmp / "before").mkdir()
    before_commit = export(ref, tmp / "before")
    return tmp, before_commit, git("rev-parse", "--short", "HEAD")


def is_checkout(path: Path) -> bool:
    """Whether ``path`` holds kernelmode's code (for a --before DIR)."""
    return (path / "kernelmode" / "__init__.py").is_file()


# -- a kernelmode server -------------------------------------------------------------------------


class KmServer:
    """`kernelmode serve` with extra settings, and what the benchmarks need of it.

    ``checkout``: the folder whose code `serve` runs (its cwd, so that ``import kernelmode`` is
    that checkout's; None: this one). ``start()`` again after the server died (or was killed)
    starts a successor on the same data dir; ``stop()`` stops the server, runs ``on_stop`` (a
    companion living in the data dir, say an external gateway, goes before the sweep), stops
    whatever of its data dir is left (an orphaned gateway, kernels, mounts) and removes the data
    dir and the log.
    """

    def __init__(self, name: str, env: dict[str, str], backend: str = "bwrap",
                 args: list[str] | None = None, data_dir: Path | None = None,
                 checkout: Path | None = None) -> None:
        self.name = name
        self.env = {"KERNELMODE_SESSIONS__TTL_SECONDS": "86400", **env}
        if checkout is not None:
            self.env["PYTHONPATH"] = str(checkout)  # never this checkout's code by way of the environment
        if "KERNELMODE_SANDBOX__KERNEL_PYTHON" not in os.environ:
            # not a worktree's symlink (see harness), and this checkout's for another checkout
            # (an exported tree has none)
            self.env.setdefault("KERNELMODE_SANDBOX__KERNEL_PYTHON", str(REAL_KERNEL_PYTHON))
        self.checkout = checkout
        self.backend = backend
        self.args = ["--sandbox", backend, *(args or [])]
        self.data_dir = data_dir
        self.srv: Server | None = None
        self.old: list[Server] = []  # killed predecessors (their stdout pipes are closed at the end)
        self.ctl: Http | None = None  # control connection: creates, deletes, readyz
        self.conns: list[Http] = []
        self.pool_size = 0
        self.ready: dict[str, Any] = {}
        self._gateway: int | None = None
        self._known: dict[int, int] = {}  # pid -> start time of every process seen under it
        self.keep_logs = False  # set when the run failed: the logs are copied before cleanup
        self.on_stop: list[Callable[[], object]] = []

    def start(self) -> float:
        """Start `serve` until it prints its serving line; the seconds it took.

        Blocking on purpose (it reads the child's stdout): the Server object is then ours to stop
        even if Ctrl-C arrives meanwhile."""
        if self.srv is not None:
            self.old.append(self.srv)
        t0 = time.perf_counter()
        self.srv = start_server(env_extra=self.env, data_dir=self.data_dir, args=self.args, cwd=self.checkout)
        took = time.perf_counter() - t0
        self.data_dir = self.srv.data_dir
        self.ctl = self.http()
        return took

    def http(self) -> Http:
        assert self.srv is not None
        conn = Http(self.srv.url, self.srv.token)
        self.conns.append(conn)
        return conn

    async def drop_connections(self) -> None:
        for conn in self.conns:
            await conn.close()
        self.conns.clear()
        self.ctl = None

    @property
    def manager_pid(self) -> int:
        assert self.srv is not None
        return self.srv.proc.pid

    @property
    def gateway_pid(self) -> int:
        """The Kernel Gateway of this server: the manager's child, or one adopted from a killed
        predecessor (found by its data dir). Looked up again once the known one has gone."""
        if self._gateway is not None and self._is_gateway(self._gateway):
            return self._gateway
        self._gateway = None
        table = ptable()
        for pid, ppid in table.items():
            if ppid == self.manager_pid and self._is_gateway(pid):
                self._gateway = pid
                return pid
        found = [pid for pid in processes_mentioning(str(self.data_dir)) if self._is_gateway(pid)]
        top = [pid for pid in found if table.get(pid) not in found]
        if len(top) != 1:
            raise RuntimeError(f"{self.name}: expected one kernel gateway process, found {top}")
        self._gateway = top[0]
        return top[0]

    @staticmethod
    def _is_gateway(pid: int) -> bool:
        with contextlib.suppress(OSError):
            return b"kernel_gateway" in Path(f"/proc/{pid}/cmdline").read_bytes()
        return False

    def remember_processes(self) -> list[int]:
        """The processes under the manager now (remembered: any left at stop() are killed)."""
        pids = descendants(self.manager_pid)
        for pid in pids:
            st = stat(pid)
            if st is not None:
                self._known[pid] = st[1]
        return pids

    async def ready_check(self, conn: Http | None = None) -> tuple[int, dict[str, Any]]:
        """GET /readyz: (status, checks); the checks are kept as ``ready``."""
        status, body = await (conn or self.ctl).json("GET", "/readyz")  # type: ignore[union-attr]
        self.ready = (body or {}).get("checks", {})
        return status, self.ready

    async def readyz(self, conn: Http | None = None) -> dict[str, Any]:
        return (await self.ready_check(conn))[1]

    async def wait_pool_full(self, settle: float = 0.3, timeout: float = 120, strict: bool = True,
                             need_ok: bool = False) -> bool:
        """Until the warm pool is full (no kernel starting in the background), then ``settle`` s.

        With ``need_ok``, /readyz must also answer 200. False (or, when ``strict``, an error) if
        that did not happen within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            status, checks = await self.ready_check()
            pool = checks.get("pool", {})
            self.pool_size = int(pool.get("size", 0))
            if int(pool.get("ready", -1)) >= self.pool_size and (status == 200 or not need_ok):
                break
            if time.monotonic() > deadline:
                if strict:
                    raise RuntimeError(f"{self.name}: the warm pool did not fill up: {checks}")
                return False
            await asyncio.sleep(0.05)
        await asyncio.sleep(settle)
        return True

    async def create(self, body: dict[str, Any], conn: Http | None = None) -> dict[str, Any]:
        status, info = await (conn or self.ctl).json("POST", "/v1/sessions", body)  # type: ignore[union-attr]
        if status != 201:
            raise RuntimeError(f"{self.name}: POST /v1/sessions: {status} {info}")
        return info

    async def delete(self, sid: str, conn: Http | None = None) -> None:
        status, body = await (conn or self.ctl).json("DELETE", f"/v1/sessions/{sid}")  # type: ignore[union-attr]
        if status != 204:
            raise RuntimeError(f"{self.name}: DELETE {sid}: {status} {body}")

    async def stop(self, timeout: float = 180) -> None:
        await self.drop_connections()
        srv, self.srv = self.srv, None
        if srv is not None:
            with contextlib.suppress(Exception):
                self._remember(srv)
            if self.keep_logs:
                self._keep_logs(srv)
            if srv.proc.poll() is None:
                try:
                    await asyncio.to_thread(srv.stop, signal.SIGTERM, timeout)
                except subprocess.TimeoutExpired:
                    srv.proc.kill()
                    srv.proc.wait(10)
        for hook in self.on_stop:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(hook)
        self.on_stop.clear()
        await asyncio.to_thread(self._kill_leftovers)
        for s in (*self.old, *([srv] if srv is not None else [])):
            if s.proc.stdout is not None:
                s.proc.stdout.close()
        self.old.clear()
        if self.data_dir is not None:
            unmount_under(self.data_dir)
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir.with_suffix(".log").unlink(missing_ok=True)

    def _remember(self, srv: Server) -> None:
        if srv.proc.poll() is None:
            self.remember_processes()

    def _keep_logs(self, srv: Server) -> None:
        slug = self.name.replace("+", "-").replace(" ", "-").replace("=", "")
        keep = Path(tempfile.mkdtemp(prefix=f"km-bench-logs-{slug}-", dir="/tmp"))
        for src in (srv.log_path, srv.data_dir / "gateway" / "gateway.log"):
            with contextlib.suppress(OSError):
                shutil.copy(src, keep / src.name)
        print(f"the run failed: logs of the {self.name} server kept in {keep}", file=sys.stderr)

    def _kill_leftovers(self) -> None:
        """Whatever of this server outlived it: a gateway orphaned by a killed manager (with its
        kernels: by process group), processes of its data dir, processes seen under it."""
        if self.data_dir is not None:
            where = str(self.data_dir)
            deadline = time.monotonic() + 15
            while processes_mentioning(where) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = processes_mentioning(where)
            if left:
                print(f"{self.name}: {len(left)} process(es) left after the server stopped: killing them",
                      file=sys.stderr)
                for pid in left:
                    if self._is_gateway(pid):
                        with contextlib.suppress(OSError):
                            os.killpg(pid, signal.SIGKILL)
                for pid in processes_mentioning(where):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.5)
        for pid, start in self._known.items():  # same pid and start time: still ours
            st = stat(pid)
            if st is not None and st[1] == start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


class RestSession:
    """One session on a real `kernelmode serve` (bwrap sandbox, one trivial host tool), driven over
    REST with one keep-alive http.client connection (``roundtrip``) or httpx.Client (``client``);
    ``env``: the server's extra settings."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = env or {}
        self.km: KmServer | None = None
        self.client: httpx.Client | None = None
        self.conn: http.client.HTTPConnection | None = None
        self.sid: str | None = None
        self.ready: dict[str, Any] = {}
        self.session_sandbox = ""
        self._config: Path | None = None
        self._path = ""
        self._body = EXEC_BODY

    @property
    def server(self) -> Server | None:
        return None if self.km is None else self.km.srv

    async def start(self) -> None:
        # One trivial host tool, for the tool-call round trip from kernel code.
        self._config = Path(tempfile.mkstemp(prefix="kmbench-", suffix=".yaml")[1])
        self._config.write_text('tools:\n  - {name: add, function: "tests.integration.host_tools:add"}\n'
                                'tool_calls: {rate_per_second: 1000000, rate_burst: 1000000}\n')
        self.km = KmServer("rest", self.env, args=["--config", str(self._config)])
        self.km.start()
        assert self.server is not None
        self.client = self.server.client(timeout=60)
        r = self.client.get("/readyz")
        self.ready = r.json().get("checks", {})
        r = self.client.post("/v1/sessions", json={})
        if r.status_code != 201:
            raise RuntimeError(f"POST /v1/sessions: {r.status_code} {r.text}")
        info = r.json()
        self.sid = info["session_id"]
        self.session_sandbox = info.get("sandbox", "")
        self._path = f"/v1/sessions/{self.sid}/execute"

    async def roundtrip(self) -> float:
        """The REST call through a lean keep-alive client (the standard library's http.client)."""
        assert self.server is not None
        if self.conn is None:
            u = urlsplit(self.server.url)
            self.conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=60)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.server.token}"}
        t0 = time.perf_counter_ns()
        self.conn.request("POST", self._path, body=self._body, headers=headers)
        resp = self.conn.getresponse()
        data = resp.read()
        elapsed = ms_since(t0)
        if resp.status != 200:
            raise RuntimeError(f"POST {self._path}: {resp.status} {data[:500]!r}")
        body = json.loads(data)
        if body.get("status") != "ok" or body.get("result") != EXPECTED:
            raise RuntimeError(f"kernelmode answered {body!r}")
        return elapsed

    async def roundtrip_httpx(self) -> float:
        # A blocking call on purpose: nothing else needs the event loop while it runs.
        assert self.client is not None
        t0 = time.perf_counter_ns()
        r = self.client.post(self._path, content=self._body,
                             headers={"Content-Type": "application/json"})
        elapsed = ms_since(t0)
        if r.status_code != 200:
            raise RuntimeError(f"POST {self._path}: {r.status_code} {r.text[:500]}")
        body = r.json()
        if body.get("status") != "ok" or body.get("result") != EXPECTED:
            raise RuntimeError(f"kernelmode answered {body!r}")
        return elapsed

    async def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.client is not None:
            if self.sid is not None:
                with contextlib.suppress(Exception):
                    self.client.delete(f"/v1/sessions/{self.sid}")
            self.client.close()
        if self.km is not None:
            await self.km.stop(timeout=30)
        if self._config is not None:
            self._config.unlink(missing_ok=True)




def kernel_pid(gateway_pid: int, kernel_id: str) -> int:
    """The ipykernel process (not its bwrap wrappers) of ``kernel_id`` under a gateway."""
    for p in descendants(gateway_pid):
        argv = cmdline(p)
        if argv and "bwrap" not in Path(argv[0]).name and "ipykernel_launcher" in argv \
                and any(kernel_id in a for a in argv):
            return p
    raise RuntimeError(f"no kernel process for {kernel_id} under pid {gateway_pid}")


# -- CPU per path over interleaved batches -------------------------------------------------------


class CpuMeter:
    """On-CPU time per path and role over the batches ``harness.interleave`` runs: pass ``around``
    as its ``around``. ``watch(path, role=pids)`` names the processes of a path (every thread of
    each, procfs.cpu_ns); with ``client``, every path also counts this process's own CPU time
    (the benchmark's client) as the role ``client``. The other paths idle meanwhile, so a
    server's CPU over its own batches is its work for those requests."""

    CLIENT = "client"

    def __init__(self, stats: Mapping[str, Stats], client: bool = False) -> None:
        self.stats = stats
        self.client = client
        self.pids: dict[str, dict[str, list[int]]] = {p: {} for p in stats}
        self.ns: dict[str, dict[str, int]] = {p: {} for p in stats}
        self.runs = dict.fromkeys(stats, 0)

    def watch(self, path: str, **roles: int | Sequence[int]) -> None:
        """Count these processes' CPU time for ``path``, by role."""
        for role, pids in roles.items():
            self.pids[path][role] = [pids] if isinstance(pids, int) else list(pids)
            self.ns[path].setdefault(role, 0)

    @contextlib.contextmanager
    def around(self, path: str) -> Iterator[None]:
        """Account one batch of ``path``."""
        roles = self.pids[path]
        before = {r: sum(map(cpu_ns, pids)) for r, pids in roles.items()}
        client0, n0 = time.process_time_ns(), self.stats[path].n
        yield
        for r, pids in roles.items():
            self.ns[path][r] += sum(map(cpu_ns, pids)) - before[r]
        if self.client:
            self.ns[path][self.CLIENT] = self.ns[path].get(self.CLIENT, 0) + time.process_time_ns() - client0
        self.runs[path] += self.stats[path].n - n0

    def per_run(self, path: str, role: str) -> float:
        """Milliseconds of CPU of ``role`` per request of ``path`` (0 for a role it lacks)."""
        return self.ns[path].get(role, 0) / 1e6 / max(self.runs[path], 1)

    def measured(self, path: str, role: str) -> bool:
        """Whether ``path`` has the role and it used any CPU (a report leaves the cell blank if not)."""
        return self.ns[path].get(role, 0) > 0
