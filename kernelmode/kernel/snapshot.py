"""kernelmode's snapshot: runs INSIDE a kernel, saves its user namespace to one file and loads it back.

Standard library plus cloudpickle (imported when used; plain pickle when it is missing), and
nothing from the rest of kernelmode: like the preamble, this file's source is sent to kernels.
The manager never unpickles what this module writes; it only moves the file.

Each variable is pickled on its own, so one object that cannot be saved loses only itself (its
reason is recorded). Protocol 5 with out-of-band buffers: numpy arrays, pandas frames and arrow
tables go to the file as their raw memory, without a copy. Modules are saved by name and imported
again; a name bound to an object already saved under another name is saved as an alias.

File layout: MAGIC, then per entry its pickle and its buffers, then a JSON index (names, kinds,
offsets, lengths, CRC-32 of each part), the index length (8 bytes) and END. A file cut short has
no END and is refused whole; a damaged entry fails its checksum and is lost alone.
"""

from __future__ import annotations

import builtins
import importlib
import io
import json
import os
import pickle
import socket
import struct
import sys
import threading
import time
import types
import zlib
from typing import Any

MAGIC = b"KMCKPT01"
END = b"KMCKEND1"
MIME = "application/vnd.kernelmode.snapshot+json"  # = protocol.SNAPSHOT_MIME (tests/unit/test_protocol.py)
# The preamble's names (reinstalled in every kernel before a restore) and IPython's.
SKIP_NAMES = frozenset({"tools", "ToolError", "ToolDenied", "In", "Out", "get_ipython", "exit", "quit"})
_REASON_LEN = 300


class SnapshotError(Exception):
    """The file is not a whole snapshot (truncated, damaged, or not one at all)."""


def _pickler() -> Any:
    try:
        import cloudpickle
        return cloudpickle
    except ImportError:  # pragma: no cover - the kernel image has it
        return pickle


def _why_not(value: Any) -> str | None:
    """A reason a model understands for objects that cannot outlive their process."""
    if isinstance(value, io.IOBase):
        return "open file (reopen it after the restore)"
    if isinstance(value, socket.socket):
        return "socket (connections do not survive a kernel)"
    if isinstance(value, (types.GeneratorType, types.AsyncGeneratorType, types.CoroutineType)):
        return "generator or coroutine (its running state cannot be saved)"
    if isinstance(value, threading.Thread):
        return "thread (threads do not survive a kernel)"
    return None


def _with_globals(value: Any, globals_: dict[str, Any]) -> Any:
    """A notebook function (``__main__``) as a copy bound to ``globals_``; anything else as is."""
    if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
        f = types.FunctionType(value.__code__, globals_, value.__name__, value.__defaults__, value.__closure__)
        f.__kwdefaults__ = value.__kwdefaults__
        f.__qualname__ = value.__qualname__
        f.__dict__.update(value.__dict__)
        f.__annotations__ = value.__annotations__
        f.__doc__ = value.__doc__
        return f
    return value


def _detached(value: Any) -> Any:
    """A top-level function of the notebook without its globals: cloudpickle would otherwise
    copy every global it names (a 100 MB frame with each helper); they are saved on their own
    and the function is bound to the namespace again when it is loaded."""
    return _with_globals(value, {"__builtins__": builtins, "__name__": "__main__"})


def _rebound(value: Any, ns: dict[str, Any]) -> Any:
    return _with_globals(value, ns)


def _tool_name(value: Any) -> str | None:
    """The name of a host tool function of the preamble (``from tools.x import f``): saved by
    name and taken from the new kernel's ``tools``; its bridge to the manager is per kernel."""
    if not isinstance(value, types.FunctionType):
        return None
    module, spec = str(getattr(value, "__module__", "")), getattr(value, "spec", None)
    if (module == "tools" or module.startswith("tools.")) and isinstance(spec, dict):
        name = spec.get("name")
        return name if isinstance(name, str) else None
    return None


