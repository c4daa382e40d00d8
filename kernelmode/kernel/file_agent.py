"""kernelmode's file agent: runs INSIDE every kernel and serves its workspace over a comm.

Standard library only, and nothing from the rest of kernelmode (sent with the preamble, see
sessions/boot.py). The manager never touches a kernel's disk: uploads, listings, downloads,
deletes and harvests are requests on the comm target TARGET, answered on the same comm, with
file bytes as the Jupyter message's binary buffers (never JSON/base64):

- ``comm_open {"op": "list", "rebase"}`` -> one reply, the listing as a JSON buffer;
- ``comm_open {"op": "read", "path", "max_bytes"}`` -> ``{"size"}`` + the first chunk, then one
  chunk per ``comm_msg {"op": "next"}`` (pulled: the manager's pace), the last with ``sha256``;
- ``comm_open {"op": "write", "path", "overwrite", "size", "quota"}`` -> ``{"ok"}``, then
  ``comm_msg {"seq"}`` + a chunk -> ``{"seq"}``, then ``comm_msg {"op": "commit", "sha256"}``
  -> ``{"path", "entry"}`` (temp file + rename; a comm closed before the commit leaves nothing);
- ``comm_open {"op": "delete", "path"}`` and ``{"op": "changes"}`` -> one reply each.

Paths travel as hex of their file system bytes (names need not be UTF-8); a listing's JSON
buffer is ASCII with such names as surrogate escapes. Errors answer ``{"error": {"code",
"message"}}``. After each successful cell the files changed since the last look ride in the
cell's own ``execute_reply``: its metadata's NOTE_KEY holds the same ASCII JSON as a
``changes`` answer (the kernel's ``finish_metadata`` is wrapped), so a harvest costs no round
trip when nothing changed, and a run costs no message more than a bare kernel's. A note over
MAX_NOTE_BYTES goes instead as a comm_msg on CHANGES_COMM with the JSON as its buffer (before
the cell's idle status). The kernel is untrusted: the manager checks all of this.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

# Copies of kernelmode.protocol's names (FILES_TARGET...): tests/unit/test_protocol.py.
TARGET = "kernelmode.files"
CHANGES_COMM = "kernelmode-files-changes"  # comm_id of a post-run change note too large for the reply
NOTE_KEY = "kernelmode_changes"  # the execute_reply metadata field of the post-run change note
# A note stays in the reply up to this size (a few hundred bytes in practice): far under any
# message cap of the gateway or the manager, so the reply itself is never cut for its note.
MAX_NOTE_BYTES = 256 << 10
CHUNK = 1 << 20
MAX_LISTING_BYTES = 4 << 20  # a listing's JSON stops growing here (paths can be long)
CHECKPOINT_DIR = ".kernelmode-checkpoint"
UPLOAD_PREFIX = ".upload-"

_state: dict[str, Any] = {"root": ".", "max_entries": 10_000, "max_depth": 64, "max_changes": 100,
                          "baseline": None}
_lock = threading.Lock()  # the baseline, shared by the hook and comm handlers (subshell threads)


class Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- safe traversal (no link followed, from the root down) --------------------------------------
def _open_dir(parts: list[bytes], create: bool) -> int:
    fd = os.open(_state["root"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts:
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o700, dir_fd=fd)
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _split(path_hex: Any) -> list[bytes]:
    try:
        raw = bytes.fromhex(str(path_hex))
    except ValueError:
        raise Refused("invalid_request", "the path is not hex") from None
    parts = raw.split(b"/")
    if not raw or any(p in (b"", b".", b"..") for p in parts) or b"\x00" in raw:
        raise Refused("invalid_request", "the path is not a clean relative path")
    return parts


def _shown(parts: list[bytes]) -> str:
    return b"/".join(parts).decode("utf-8", "backslashreplace")


def _entry(rel: str, st: os.stat_result) -> list[Any]:
    return [rel, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def scan() -> dict[str, Any]:
    """Regular singly-linked files by path (surrogate-escaped), bounded like Workspace.scan was."""
    files: dict[str, list[Any]] = {}
    out: dict[str, Any] = {"files": files, "stopped": None, "full": False, "started_ns": time.time_ns()}
    max_entries, max_depth = _state["max_entries"], _state["max_depth"]
    try:
        root = os.open(_state["root"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return out
    stack: list[tuple[int, Iterator[os.DirEntry[str]], str]] = []
    deep = False
    seen = size = 0

    def enter(fd: int, prefix: str) -> None:
        try:
            stack.append((fd, os.scandir(fd), prefix))
        except OSError:
            os.close(fd)

    enter(root, "")
    try:
        while stack:
            fd, it, prefix = stack[-1]
            try:
                entry = next(it, None)
            except OSError:
                entry = None
            if entry is None:
                stack.pop()
                it.close()  # type: ignore[attr-defined]
                os.close(fd)
                continue
            seen += 1
            if seen > max_entries or size > MAX_LISTING_BYTES:
                out["full"] = True
                out["stopped"] = (f"stopped after {seen - 1} entries: the rest of the workspace was "
                                  "not looked at")
                break
            name = entry.name
            if name.startswith(UPLOAD_PREFIX) or (name == CHECKPOINT_DIR and not prefix):
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if len(stack) > max_depth:
                    deep = True
                    continue
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError:
                    continue
                enter(sub, f"{prefix}{name}/")
            elif stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                rel = f"{prefix}{name}"
                files[rel] = _entry(rel, st)
                size += len(rel) + 80
    finally:
        for fd, it, _ in stack:
            it.close()  # type: ignore[attr-defined]
            os.close(fd)
    if deep:
        note = f"folders deeper than {max_depth} levels were not looked into"
        out["stopped"] = f"{out['stopped']}; {note}" if out["stopped"] else note
    return out


def _changes() -> dict[str, Any]:
    """Files new or changed since the last look, which becomes this one."""
    after = scan()
    with _lock:
        before = _state["baseline"] or {"files": {}, "stopped": None, "started_ns": 0}
        _state["baseline"] = after
    since = before["started_ns"] if before.get("stopped") else None
    old = before["files"]
    changed = []
    for rel, e in after["files"].items():  # once per run over the whole workspace: kept lean
        b = old.get(rel)
        if b is None:
            if since is None or e[4] >= since:
                changed.append(e)
        elif b[1] != e[1] or b[2] != e[2] or b[3] != e[3]:  # size, mtime, inode
            changed.append(e)
    changed.sort()  # by path (the first field; paths are unique)
    cap = _state["max_changes"]
    return {"files": changed[:cap], "truncated": len(changed) > cap, "stopped": after["stopped"]}


def _note(rel: str, st: os.stat_result | None) -> None:
    """An upload or delete is not a change a run made: the baseline takes it at once."""
    with _lock:
        base = _state["baseline"]
        if base is None:
            return
        if st is None:
            base["files"].pop(rel, None)
        else:
            base["files"][rel] = _entry(rel, st)


def _json_buffer(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("ascii")  # ensure_ascii: surrogates escaped


# -- one transfer per comm ----------------------------------------------------------------------
class _Reader:
    def __init__(self, comm: Any, data: dict[str, Any]) -> None:
        self.comm = comm
        parts = _split(data.get("path"))
        try:
            dfd = _open_dir(parts[:-1], create=False)
        except OSError:
            raise Refused("file_not_found", f"no file {_shown(parts)}") from None
        try:
            self.fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except OSError:
            raise Refused("file_not_found", f"no file {_shown(parts)}") from None
        finally:
            os.close(dfd)
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            self.close()
            raise Refused("file_not_found", f"no regular file {_shown(parts)}")
        self.size = st.st_size
        self.limit = int(data.get("max_bytes") or 0)
        if self.limit and self.size > self.limit:
            self.close()
            raise Refused("payload_too_large", f"{_shown(parts)} is {self.size} bytes, over {self.limit}")
        self.chunk = min(max(int(data.get("chunk") or CHUNK), 4096), 4 * CHUNK)
        self.hash = hashlib.sha256()
        self.sent = 0

    def next(self, first: bool = False) -> None:
        # At most the size announced at the start: a file growing meanwhile is cut there (a
        # download's Content-Length is that size; the manager checks it too).
        want = max(0, min(self.chunk, self.size - self.sent))
        data = os.read(self.fd, want) if self.fd >= 0 and want else b""
        self.hash.update(data)
        self.sent += len(data)
        eof = len(data) < want or self.sent >= self.size
        reply: dict[str, Any] = {"eof": eof, "offset": self.sent - len(data)}
        if first:
            reply["size"] = self.size
        if eof:
            reply["sha256"] = self.hash.hexdigest()
            self.close()
        self.comm.send(reply, buffers=[data])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Writer:
    def __init__(self, comm: Any, data: dict[str, Any]) -> None:
        self.comm = comm
        self.parts = _split(data.get("path"))
        self.rel = os.fsdecode(b"/".join(self.parts))
        quota = data.get("quota")
        if isinstance(quota, dict):
            listing = scan()
            used = sum(e[1] for e in listing["files"].values())
            count = _state["max_entries"] if listing["full"] else len(listing["files"])
            if used + int(data.get("size") or 0) > int(quota.get("bytes") or 0):
                raise Refused("workspace_full", f"the workspace would exceed its {quota.get('mb')} MB "
                              f"({used} bytes used); delete files or ask for a larger disk_mb")
            if count >= int(quota.get("files") or 0):
                raise Refused("workspace_full", f"the workspace holds its maximum of {count} files")
        try:
            self.dfd = _open_dir(self.parts[:-1], create=True)
        except OSError:
            raise Refused("file_exists", f"a parent of {_shown(self.parts)} is not a directory") from None
        self.tmp = f"{UPLOAD_PREFIX}{os.urandom(8).hex()}"
        self.fd = -1
        try:
            try:
                existing = os.stat(self.parts[-1], dir_fd=self.dfd, follow_symlinks=False)
            except FileNotFoundError:
                existing = None
            if existing is not None:
                if not data.get("overwrite"):
                    raise Refused("file_exists", f"/mnt/data/{_shown(self.parts)} exists "
                                  "(add ?overwrite=true to replace it)")
                if stat.S_ISDIR(existing.st_mode):
                    raise Refused("file_exists", f"/mnt/data/{_shown(self.parts)} is a directory")
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                              dir_fd=self.dfd)
        except OSError as e:  # the folder was removed, or the name made a folder, meanwhile
            self.close()
            raise self._changed(e) from None
        except BaseException:
            self.close()
            raise
        self.hash = hashlib.sha256()
        self.failed: Refused | None = None

    def write(self, seq: Any, chunk: bytes) -> None:
        if self.failed is None:
            try:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(self.fd, view):]
                self.hash.update(chunk)
            except OSError as e:
                self.failed = (Refused("workspace_full", f"the workspace is full: /mnt/data/{_shown(self.parts)} "
                                       "does not fit") if e.errno in (errno.ENOSPC, errno.EDQUOT)
                               else self._changed(e))
                self.close()
        if self.failed is not None:
            raise self.failed
        self.comm.send({"seq": seq})

    def commit(self, sha256: Any) -> None:
        if self.failed is not None:
            raise self.failed
        if self.hash.hexdigest() != sha256:
            self.close()
            raise Refused("checksum_mismatch", "the bytes received do not match the upload's sha256")
        os.close(self.fd)
        self.fd = -1
        try:
            os.rename(self.tmp, self.parts[-1], src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
            st = os.stat(self.parts[-1], dir_fd=self.dfd, follow_symlinks=False)
        except OSError as e:
            self.close()
            raise self._changed(e) from None
        self.tmp = ""
        self.close()
        _note(self.rel, st)
        self.comm.send({"path": f"/mnt/data/{_shown(self.parts)}", "entry": _entry(self.rel, st)[1:]})

    def _changed(self, e: OSError) -> Refused:
        return Refused("workspace_changed", f"/mnt/data/{_shown(self.parts)} changed while it was "
                       f"uploaded ({errno.errorcode.get(e.errno or 0, 'error')}); try again")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.tmp and self.dfd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dfd)
            self.tmp = ""
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1


def _delete(data: dict[str, Any]) -> dict[str, Any]:
    parts = _split(data.get("path"))
    try:
        dfd = _open_dir(parts[:-1], create=False)
    except OSError:
        raise Refused("file_not_found", f"no file /mnt/data/{_shown(parts)}") from None
    try:
        st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            raise Refused("invalid_request", f"/mnt/data/{_shown(parts)} is a directory")
        os.unlink(parts[-1], dir_fd=dfd)
    except FileNotFoundError:
        raise Refused("file_not_found", f"no file /mnt/data/{_shown(parts)}") from None
    finally:
        os.close(dfd)
    _note(os.fsdecode(b"/".join(parts)), None)
    return {"path": f"/mnt/data/{_shown(parts)}"}


def _send_error(comm: Any, e: BaseException) -> None:
    # An OSError here is kernel code changing the tree under the request: "try again".
    code = e.code if isinstance(e, Refused) else "workspace_changed" if isinstance(e, OSError) else "io_error"
    text = f"the workspace changed during the request ({e}); try again" if isinstance(e, OSError) else str(e)
    comm.send({"error": {"code": code, "message": text[:2000]}})


def _on_open(comm: Any, msg: dict[str, Any]) -> None:
    data = (msg.get("content") or {}).get("data") or {}
    op = data.get("op")
    try:
        if op == "list":
            listing = scan()
            if data.get("rebase"):
                with _lock:
                    _state["baseline"] = listing
            body = dict(listing, files=list(listing["files"].values()))
            comm.send({"count": len(body["files"])}, buffers=[_json_buffer(body)])
        elif op == "changes":
            comm.send({"ok": True}, buffers=[_json_buffer(_changes())])
        elif op == "delete":
            comm.send(_delete(data))
        elif op == "read":
            reader = _Reader(comm, data)
            comm.on_msg(lambda m: _guarded(comm, reader.next))
            comm.on_close(lambda m: reader.close())
            reader.next(first=True)
        elif op == "write":
            writer = _Writer(comm, data)

            def on_msg(m: dict[str, Any]) -> None:
                d = (m.get("content") or {}).get("data") or {}
                bufs = m.get("buffers") or []
                if d.get("op") == "commit":
                    _guarded(comm, lambda: writer.commit(d.get("sha256")))
                else:
                    _guarded(comm, lambda: writer.write(d.get("seq"), bytes(bufs[0]) if bufs else b""))

            comm.on_msg(on_msg)
            comm.on_close(lambda m: writer.close())
            comm.send({"ok": True})
        else:
            raise Refused("invalid_request", f"unknown file operation {str(op)[:40]!r}")
    except BaseException as e:  # noqa: BLE001 - every request gets an answer, never silence
        _send_error(comm, e)


def _guarded(comm: Any, step: Any) -> None:
    try:
        step()
    except BaseException as e:  # noqa: BLE001
        _send_error(comm, e)


def _add_note(parent: dict[str, Any], metadata: dict[str, Any], reply: dict[str, Any]) -> None:
    """After a successful, non-silent cell (when IPython's post_run_cell would run): the files it
    changed, in its execute_reply's metadata (or, when large, a comm_msg sent before the reply)."""
    try:
        content = parent.get("content") or {}
        if reply.get("status") != "ok" or content.get("silent") or \
                (parent.get("header") or {}).get("msg_type") != "execute_request":
            return
        body = _json_buffer(_changes())
        if len(body) <= MAX_NOTE_BYTES:
            metadata[NOTE_KEY] = body.decode("ascii")
            return
        kernel = _state["kernel"]
        kernel.session.send(kernel.iopub_socket, "comm_msg", {"comm_id": CHANGES_COMM, "data": {}},
                            parent=parent, ident=b"comm-" + CHANGES_COMM.encode(), buffers=[body])
    except Exception:  # noqa: BLE001, S110 - the manager then asks itself ("changes")
        pass


def _wrap_finish_metadata(kernel: Any) -> None:
    """Make the kernel's finish_metadata (ipykernel's hook that completes an execute_reply's
    metadata, called in the thread that ran the cell, subshells included) add the change note."""
    inner = kernel.finish_metadata
    inner = getattr(inner, "__wrapped__", inner)  # a second install (tests) wraps the original once

    def finish_metadata(parent: dict[str, Any], metadata: dict[str, Any], reply_content: dict[str, Any]) -> Any:
        metadata = inner(parent, metadata, reply_content)
        if isinstance(metadata, dict):
            _add_note(parent, metadata, reply_content)
        return metadata

    finish_metadata.__wrapped__ = inner  # type: ignore[attr-defined]
    kernel.finish_metadata = finish_metadata


def configure(config: dict[str, Any]) -> None:
    """Set the workspace root and bounds; the first look is the baseline of the change notes."""
    root = str(config.get("root") or ".")
    _state.update(root=root if os.path.isdir(root) else os.getcwd(),
                  max_entries=int(config.get("max_entries") or 10_000),
                  max_depth=int(config.get("max_depth") or 64),
                  max_changes=int(config.get("max_changes") or 100))
    with _lock:
        _state["baseline"] = scan()


def install(shell: Any, config: dict[str, Any]) -> None:
    """Register the comm target and the post-run change note in the running kernel."""
    _state["kernel"] = shell.kernel
    configure(config)
    shell.kernel.comm_manager.register_target(TARGET, _on_open)
    if hasattr(shell.kernel, "finish_metadata"):  # every ipykernel; else the manager asks ("changes")
        _wrap_finish_metadata(shell.kernel)


def on_open(comm: Any, msg: dict[str, Any]) -> None:
    """The comm target's handler (public for tests that drive the agent in-process)."""
    _on_open(comm, msg)
