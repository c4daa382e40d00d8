"""Many sessions' egress at once, driven from the host: the real egress service (kernelmode.egress,
50 session proxies, each on its own unix socket) in a process of its own, the HTTPS upstream in
another, and this process's asyncio clients, each connecting to a session's socket as that
session's in-sandbox bridge would (the bridge itself is not in this path: 50 kernels are too
heavy for a shared 2-core machine; bench/egress.py measures the bridge's path from kernels).

A round: every session makes ``per_session`` requests at once (``sessions * per_session``
concurrent GETs), tunnelled (CONNECT, TLS end to end), intercepted (secret header added) or direct
to the upstream; rounds interleaved. The proxy process's CPU time over a round, per request, is
what the proxy adds on the host.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import Stats

MB = 1_000_000


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _upstream(cert: str, q: Any) -> None:
    from tests.support.upstreams import Upstream

    up = Upstream(Path(cert))
    q.put(up.port)
    up.thread.join()


def _proxies(root: str, ca: str, port: int, sessions: int, q: Any) -> None:
    from kernelmode.config import EgressSettings
    from kernelmode.egress.policy import server_policy
    from kernelmode.egress.service import Egress

    settings = EgressSettings(
        allow=[f"secure.test:{port}", f"secret.test:{port}"],
        hosts={"secure.test": "127.0.0.1", "secret.test": "127.0.0.1"}, allow_addresses=["127.0.0.1/32"],
        secrets=[{"host": "secret.test", "header": "Authorization", "value": "Bearer bench-secret"}],
        upstream_ca_file=Path(ca), max_bytes_per_session=10**13, max_connections_per_session=32)

    async def main() -> None:
        egress = Egress(Path(root) / "data")
        dirs = []
        for i in range(sessions):
            d = Path(root) / f"s{i}"
            d.mkdir()
            await egress.open(f"s{i}", None, server_policy(settings), d)
            dirs.append(str(d))
        q.put(dirs)
        await asyncio.Event().wait()
    asyncio.run(main())


async def _get(size: int, ctx: ssl.SSLContext, host: str, port: int, via: str | None) -> float:
    t0 = time.perf_counter()
    if via is None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=host)
    else:
        reader, writer = await asyncio.open_unix_connection(via)
        writer.write(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        await writer.start_tls(ctx, server_hostname=host)
    writer.write(f"GET /bytes/{size} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    n = 0
    while chunk := await reader.read(1 << 20):
        n += len(chunk)
    writer.close()
    assert n > size, n
    return (time.perf_counter() - t0) * 1000


@dataclass
class Fleet:
    sessions: int
    per_session: int
    size: int
    latency: dict[str, Stats] = field(default_factory=dict)
    cpu: dict[str, Stats] = field(default_factory=dict)  # proxy CPU ms per request, per round
    round_ms: dict[str, Stats] = field(default_factory=dict)


def run(tmp: Path, ca: Path, cert: Path, bundle: Path, *, sessions: int = 50, per_session: int = 4,
        size: int = 100_000, rounds: int = 3) -> Fleet:
    fleet = Fleet(sessions, per_session, size)
    q: Any = mp.Queue()
    up = mp.Process(target=_upstream, args=(str(cert), q), daemon=True)
    up.start()
    port = q.get(timeout=60)
    proxy = mp.Process(target=_proxies, args=(str(tmp / "fleet"), str(ca), port, sessions, q), daemon=True)
    (tmp / "fleet").mkdir()
    proxy.start()
    dirs = q.get(timeout=120)
    assert proxy.pid is not None
    # A client trusts what a kernel does: the system store, the upstream CA and, for the
    # intercepted host, the deployment CA (in each session's bundle).
    ctx = ssl.create_default_context(cafile=str(bundle))
    ictx = ssl.create_default_context(cafile=f"{dirs[0]}/ca-bundle.pem")
    for name in ("tunnel", "intercept", "direct"):
        fleet.latency[name], fleet.cpu[name], fleet.round_ms[name] = Stats(name), Stats(name), Stats(name)

    async def one_round(name: str) -> None:
        n = sessions * per_session
        jobs = []
        for d in dirs:
            for _ in range(per_session):
                if name == "direct":
                    jobs.append(_get(size, ctx, "secure.test", port, None))
                elif name == "tunnel":
                    jobs.append(_get(size, ctx, "secure.test", port, f"{d}/proxy.sock"))
                else:
                    jobs.append(_get(size, ictx, "secret.test", port, f"{d}/proxy.sock"))
        before, t0 = cpu_seconds(proxy.pid), time.perf_counter()  # type: ignore[arg-type]
        fleet.latency[name].samples += await asyncio.gather(*jobs)
        fleet.round_ms[name].samples.append((time.perf_counter() - t0) * 1000)
        fleet.cpu[name].samples.append((cpu_seconds(proxy.pid) - before) * 1000 / n)  # type: ignore[arg-type]

    async def main() -> None:
        for name in ("tunnel", "intercept"):  # warm-up: the minted certificate, the pools
            await _get(size, ctx if name == "tunnel" else ictx, f"{'secure' if name == 'tunnel' else 'secret'}.test",
                       port, f"{dirs[0]}/proxy.sock")
        order = ["tunnel", "intercept", "direct"]
        for i in range(rounds):
            for name in order:
                await one_round(name)
            order = order[1:] + order[:1]
            print(f"fleet round {i + 1}: " + ", ".join(
                f"{n} {fleet.round_ms[n].samples[-1]:.0f} ms" for n in fleet.round_ms), flush=True)
    try:
        asyncio.run(main())
    finally:
        proxy.kill()
        up.kill()
    return fleet


def table(f: Fleet) -> str:
    d = f.round_ms["direct"].median
    rows = []
    for name, label in (("tunnel", "tunnel (CONNECT, TLS end to end)"), ("intercept", "intercept (secret header added)"),
                        ("direct", "direct (no proxy)")):
        rows.append(f"| {label} | {f.round_ms[name].median:.0f} | {f.round_ms[name].median / d:.2f}x | "
                    f"{f.latency[name].median:.0f} | {f.latency[name].pct(90):.0f} | "
                    + (f"{f.cpu[name].median:.2f} |" if name != "direct" else "— |"))
    return ("| path | round ms (median) | vs direct | request ms median | p90 | proxy CPU ms per request |\n"
            "|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows))