def _tool(name: str) -> Any:
    obj: Any = sys.modules["tools"]
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def candidates(ns: dict[str, Any], hidden: Any = ()) -> list[str]:
    """The user's names: not IPython's own, not ``tools``, not ``_``-prefixed history."""
    return sorted(n for n in ns if not n.startswith("_") and n not in SKIP_NAMES and n not in hidden)


class _Writer:
    def __init__(self, f: Any) -> None:
        self.f = f
        self.pos = 0

    def write(self, data: Any) -> tuple[int, int, int]:
        """(offset, length, crc32) of what was written."""
        view = memoryview(data).cast("B")
        offset = self.pos
        self.f.write(view)
        self.pos += view.nbytes
        return offset, view.nbytes, zlib.crc32(view)


_last: list[Any] = [None]  # the fingerprint of the namespace at the latest save


def fingerprint(ns: dict[str, Any], hidden: Any = ()) -> list[Any]:
    """What "the namespace changed" means for automatic checkpoints, cheap to compute: each
    name's object identity, type and size (len, or nbytes). An edit in place that keeps all
    three (``df.iloc[0, 0] = 1``) is not seen."""
    out = []
    for name in candidates(ns, hidden):
        value = ns[name]
        try:
            size = int(getattr(value, "nbytes", None) or len(value))
        except Exception:  # noqa: BLE001 - no size: identity and type only
            size = -1
        out.append((name, id(value), type(value).__qualname__, size))
    return out


def save(ns: dict[str, Any], path: str, max_bytes: int, hidden: Any = ()) -> dict[str, Any]:
    """Write the namespace's variables to ``path``; what was saved and skipped (with reasons)."""
    mark = fingerprint(ns, hidden)
    saved: list[str] = []
    skipped: list[dict[str, str]] = []
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.part"
    started = time.perf_counter()
    try:
        total = _write(ns, tmp, max_bytes, hidden, saved, skipped)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.replace(tmp, path)
    _last[0] = mark
    return {"saved": saved, "skipped": skipped, "bytes": total, "seconds": time.perf_counter() - started}


def _write(ns: dict[str, Any], tmp: str, max_bytes: int, hidden: Any, saved: list[str],
           skipped: list[dict[str, str]]) -> int:
    pickler = _pickler()
    index: list[dict[str, Any]] = []
    seen: dict[int, str] = {}
    with open(tmp, "wb") as f:
        w = _Writer(f)
        w.write(MAGIC)
        for name in candidates(ns, hidden):
            value = ns[name]
            if isinstance(value, types.ModuleType):
                index.append({"name": name, "kind": "module", "module": value.__name__})
                saved.append(name)
                continue
            tool = _tool_name(value)
            if tool is not None:
                index.append({"name": name, "kind": "tool", "tool": tool})
                saved.append(name)
                continue
            if id(value) in seen:
                index.append({"name": name, "kind": "alias", "of": seen[id(value)]})
                saved.append(name)
                continue
            reason = _why_not(value)
            buffers: list[pickle.PickleBuffer] = []
            if reason is None:
                try:
                    data = pickler.dumps(_detached(value), protocol=5, buffer_callback=buffers.append)
                    raws = [b.raw() for b in buffers]
                except BaseException as e:  # noqa: BLE001 - any failure loses this variable only
                    if isinstance(e, (KeyboardInterrupt, SystemExit)):
                        raise
                    reason = f"{type(e).__name__}: {e}"[:_REASON_LEN]
            if reason is not None:
                skipped.append({"name": name, "reason": reason})
                continue
            size = len(data) + sum(r.nbytes for r in raws)
            if w.pos + size > max_bytes:
                skipped.append({"name": name, "reason": f"over the checkpoint size cap ({max_bytes} bytes)"})
                continue
            parts = [w.write(data)] + [w.write(r) for r in raws]
            index.append({"name": name, "kind": "pickle", "parts": parts})
            seen[id(value)] = name
            saved.append(name)
        raw_index = json.dumps(index).encode()
        f.write(raw_index)
        f.write(struct.pack(">Q", len(raw_index)))
        f.write(END)
        return w.pos + len(raw_index) + 8 + len(END)


