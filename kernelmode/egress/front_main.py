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
from pathlib import Path

from prometheus_client import start_http_server

from ..config import Settings
from ..metrics import Metrics
from ..sessions.store import open_store
from .front import EgressFront
from .tls import Certificates, ca_directory, kernel_bundle, write_atomic

log = logging.getLogger("kernelmode.egress")


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _ca_dir(settings: Settings) -> Path:
    return ca_directory(settings.egress.ca_dir, settings.server.data_dir.resolve())


def make_ca(settings: Settings) -> int:
    """`--make-ca`: a new deployment CA in egress.ca_dir (refused if one is there: replacing it
    would break every kernel trusting the old one)."""
    certs = Certificates(_ca_dir(settings))
    if certs.ca_pem_path.exists() or (certs.directory / "ca-key.pem").exists():
        print(f"kernelmode: {certs.directory} already holds a CA (ca.pem/ca-key.pem): remove both first "
              "to replace it", file=sys.stderr)
        return 2
    try:
        certs.create()
    except OSError as e:
        print(f"kernelmode: cannot write the CA into {certs.directory}: {e}", file=sys.stderr)
        return 2
    print(f"kernelmode: wrote {certs.ca_pem_path} and {certs.directory / 'ca-key.pem'} (0600: the proxies' only)")
    return 0


def write_ca_bundle(settings: Settings, path: Path) -> int:
    """`--write-ca-bundle PATH`: what remote kernels trust (egress.remote_ca_bundle): the system
    CAs, egress.upstream_ca_file and the deployment CA's certificate (read only: no key needed)."""
    certs = Certificates(_ca_dir(settings))
    try:
        ca_pem = certs.ca_pem_path.read_bytes()
    except OSError as e:
        print(f"kernelmode: no deployment CA to bundle ({e}): make one with `kernelmode egress-proxy "
              "--make-ca` (or set egress.ca_dir to where it is)", file=sys.stderr)
        return 2
    try:
        write_atomic(path.absolute(), kernel_bundle(ca_pem, settings.egress.upstream_ca_file), 0o644)
    except OSError as e:
        print(f"kernelmode: cannot write {path}: {e}", file=sys.stderr)
        return 2
    print(f"kernelmode: wrote {path} (system CAs + the deployment CA); on Kubernetes: kubectl -n "
          f"kernelmode-kernels create configmap kernelmode-egress-ca --from-file=ca-bundle.pem={path}")
    return 0


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
    try:  # the CA now, not at a kernel's first intercepted request: a missing or bad one stops here
        front.certs.ca()
    except (OSError, ValueError) as e:
        print(f"kernelmode: egress-proxy cannot load or make the deployment CA in {front.certs.directory} "
              f"(egress.ca_dir): {e}; make one with `kernelmode egress-proxy --make-ca`", file=sys.stderr)
        store.close()
        return 2
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
