"""Host uids for kernels: one per live kernel, on the whole host, not only in this gateway.

When the gateway runs as root each kernel runs as a host uid of its own (uid_base + slot). Two
gateways on one host (two `serve`s, a restart that overlaps the old one, the test suite's
servers) used to hand out the same uids, each counting from uid_base. Kernels of different
servers then shared a uid, and so a budget the host keeps per uid: RLIMIT_NPROC counts every
process and thread of the uid host-wide, so a fork bomb in one server's kernel stopped a kernel
of the other from starting a thread. A uid is therefore leased host-wide: an exclusive ``flock``
on a file named after it in LEASE_DIR, held by this gateway from the kernel's start to its
release (the kernel never holds the descriptor: it is close-on-exec). A gateway that dies drops
its leases with its descriptors.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

LEASE_DIR = Path("/run/kernelmode/uids")

# kernel id -> (host uid, the lease's descriptor); outlives a provisioner instance (one per start).
_leases: dict[str, tuple[int, int]] = {}
_next = [0]  # where the search for a free uid starts: after the last one handed out


def _lease(uid: int) -> int | None:
    """The descriptor of ``uid``'s lease, or None when another gateway holds it."""
    LEASE_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(LEASE_DIR / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def allocate(kernel_id: str, base: int, count: int) -> int:
    """A host uid no live kernel on this host has (this gateway's or another's). Uids are handed
    out round-robin, so a freed uid is reused as late as possible (never right away by the next
    kernel, which a straggler of the old one could otherwise share a uid with)."""
    if kernel_id in _leases:
        return _leases[kernel_id][0]
    used = {uid for uid, _ in _leases.values()}
    start = _next[0] % count
    for i in range(count):
        uid = base + (start + i) % count
        if uid in used or (fd := _lease(uid)) is None:
            continue
        _leases[kernel_id] = (uid, fd)
        _next[0] = uid - base + 1
        return uid
    raise RuntimeError("kernelmode: no free sandbox uid left (sandbox.uid_count, shared by every "
                       "kernelmode on this host)")


def release(kernel_id: str) -> None:
    """The kernel is gone: its uid may go to another kernel (of any gateway on this host)."""
    lease = _leases.pop(kernel_id, None)
    if lease is not None:
        with contextlib.suppress(OSError):
            os.close(lease[1])


def uid_of(kernel_id: str) -> int | None:
    """The host uid leased to ``kernel_id``, if any."""
    lease = _leases.get(kernel_id)
    return lease[0] if lease else None
