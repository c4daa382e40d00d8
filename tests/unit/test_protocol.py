"""The in-kernel modules keep their own copies of the wire names (they are sent into kernels as
source, where kernelmode is not installed, so they cannot import kernelmode.protocol): each copy
must equal the protocol's name, or the manager and the kernel stop understanding each other."""

from __future__ import annotations

import pytest

from kernelmode import protocol
from kernelmode.kernel import file_agent, hints, preamble, snapshot

COPIES = [
    (preamble, "MARKER", "MARKER"),
    (preamble, "PING", "PING"),
    (preamble, "SEARCH", "SEARCH"),
    (preamble, "PIP", "PIP"),
    (preamble, "PACKAGES_ENV", "PACKAGES_ENV"),
    (file_agent, "TARGET", "FILES_TARGET"),
    (file_agent, "CHANGES_COMM", "CHANGES_COMM"),
    (file_agent, "NOTE_KEY", "NOTE_KEY"),
    (snapshot, "MIME", "SNAPSHOT_MIME"),
]


@pytest.mark.parametrize(("module", "copy", "name"), COPIES, ids=[f"{m.__name__}.{c}" for m, c, _ in COPIES])
def test_the_kernel_side_copy_equals_the_protocol(module: object, copy: str, name: str) -> None:
    assert getattr(module, copy) == getattr(protocol, name)


@pytest.mark.parametrize("memory_mb", [None, 0, 512])
def test_the_memory_hint_reads_the_same_in_the_kernel_and_the_manager(memory_mb: int | None) -> None:
    assert hints.memory_hint(memory_mb) == protocol.memory_hint(memory_mb)

