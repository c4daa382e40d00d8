"""What API fuzzing (tests/security/test_fuzz_api.py) found, pinned by unit tests: workspace
names the file system refuses, limits no kernel starts under, rlimits above the host's hard one."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError as PydanticValidationError

from kernelmode.artifacts.workspace import NAME_MAX, clean_path
from kernelmode.errors import InvalidRequest
from kernelmode.models import Limits, LimitsPatch

LAUNCHER = Path(__file__).resolve().parents[2] / "kernelmode" / "sandbox" / "launcher.py"


@pytest.mark.parametrize("path", ["a" * NAME_MAX, "d/" + "é" * (NAME_MAX // 2), "/mnt/data/x.txt"])
def test_workspace_paths_within_name_max(path: str) -> None:
    clean_path(path)


@pytest.mark.parametrize("path", ["a" * (NAME_MAX + 1), "d/" + "é" * (NAME_MAX // 2 + 1) + "/f",
                                  "bad-\ud800-surrogate"])
def test_workspace_paths_the_file_system_refuses_are_422(path: str) -> None:
    with pytest.raises(InvalidRequest):  # (was an OSError: a 500)
        clean_path(path)


@pytest.mark.parametrize(("field", "low"), [("pids", 32), ("open_files", 128)])
def test_limits_no_kernel_starts_under_are_refused(field: str, low: int) -> None:
    # A kernel runs ~10 threads and needs ~70 file descriptors to start: below, it died at start
    # after the whole start timeout, and the request got a 503.
    assert getattr(LimitsPatch(**{field: low}), field) == low
    for model in (Limits, LimitsPatch):
        with pytest.raises(PydanticValidationError):
            model(**{field: low - 1})


def test_rlimit_above_the_hard_limit_starts_the_kernel() -> None:
    """The launcher, with a hard RLIMIT_NOFILE lower than asked: the kernel still starts, capped
    at the hard limit when it may not raise it (no CAP_SYS_RESOURCE), else at the value asked."""
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    probe = ("import resource, sys; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    lower = f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({hard}, {hard}))"
    spec = json.dumps({"rlimits": {"nofile": 65_536}})
    code = (f"{lower}; import runpy, sys; sys.argv = ['launcher.py', {spec!r}, '--', "
            f"sys.executable, '-c', {probe!r}]; runpy.run_path({str(LAUNCHER)!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) in (hard, 65_536)
