"""Resource exhaustion: processes, threads, memory, disk, file descriptors and output floods."""

from __future__ import annotations

import time

import pytest

from .conftest import host_file_in_workspace, run_after_restart

MiB = 1024 * 1024


def test_fork_bomb_stopped_by_pids_limit(session_factory, run, probe):
    sid = session_factory(limits={"pids": 64})
    # The bomb runs in a child so that the kernel itself stays in control and reaps it.
    r = probe(sid, """
        import time
        rd, wr = _os.pipe()
        pid = _os.fork()
        if pid == 0:
            _os.close(rd)
            kids, err = [], None
            for _ in range(2000):
                try:
                    p = _os.fork()
                except OSError as e:
                    err = _err(e)
                    break
                if p == 0:
                    time.sleep(60)
                    _os._exit(0)
                kids.append(p)
            _os.write(wr, _json.dumps({"forked": len(kids), "err": err}).encode())
            for k in kids:
                _os.kill(k, 9)
            for k in kids:
                _os.waitpid(k, 0)
            _os._exit(0)
        _os.close(wr)
        data = _os.read(rd, 4096)
        _os.waitpid(pid, 0)
        print(data.decode())
    """, timeout_seconds=60)
    assert r["err"] == "EAGAIN", r
    assert r["forked"] < 64, r  # and within its 60 s timeout (else probe fails on the status)
    # Threads count against the same cap.
    r = probe(sid, """
        import threading
        ev, threads, err = threading.Event(), [], None
        try:
            for _ in range(1000):
                t = threading.Thread(target=ev.wait)
                t.start()
                threads.append(t)
        except RuntimeError as e:
            err = str(e)
        ev.set()
        for t in threads:
            t.join()
        print(_json.dumps({"threads": len(threads), "err": err}))
    """, timeout_seconds=60)
    assert r["err"] and r["threads"] < 64, r
    res = run(sid, "sum(range(10))")
    assert res["status"] == "ok" and res["result"] == "45" and res["state_lost"] is False


def _assert_oom_or_memoryerror(res: dict, full_ok: bool = False) -> bool:
    """True if the kernel died (OOM-killed), False if Python raised MemoryError (or, with
    ``full_ok``, the size-capped tmpfs was full: Docker's /dev/shm is one of its own)."""
    if res["status"] == "kernel_died":
        assert res["cause"]["kind"] == "oom", res
        assert res["state_lost"] is True
        return True
    full = full_ok and res["error"]["ename"] == "OSError" and "No space left" in res["error"]["evalue"]
    assert res["status"] == "error" and (res["error"]["ename"] == "MemoryError" or full), res
    return False


@pytest.mark.parametrize("where", ["heap", "dev_shm"])
def test_memory_bomb_capped(session_factory, run, api, where):
    sid = session_factory(limits={"memory_mb": 256})
    assert run(sid, "keep = 1")["status"] == "ok"
    if where == "heap":
        code = "chunks = []\nfor _ in range(64):\n    chunks.append(b'x' * (64 << 20))\n"
    else:  # a tmpfs is memory too: it must be charged to the kernel's cap
        code = ("with open('/dev/shm/fill', 'wb') as f:\n"
                "    for _ in range(2048):\n        f.write(b'x' * (1 << 20))\n")
    res = run(sid, code, timeout_seconds=60)
    died = _assert_oom_or_memoryerror(res, full_ok=where == "dev_shm")
    if died:
        after, _ = run_after_restart(api, sid, "print('alive')")
    else:
        after = run(sid, "print('alive')")
    assert after["status"] == "ok" and after["stdout"] == "alive\n", after
    assert after["state_lost"] is died


def test_disk_fill_stopped_by_file_size_limit(server, session_factory, run, probe):
    sid = session_factory(limits={"disk_mb": 5})
    r = probe(sid, """
        out = {}
        for path in ('/mnt/data/big', '/tmp/big'):
            try:
                with open(path, 'wb') as f:
                    for _ in range(20):
                        f.write(b'x' * (1 << 20))
                        f.flush()
                out[path] = "ok"
            except OSError as e:
                out[path] = _err(e)
            out[path + ":size"] = _os.path.getsize(path)
            _os.unlink(path) if path.startswith('/tmp') else None
        print(_json.dumps(out))
    """, timeout_seconds=60)
    assert r["/mnt/data/big"] in ("EFBIG", "ENOSPC"), r  # file size cap, or the full volume
    assert r["/tmp/big"] in ("EFBIG", "ENOSPC"), r
    assert r["/mnt/data/big:size"] <= 5 * MiB and r["/tmp/big:size"] <= 5 * MiB
    host_file = host_file_in_workspace(server, "big")
    assert host_file.stat().st_size <= 5 * MiB
    assert run(sid, "print(2 + 2)")["stdout"] == "4\n"


