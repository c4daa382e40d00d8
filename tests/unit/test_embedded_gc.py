"""The embedded `kernelmode mcp` pauses the garbage collector during its start (its ~200k
long-lived objects were gone over again and again: ~0.1 s of CPU before the first result) and
always turns it back on: after the start, with the start's objects frozen out of its way, or when
the start fails."""

from __future__ import annotations

import gc
from pathlib import Path

from kernelmode.cli import main
from kernelmode.embedded import resume_gc


def test_after_the_start_the_collector_runs_again_without_the_starts_objects() -> None:
    gc.disable()
    try:
        resume_gc()
        assert gc.isenabled()
        assert gc.get_freeze_count() > 0  # the start's objects: out of every later collection
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_collector_left_on_is_left_alone() -> None:
    assert gc.isenabled()
    resume_gc()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_start_that_fails_turns_the_collector_back_on(tmp_path: Path) -> None:
    bad = tmp_path / "kernelmode.yaml"
    bad.write_text("sessions:\n  pool_sise: 1\n")
    assert main(["mcp", "--config", str(bad)]) == 2
    assert gc.isenabled()
