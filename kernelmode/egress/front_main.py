"""`kernelmode egress-proxy`: the TCP front (front.py) as a process of its own, beside the
managers, with their kernelmode.yaml and their store (it reads token hashes and sessions, and
writes nothing). Stops on SIGTERM/SIGINT; its connections end with it, and a kernel's next
request reaches whichever replica answers (nothing of a session lives only in one replica but
its caps' counts)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from prometheus_client import start_http_server

from ..config import Settings
from ..metrics import Metrics
from ..sessions.store import open_store
from .front import EgressFront

log = logging.getLogger("kernelmode.egress")


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


async def run(settings: Settings) -> int:
    """Serve until a signal; 2 (with the reason on stderr) when it cannot start."""
    cfg = settings.egress
    if cfg.listen is None:
        print("kernelmode: egress-proxy needs egress.listen (host:port, e.g. 0.0.0.0:3128; "
              "KERNELMODE_EGRESS__LISTEN or --listen)", file=sys.stderr)
        return 2
    data_dir = settings.server.data_dir.resolve()
    store = open_store(settings.store.url, data_dir)
    metrics = Metrics()
    if cfg.metrics_listen is not None:
        host, port = _split(cfg.metrics_listen)
        start_http_server(port, host, registry=metrics.registry)
    front = EgressFront(settings.egress, store.egress_tokens, data_dir, metrics)
    try:
        host, port = await front.start(*_split(cfg.listen))
    except OSError as e:
        print(f"kernelmode: egress-proxy cannot listen on egress.listen={cfg.listen}: {e}", file=sys.stderr)
        store.close()
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("egress proxy on %s:%d (store: %s)", host, port, store.describe())
    print(f"kernelmode egress-proxy listening on {host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await front.close()
        store.close()
    return 0