def test_workspace_total_size_is_capped(server, session_factory, run):
    sid = session_factory(limits={"disk_mb": 5})
    res = run(sid, """
written = 0
try:
    for i in range(4):
        with open(f'/mnt/data/part{i}', 'wb') as f:
            f.write(b'x' * (4 << 20))
        written += 4 << 20
except OSError as e:
    print('refused', e)
print(written)
""", timeout_seconds=60)
    assert res["status"] == "ok", res
    assert "refused [Errno 28] No space left on device" in res["stdout"], res  # a clear error inside
    total = sum(p.stat().st_size for p in host_file_in_workspace(server, "part0").parent.iterdir())
    assert total <= 5 * MiB, f"{total} bytes written to the host with disk_mb=5"


def test_open_files_capped(session_factory, run, probe):
    sid = session_factory(limits={"open_files": 256})
    r = probe(sid, """
        import resource
        fds, err = [], None
        try:
            for _ in range(100_000):
                fds.append(_os.open('/dev/null', _os.O_RDONLY))
        except OSError as e:
            err = _err(e)
        top = max(fds)
        for fd in fds:
            _os.close(fd)
        print(_json.dumps({"opened": len(fds), "err": err, "top": top,
                           "limit": resource.getrlimit(resource.RLIMIT_NOFILE)}))
    """)
    assert r["err"] == "EMFILE", r
    assert r["limit"] == [256, 256]
    assert r["opened"] < 256 and r["top"] < 256, r
    # Raising the limit again is refused.
    res = run(sid, "import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))")
    assert res["status"] == "error" and res["error"]["ename"] == "ValueError", res
    res = run(sid, "print('still here')")
    assert res["status"] == "ok" and res["stdout"] == "still here\n"


def test_output_flood_single_print_truncated(shared_sid, run):
    res = run(shared_sid, "print('x' * 10_000_000)", timeout_seconds=60)
    assert res["status"] == "ok", {k: v for k, v in res.items() if k != "stdout"}  # not its timeout
    assert res["truncated"] is True
    assert 0 < len(res["stdout"].encode()) <= MiB + 64 * 1024


def test_output_flood_endless_loop_truncated_and_stopped(shared_sid, run):
    # Stopped by its own 3 s timeout (its status says so; the client's request timeout bounds a hang).
    res = run(shared_sid, "while True:\n    print('y' * 1000)", timeout_seconds=3)
    assert res["status"] in ("timeout", "interrupted"), {k: v for k, v in res.items() if k != "stdout"}
    assert res["truncated"] is True
    assert len(res["stdout"].encode()) <= MiB + 64 * 1024
    assert len(res["stderr"].encode()) <= MiB + 64 * 1024
    after = run(shared_sid, "print('ok')")
    assert after["status"] == "ok" and after["stdout"] == "ok\n"


def test_raw_output_to_fd1_cannot_fill_the_host_disk(server, session_factory, run, api):
    """Writes straight to fd 1 bypass the output caps and land in the kernel's log on the host:
    bounded there (bubblewrap: RLIMIT_FSIZE = disk_mb; Docker: the relay's and engine's caps)."""
    sid = session_factory(limits={"disk_mb": 16})
    res = run(sid, "import os\nchunk = b'x' * (1 << 20)\nfor _ in range(24):\n"
                   "    try:\n        os.write(1, chunk)\n    except OSError:\n        break\n'done'",
              timeout_seconds=30)
    # ipykernel also forwards fd 1 as stream output (capped): slow, so a timeout is fine here.
    assert res["status"] in ("ok", "error", "timeout"), res
    kernel_id = api.get(f"/v1/sessions/{sid}").json()["kernel_id"]
    log = server.data_dir / "run" / f"{kernel_id}.log"
    time.sleep(1)  # the Docker relay is asynchronous
    assert log.stat().st_size <= 17 * (1 << 20), log.stat().st_size
    after, _ = run_after_restart(api, sid, "1 + 1")
    assert after["result"] == "2"  # and the session goes on
