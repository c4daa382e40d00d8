"""Several managers on one store: ONE external Kernel Gateway the test owns, the suite's
PostgreSQL (a database given by the caller, ``pg_url``), and N real `kernelmode serve`
processes sharing `store.url`, `gateway.url`, the admin token and one local artifact store
(each manager's ``artifacts`` and ``artifacts.key`` link to the shared ones, so a download link
signed by one is good on the others). Each has its own port and data dir; ``kill(i)`` is a
SIGKILL (a crash), ``restart(i)`` a new process on the same port and data dir.

    with start_managers(2, pg_url) as ms:
        ms.client(0).post("/v1/sessions", ...)
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.external_gateway import ExternalGateway, start_external_gateway
from tests.support.procfs import unmount_under
from tests.support.server import Server, start_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Managers:
    gateway: ExternalGateway
    root: Path  # the gateway's data dir, the shared artifacts and each manager's data dir
    env: dict[str, str]  # what every manager gets
    ports: list[int]
    args: list[str] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)

    @property
    def token(self) -> str:
        return self.env["KERNELMODE_TOKEN"]

    def __getitem__(self, i: int) -> Server:
        return self.servers[i]

    def __len__(self) -> int:
        return len(self.servers)

    def data_dir(self, i: int) -> Path:
        return self.root / f"m{i}"

    def client(self, i: int, timeout: float = 120) -> httpx.Client:
        return self.servers[i].client(timeout=timeout)

    def _start(self, i: int) -> Server:
        d = self.data_dir(i)
        d.mkdir(exist_ok=True)
        for name in ("artifacts", "artifacts.key"):  # one local artifact store for all
            if not (d / name).is_symlink():
                (d / name).symlink_to(self.root / name)
        srv = start_server(self.env, data_dir=d, args=["--port", str(self.ports[i]), *self.args])
        srv.token = self.token
        return srv

    def add(self) -> Server:
        """Start the next manager (one that joins: ``start_managers(..., started=)``)."""
        self.servers.append(self._start(len(self.servers)))
        return self.servers[-1]

    def kill(self, i: int) -> None:
        """SIGKILL manager ``i`` (its kernels keep running on the gateway)."""
        self.servers[i].stop(signal.SIGKILL)

    def restart(self, i: int) -> Server:
        """A new `serve` on manager ``i``'s port and data dir (after ``kill`` or a stop)."""
        if self.servers[i].proc.poll() is None:
            self.servers[i].stop()
        self.servers[i] = self._start(i)
        return self.servers[i]

    def stop(self) -> None:
        for srv in self.servers:
            with contextlib.suppress(Exception):
                srv.stop()
        self.gateway.stop()
        unmount_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)
        for p in (*(self.data_dir(i).with_suffix(".log") for i in range(len(self.ports))),
                  self.gateway.log_path):
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def start_managers(n: int, pg_url: str | None, env_extra: dict[str, str] | None = None,
                   args: list[str] | None = None, started: int | None = None) -> Iterator[Managers]:
    """``n`` managers on one gateway and one PostgreSQL database (``pg_url``; None: SQLite in
    each one's data dir, for a single manager); all stopped and removed after. ``env_extra``:
    settings every manager gets (`KERNELMODE_...`); ``started``: how many start now (the
    others join with ``add``)."""
    root = Path(tempfile.mkdtemp(prefix="kmmgr-", dir="/tmp"))
    root.chmod(0o711)
    (root / "artifacts").mkdir(mode=0o700)
    (root / "artifacts.key").write_text(secrets.token_hex(32))
    (root / "artifacts.key").chmod(0o600)
    gw_dir = root / "gateway-data"
    gw_dir.mkdir()
    gw_dir.chmod(0o711)
    gw = start_external_gateway(gw_dir)
    env = {**gw.env(), **({"KERNELMODE_STORE__URL": pg_url} if pg_url else {}),
           "KERNELMODE_TOKEN": "t" + secrets.token_urlsafe(16), **(env_extra or {})}
    ms = Managers(gateway=gw, root=root, env=env, ports=[_free_port() for _ in range(n)], args=list(args or []))
    try:
        for _ in range(n if started is None else started):
            ms.add()
        yield ms
    finally:
        ms.stop()
