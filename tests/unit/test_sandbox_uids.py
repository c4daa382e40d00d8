"""Host uids for kernels (kernelmode/sandbox/uids.py): unique among this gateway's kernels, reused
as late as possible, and leased host-wide, so two gateways on one host never hand out the same
uid (a kernel of each would share the host's per-uid budgets, e.g. RLIMIT_NPROC)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelmode.sandbox import uids


@pytest.fixture
def leases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A lease directory of the test's own, and this process's leases forgotten after."""
    monkeypatch.setattr(uids, "LEASE_DIR", tmp_path / "uids")
    monkeypatch.setattr(uids, "_next", [0])
    yield tmp_path / "uids"
    for kernel_id in list(uids._leases):
        uids.release(kernel_id)


def test_unique_and_reused_as_late_as_possible(leases: Path) -> None:
    a, b = uids.allocate("a", 5000, 3), uids.allocate("b", 5000, 3)
    assert (a, b) == (5000, 5001) and uids.allocate("a", 5000, 3) == a
    uids.release("a")  # a's kernel ended: its uid is not the next one handed out
    assert uids.allocate("c", 5000, 3) == 5002
    assert uids.allocate("d", 5000, 3) == 5000  # wrapped around to the free one
    with pytest.raises(RuntimeError, match="no free sandbox uid"):
        uids.allocate("e", 5000, 3)
    assert uids.uid_of("d") == 5000 and uids.uid_of("a") is None


HOLDER = """
import sys
from pathlib import Path
from kernelmode.sandbox import uids
uids.LEASE_DIR = Path(sys.argv[1])
print(uids.allocate("other-gateways-kernel", 5000, 3), flush=True)
sys.stdin.read()  # holds the lease until the test closes our stdin
"""


def test_another_gateways_uid_is_not_handed_out(leases: Path) -> None:
    # Another process (as another gateway would be) leases the first uid of the same range ...
    other = subprocess.Popen([sys.executable, "-c", HOLDER, str(leases)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        assert int(other.stdout.readline()) == 5000
        # ... so this gateway's kernels get the others, and none is left for a third.
        assert [uids.allocate(k, 5000, 3) for k in ("a", "b")] == [5001, 5002]
        with pytest.raises(RuntimeError, match="no free sandbox uid"):
            uids.allocate("c", 5000, 3)
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)
    # The other gateway is gone (its descriptors with it): its uid is free again.
    assert uids.allocate("c", 5000, 3) == 5000


def test_the_lease_is_not_inherited_by_what_the_gateway_starts(leases: Path) -> None:
    uids.allocate("a", 5000, 3)
    # A child (as bwrap and the kernel are) does not hold the lease: after the release, another
    # process can take the uid while the child still runs.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        uids.release("a")
        probe = subprocess.run([sys.executable, "-c", HOLDER, str(leases)], input="", text=True,
                               capture_output=True, timeout=60)
        assert probe.stdout.strip() == "5000", probe.stderr
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
