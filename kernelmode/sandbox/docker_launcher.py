"""Run one kernel container in the foreground: the process the gateway watches for a Docker kernel.

Started by the Docker provisioner as ``python docker_launcher.py SPEC_JSON``. It creates the
container through the Docker SDK, relays its output to this process's stdout (the kernel's log),
and exits with the container's exit code (128+N for a signal, as bwrap does), so the gateway's
restarter and the death records work as with bubblewrap. SIGTERM stops the container, SIGKILL
of this process is covered by the provisioner removing the container by name.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from typing import Any

import docker
from docker.errors import APIError, NotFound


def main() -> int:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    client = docker.from_env(timeout=60)
    name = spec["name"]
    try:  # a container of an earlier launch of this kernel (a restart after a crash)
        client.containers.get(name).remove(force=True)
    except NotFound:
        pass
    container = client.containers.create(**spec["create"], name=name, detach=True)
    stopping = threading.Event()

    def stop(signum: int, _frame: Any) -> None:
        stopping.set()
        try:
            container.stop(timeout=2)
        except APIError:
            pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    container.start()

    def relay() -> None:
        """The kernel's raw output to its log, up to a cap (it is not the kernel's to fill the disk)."""
        out = sys.stdout.buffer
        room = int(spec.get("log_cap_bytes", 10 << 20))
        for chunk in container.logs(stream=True, follow=True):
            if room <= 0:
                continue  # keep draining: the engine's own log is capped too
            out.write(chunk[:room])
            out.flush()
            room -= len(chunk)
            if room <= 0:
                out.write(b"\n[kernelmode: the kernel's raw output was cut here]\n")
                out.flush()

    threading.Thread(target=relay, daemon=True).start()
    status = container.wait()
    return int(status.get("StatusCode", 1))


if __name__ == "__main__":
    sys.exit(main())
