"""The in-kernel snapshot format (kernel/snapshot.py) on its own: what is saved and skipped, and
that a damaged or truncated file is refused or loses only the damaged entry. (Real kernels, with
cloudpickle, are in integration/test_checkpoints.py.)"""

from __future__ import annotations

import io
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from kernelmode.kernel import snapshot


def _namespace(tmp_path: Path) -> dict:
    return {"arr": np.arange(10_000, dtype="float64"), "same": None, "n": 3, "text": "hi",
            "np": np, "_hidden": 1, "tools": object(), "In": [], "fh": open(tmp_path / "f", "w"),  # noqa: SIM115
            "gen": (i for i in range(2)), "th": threading.Thread(), "sock": socket.socket(socket.AF_UNIX),
            "buf": io.StringIO("x")}


def test_save_then_load_round_trip(tmp_path: Path) -> None:
    ns = _namespace(tmp_path)
    ns["same"] = ns["arr"]
    out = snapshot.save(ns, str(tmp_path / "ck" / "a.kmck"), 10**9)
    assert set(out["saved"]) == {"arr", "same", "n", "text", "np"}
    reasons = {s["name"]: s["reason"] for s in out["skipped"]}
    assert set(reasons) == {"fh", "gen", "th", "sock", "buf"}
    assert reasons["sock"].startswith("socket") and reasons["gen"].startswith("generator")
    back: dict = {}
    got = snapshot.load(back, str(tmp_path / "ck" / "a.kmck"))
    assert set(got["restored"]) == set(out["saved"]) and got["lost"] == []
    assert back["same"] is back["arr"] and back["np"] is np and back["arr"].sum() == ns["arr"].sum()
    back["arr"][0] = 5.0  # writable, like the original
    ns["fh"].close()
    ns["sock"].close()


def test_size_cap_skips_what_does_not_fit(tmp_path: Path) -> None:
    out = snapshot.save({"big": np.zeros(100_000), "small": 1}, str(tmp_path / "a.kmck"), 10_000)
    assert out["saved"] == ["small"] and "size cap" in out["skipped"][0]["reason"]


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b"not a checkpoint" * 10, "bad header"),
    (lambda b: b[:-20] + b"\x00" * 4 + b[-16:], "index"),
])
def test_a_damaged_file_is_refused_whole(tmp_path: Path, damage, message: str) -> None:
    path = tmp_path / "a.kmck"
    snapshot.save({"arr": np.arange(1000), "n": 1}, str(path), 10**9)
    path.write_bytes(damage(path.read_bytes()))
    ns: dict = {"keep": 1}
    with pytest.raises(snapshot.SnapshotError, match=message):
        snapshot.load(ns, str(path))
    assert ns == {"keep": 1}  # nothing half-loaded


def test_a_damaged_entry_loses_only_itself(tmp_path: Path) -> None:
    path = tmp_path / "a.kmck"
    snapshot.save({"arr": np.arange(100_000), "n": 1}, str(path), 10**9)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside arr's buffer
    path.write_bytes(bytes(data))
    ns: dict = {}
    out = snapshot.load(ns, str(path))
    assert out["restored"] == ["n"] and out["lost"][0]["name"] == "arr" and "checksum" in out["lost"][0]["reason"]


def test_fingerprint_sees_rebinding_and_size_changes() -> None:
    ns = {"a": [1, 2], "b": np.zeros(3)}
    first = snapshot.fingerprint(ns)
    assert snapshot.fingerprint(ns) == first
    ns["a"].append(3)
    assert snapshot.fingerprint(ns) != first
    second = snapshot.fingerprint(ns)
    ns["c"] = 1
    assert snapshot.fingerprint(ns) != second


def test_the_preambles_names_are_not_saved_and_tools_come_from_the_new_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    def add(a: int, b: int = 0) -> int:
        return a + b

    add.__module__, add.spec = "tools", {"name": "add"}  # type: ignore[attr-defined]
    ns = {"tools": object(), "ToolError": Exception, "ToolDenied": Exception, "plus": add, "n": 1}
    out = snapshot.save(ns, str(tmp_path / "t.kmck"), 10**9)
    assert sorted(out["saved"]) == ["n", "plus"] and out["skipped"] == []
    fresh = types.ModuleType("tools")

    def new_add(a: int, b: int = 0) -> int:
        return a + b

    fresh.add = new_add  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tools", fresh)
    back: dict = {}
    got = snapshot.load(back, str(tmp_path / "t.kmck"))
    assert sorted(got["restored"]) == ["n", "plus"] and back["plus"] is new_add
    # A tool the new kernel does not offer is lost with its reason; the rest comes back
    snapshot.save(ns, str(tmp_path / "u.kmck"), 10**9)
    monkeypatch.setitem(sys.modules, "tools", types.ModuleType("tools"))
    got = snapshot.load({}, str(tmp_path / "u.kmck"))
    assert got["restored"] == ["n"] and got["lost"][0]["name"] == "plus"
