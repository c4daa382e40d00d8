"""Run one kernel container in the foreground: the process the gateway watches for a Docker kernel.

Started by the Docker provisioner as ``python docker_launcher.py SPEC_JSON``. It creates the
container through the Docker SDK, relays its output to this process's stdout (the kernel's log),
and exits with the container's exit code (128+N for a signal, as bwrap does), so the gateway's
restarter and the death records work as with bubblewrap. SIGTERM stops the container, SIGKILL
of this process is covered by the provisioner removing the container by name.

The launcher dies with the gateway that started it, and takes its container along: a start
the gateway never finished (it was stopped meanwhile) left a container, and a loop-mounted
workspace, running with nobody to stop them. The gateway's death is SIGHUP here
(PR_SET_PDEATHSIG): the container is removed (or, not made yet, never started), then exit.

Whether the container started is written to ``spec["status_file"]`` at once (``{"started": true}``
or ``{"error": "<the engine's message>"}``, then exit 125 as ``docker run`` does), so the
provisioner reports an engine's refusal while the kernel is being started, not after a time-out.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
from typing import Any

import docker
from docker.errors import APIError, DockerException, NotFound

EXIT_ENGINE_REFUSED = 125  # docker run's code for "the daemon refused"
EXIT_ORPHANED = 128 + signal.SIGHUP
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _status(spec: dict[str, Any], status: dict[str, Any]) -> None:
    path = spec.get("status_file")
    if not path:
        return
    with open(f"{path}.tmp", "w") as f:
        json.dump(status, f)
    os.replace(f"{path}.tmp", path)


class Orphaning:
    """The gateway's death (SIGHUP by PR_SET_PDEATHSIG): remove the container, if made, and exit."""

    def __init__(self) -> None:
        self.container: Any = None
        self.orphaned = threading.Event()

    def arm(self, parent_pid: object) -> None:
        signal.signal(signal.SIGHUP, self._on_parent_death)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGHUP, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if isinstance(parent_pid, int) and os.getppid() != parent_pid:
            self.orphaned.set()  # gone before the signal was set: nothing will be started

    def _on_parent_death(self, signum: int, _frame: Any) -> None:
        self.orphaned.set()
        if self.container is not None:  # else main() sees the flag once create() returns
            self.remove()
            os._exit(EXIT_ORPHANED)

    def remove(self) -> None:
        if self.container is not None:
            with contextlib.suppress(DockerException):
                self.container.remove(force=True)


def main() -> int:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    orphaning = Orphaning()
    orphaning.arm(spec.get("parent_pid"))
    if orphaning.orphaned.is_set():
        return EXIT_ORPHANED
    client = docker.from_env(timeout=60)
    name = spec["name"]
    try:  # a container of an earlier launch of this kernel (a restart after a crash)
        client.containers.get(name).remove(force=True)
    except NotFound:
        pass
    create = dict(spec["create"])
    if spec.get("seccomp_profile"):  # the engine takes the profile's JSON itself, not a path
        with open(spec["seccomp_profile"]) as f:
            create["security_opt"] = [*create.get("security_opt", []), f"seccomp={f.read()}"]
    try:
        container = client.containers.create(**create, name=name, detach=True)
    except DockerException as e:
        return _refused(spec, e)
    orphaning.container = container
    if orphaning.orphaned.is_set():  # the gateway died while the container was being made
        orphaning.remove()
        return EXIT_ORPHANED
    stopping = threading.Event()

    def stop(signum: int, _frame: Any) -> None:
        stopping.set()
        try:
            container.stop(timeout=2)
        except APIError:
            pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        container.start()
    except DockerException as e:
        with contextlib.suppress(DockerException):
            container.remove(force=True)
        return _refused(spec, e)
    if orphaning.orphaned.is_set():  # during the start (the handler removed it, or will)
        orphaning.remove()
        return EXIT_ORPHANED
    _status(spec, {"started": True})

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

    relaying = threading.Thread(target=relay, daemon=True)
    relaying.start()
    status = container.wait()
    # The log's stream ends with the container: its last lines (what a kernel that died at start
    # said, for the death record) are relayed before this exits.
    relaying.join(5)
    return int(status.get("StatusCode", 1))


def _refused(spec: dict[str, Any], e: DockerException) -> int:
    """The engine would not create or start the container (e.g. a ulimit above its own)."""
    message = str(getattr(e, "explanation", None) or e)
    print(f"kernelmode: the Docker engine refused the container: {message}", flush=True)
    _status(spec, {"error": message})
    return EXIT_ENGINE_REFUSED


if __name__ == "__main__":
    sys.exit(main())
