"""kernel.extra_requirements in `kernelmode setup`: installed on top of the kernel's list, with
that list as constraints (real pip, a real venv, the loopback test index: no network)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from kernelmode.errors import SetupFailed
from kernelmode.setup_env import _fingerprint, _run, extra_install_argv
from tests.support.package_index import local_index


def test_the_extras_change_the_fingerprint(tmp_path: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("ipykernel==7.4.0\n")
    plain = _fingerprint(req, "/usr/bin/python3")
    assert _fingerprint(req, "/usr/bin/python3", []) == plain  # an empty list rebuilds nothing
    assert _fingerprint(req, "/usr/bin/python3", ["tabulate"]) != plain
    assert extra_install_argv(Path("/k/bin/python"), req, ["tabulate", "rich==13.7.1"], True) == [
        "/k/bin/python", "-m", "pip", "install", "--disable-pip-version-check", "-q", "--constraint", str(req),
        "--", "tabulate", "rich==13.7.1"]


def test_extras_install_within_the_kernels_constraints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv.create(tmp_path / "kv", with_pip=True)
    python = tmp_path / "kv" / "bin" / "python"
    (tmp_path / "links").mkdir()
    with local_index(tmp_path / "idx") as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
        monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
        pinned = tmp_path / "requirements.txt"
        pinned.write_text("kmtest-lib==0.5\n")  # the kernel's list pins another version
        with pytest.raises(SetupFailed):
            _run(extra_install_argv(python, pinned, ["kmtest-app"], True), 300, "pip install", True)
        pinned.write_text("kmtest-lib==1.0\n")
        _run(extra_install_argv(python, pinned, ["kmtest-app"], True), 300, "pip install", True)
    out = subprocess.run([str(python), "-c", "import kmtest_app; print(kmtest_app.answer())"],
                         capture_output=True, text=True, check=True, env={"PATH": os.path.dirname(sys.executable)})
    assert out.stdout.strip() == "42"
