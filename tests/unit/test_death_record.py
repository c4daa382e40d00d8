"""The provisioner's death record carries the kernel's last output (its log's tail: what a kernel
that dies at start said), bounded and printable; a record without it (an older gateway's) reads
as before."""

from __future__ import annotations

import json
from pathlib import Path

from kernelmode.models import DeathCause
from kernelmode.sandbox.base import TAIL_CHARS, log_tail
from kernelmode.sandbox.spec import (
    death_record_path,
    pop_death,
    pop_death_record,
    write_death_record,
)


def test_the_tail_is_the_last_lines_each_once_printable_and_bounded(tmp_path: Path) -> None:
    log = tmp_path / "k.log"
    # a kernel restarted after each death appends the same line again
    log.write_bytes(b"old noise\n" * 2000 + b"bwrap: no\n\x1b[31mred\x07\n\n" + b"exit 3 said\n" * 5)
    assert log_tail(log) == "old noise\nbwrap: no\n[31mred\nexit 3 said"
    log.write_text("\n" + "x" * 4000 + "\n")
    assert len(log_tail(log)) == TAIL_CHARS
    assert log_tail(tmp_path / "none.log") == ""
    (tmp_path / "link.log").symlink_to(log)
    assert log_tail(tmp_path / "link.log") == ""  # never followed


def test_a_record_keeps_the_output_and_an_old_one_reads_as_before(tmp_path: Path) -> None:
    cause = DeathCause(kind="exit", exit_code=3)
    write_death_record(tmp_path, "k1", cause, "bwrap: refused")
    assert pop_death(tmp_path, "k1") == (cause, "bwrap: refused")
    assert pop_death(tmp_path, "k1") is None  # once
    write_death_record(tmp_path, "k2", cause, "said")
    assert pop_death_record(tmp_path, "k2") == cause
    death_record_path(tmp_path, "k3").write_text(json.dumps({"kind": "signal", "signal": 9}))
    assert pop_death(tmp_path, "k3") == (DeathCause(kind="signal", signal=9), "")


def test_a_tenant_is_told_a_dead_kernels_cause_but_not_its_output() -> None:
    """kernel_env.told: what a kernel that died at start printed (host paths) is the operator's."""
    from kernelmode.errors import SandboxUnavailable
    from kernelmode.sessions.kernel_env import OUTPUT_NOTE, told

    said = "bwrap: Can't find source path /srv/secret-layout/venv"
    full = SandboxUnavailable(f"the kernel died as it started (exit status 1){OUTPUT_NOTE}{said!r}. Run doctor",
                              details={"cause": {"kind": "exit", "exit_code": 1}, "output": said})
    for operator in (None, "admin"):
        assert told(full, operator) is full
    tenant = told(full, "alpha")
    assert said not in tenant.message and "in the server's log" in tenant.message, tenant.message
    assert "exit status 1" in tenant.message and tenant.details == {"cause": {"kind": "exit", "exit_code": 1}}