def _read(path: str) -> tuple[bytearray, list[dict[str, Any]]]:
    size = os.path.getsize(path)
    data = bytearray(size)  # writable: arrays loaded from it must be writable too
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(data)
    if got != size or size < len(MAGIC) + 8 + len(END) or data[:len(MAGIC)] != MAGIC:
        raise SnapshotError("not a kernelmode checkpoint (bad header)")
    if data[-len(END):] != END:
        raise SnapshotError("the checkpoint is truncated (no end marker)")
    (n,) = struct.unpack(">Q", data[-len(END) - 8:-len(END)])
    start = size - len(END) - 8 - n
    if n <= 0 or start < len(MAGIC):
        raise SnapshotError("the checkpoint's index is damaged")
    try:
        index = json.loads(bytes(data[start:start + n]))
    except ValueError as e:
        raise SnapshotError("the checkpoint's index is damaged") from e
    if not isinstance(index, list):
        raise SnapshotError("the checkpoint's index is damaged")
    return data, index


def _part(data: bytearray, part: list[int], limit: int) -> memoryview:
    offset, length, crc = part
    if offset < 0 or length < 0 or offset + length > limit:
        raise SnapshotError("points outside the file")
    view = memoryview(data)[offset:offset + length]
    if zlib.crc32(view) != crc:
        raise SnapshotError("checksum mismatch (damaged)")
    return view


def load(ns: dict[str, Any], path: str) -> dict[str, Any]:
    """Load a snapshot into ``ns``; what came back and what was lost (with reasons)."""
    data, index = _read(path)
    limit = len(data) - len(END) - 8
    restored: list[str] = []
    lost: list[dict[str, str]] = []
    values: dict[str, Any] = {}
    for entry in index:
        name = str(entry.get("name", "")) if isinstance(entry, dict) else ""
        if not name:
            continue
        try:
            kind = entry.get("kind")
            if kind == "module":
                values[name] = importlib.import_module(str(entry["module"]))
            elif kind == "tool":
                values[name] = _tool(str(entry["tool"]))
            elif kind == "alias":
                if entry["of"] not in values:
                    raise SnapshotError(f"alias of {entry['of']!r}, which was lost")
                values[name] = values[entry["of"]]
            elif kind == "pickle":
                views = [_part(data, p, limit) for p in entry["parts"]]
                values[name] = _rebound(pickle.loads(views[0], buffers=views[1:]), ns)
            else:
                raise SnapshotError(f"unknown entry kind {kind!r}")
            restored.append(name)
        except BaseException as e:  # noqa: BLE001 - a bad entry loses only itself
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            lost.append({"name": name, "reason": f"{type(e).__name__}: {e}"[:_REASON_LEN]})
    # Names the kernel still has are kept: a kernel that outlived its websocket is newer than
    # its checkpoint (a fresh kernel has none of them).
    ns.update({name: value for name, value in values.items() if name not in ns})
    return {"restored": restored, "lost": lost}


def _publish(answer: dict[str, Any]) -> None:
    from IPython.display import publish_display_data
    publish_display_data({MIME: answer})


def main(ip: Any, request_json: str) -> None:
    """Entry point the manager calls (silently) with the shell and ``{"op": "save"|"load",
    "path", "max_bytes"}``. The answer goes back as one display message of type MIME, never
    as text in stdout."""
    request = json.loads(request_json)
    answer: dict[str, Any]
    try:
        if request["op"] == "save" and request.get("if_changed") and fingerprint(ip.user_ns, ip.user_ns_hidden) == _last[0]:
            answer = {"unchanged": True}
        elif request["op"] == "save":
            answer = save(ip.user_ns, request["path"], int(request["max_bytes"]), ip.user_ns_hidden)
        else:
            try:
                answer = load(ip.user_ns, request["path"])
            finally:
                if request.get("remove", True):
                    try:
                        os.unlink(request["path"])
                    except OSError:
                        pass
    except (SnapshotError, OSError) as e:
        answer = {"error": f"{type(e).__name__}: {e}"[:_REASON_LEN]}
    _publish(answer)
