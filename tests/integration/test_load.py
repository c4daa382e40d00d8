"""Many sessions at once (bench/load.py scaled down): every reply reaches the session that asked,
none is lost or duplicated; and the manager's memory stays bounded while kernels flood output.

No wall-clock thresholds: only correctness, and a generous bound on the manager's RSS growth."""

from __future__ import annotations

import ast
import asyncio
import secrets
import threading

import httpx

from kernelmode.client import AsyncClient, AsyncSession
from tests.conftest import Server
from tests.support.procfs import hwm_kb, reset_hwm, rss_kb

SESSIONS, RUNS = 8, 25
CAP = 1024 * 1024  # the default max_output_bytes per stream, which the session fixture's server uses
LINE = "x" * 1023  # + "\n": 1 KiB a line


def _client(server: Server) -> AsyncClient:
    # One keep-alive connection per concurrent caller (httpx keeps only 20 alive by default).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return AsyncClient(server.url, server.token, timeout=120, retries=0,
                       transport=httpx.AsyncHTTPTransport(limits=limits))


async def _create(km: AsyncClient, n: int) -> list[AsyncSession]:
    got = await asyncio.gather(*(km.create_session() for _ in range(n)), return_exceptions=True)
    sessions = [s for s in got if isinstance(s, AsyncSession)]
    if len(sessions) != n:
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
        raise AssertionError(f"creating {n} sessions failed: {[g for g in got if isinstance(g, BaseException)]}")
    return sessions


async def test_concurrent_sessions_each_get_their_own_replies(server: Server) -> None:
    async with _client(server) as km:
        sessions = await _create(km, SESSIONS)
        try:
            tokens = [secrets.token_hex(8) for _ in sessions]
            for s, token in zip(sessions, tokens, strict=True):
                r = await s.run(f"_load_token = {token!r}\n_load_n = 0")
                assert r.status == "ok", r

            async def drive(k: int) -> list[tuple[str, object]]:
                s, token, seen = sessions[k], tokens[k], []
                count = None
                for i in range(RUNS):
                    nonce = secrets.token_hex(6)
                    r = await s.run(f"_load_n += 1\nprint({nonce!r})\n_load_token + '|{k}|{i}|{nonce}|' + str(_load_n)")
                    # Its own session, this very request, the session's state, each run exactly once.
                    assert r.status == "ok", r
                    assert r.session_id == s.id
                    assert ast.literal_eval(r.result or "") == f"{token}|{k}|{i}|{nonce}|{i + 1}", (k, i, r.result)
                    assert r.stdout == nonce + "\n", (k, i, r.stdout)
                    if count is not None:
                        assert r.execution_count == count + 1
                    count = r.execution_count
                    seen.append((r.run_id, r.result))
                return seen

            replies = [x for xs in await asyncio.gather(*(drive(k) for k in range(SESSIONS))) for x in xs]
            assert len(replies) == SESSIONS * RUNS
            assert len({run_id for run_id, _ in replies}) == SESSIONS * RUNS  # no run answered twice
            assert len({value for _, value in replies}) == SESSIONS * RUNS
            for s in sessions:  # each kernel ran each of its cells exactly once
                assert (await s.run("_load_n")).result == str(RUNS)
        finally:
            await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)


def _hwm_kb(pid: int) -> int:
    return hwm_kb(pid) or 0


async def test_output_floods_keep_the_manager_memory_bounded(server: Server) -> None:
    """4 sessions each print 32x the cap in lines while a fifth prints 8x the cap in one `print`,
    twice over (~290 MiB in all): the manager's RSS grows by far less than that.

    The loops flush every 256 lines, so that each stream message stays at 256 KiB: ipykernel
    otherwise sends whatever was printed in 0.2 s as one message, which the manager decodes whole
    before the cap applies — a transient cost that grows with the machine's print speed, not with
    the volume (bench/load.py measures it)."""
    pid = server.proc.pid  # the manager (start_server runs it directly)
    loops, lines, single = 4, 32 * 1024, 8 * CAP
    async with _client(server) as km:
        sessions = await _create(km, loops + 1)
        try:
            for s in sessions:
                assert (await s.run("1+1")).result == "2"
            await asyncio.sleep(1)  # the pool refill after the takes
            baseline = min(rss_kb(pid) for _ in range(3))
            samples: list[int] = []
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    samples.append(rss_kb(pid))
                    stop.wait(0.05)

            hwm_reset = reset_hwm(pid)  # so that no spike between two samples is missed
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                for rnd in range(2):
                    code = (f"import sys\n_line = {LINE!r}\nfor _k in range({lines}):\n    print(_line)\n"
                            f"    if _k % 16 == 0:\n        print(_line, file=sys.stderr)\n"
                            f"    if _k % 256 == 255:\n        sys.stdout.flush()\n'loop-{rnd}'")
                    got = await asyncio.gather(
                        *(s.run(code, timeout_seconds=300) for s in sessions[:loops]),
                        sessions[loops].run(f"print('y' * {single})\n'huge-{rnd}'", timeout_seconds=300))
                    for r in got:
                        assert r.status == "ok", r.error
                        assert r.result in (f"'loop-{rnd}'", f"'huge-{rnd}'")
                        assert r.truncated
                        assert CAP - 2048 <= len(r.stdout.encode()) <= CAP
                        assert len(r.stderr.encode()) <= CAP
                        assert not r.stdout.strip("xy\n")
            finally:
                stop.set()
                sampler.join()
            peak = max([*samples, _hwm_kb(pid) if hwm_reset else 0])
            growth_mb = (peak - baseline) / 1024
            printed_mb = 2 * (loops * (lines + lines // 16) * 1024 + single) / 2**20
            print(f"manager RSS: baseline {baseline / 1024:.0f} MB, peak {peak / 1024:.0f} MB "
                  f"(+{growth_mb:.0f} MB) while {printed_mb:.0f} MiB were printed")
            assert growth_mb < 200, f"the manager grew {growth_mb:.0f} MB while {printed_mb:.0f} MiB were printed"
            for s in sessions:  # all still answer
                assert (await s.run("1+1")).result == "2"
        finally:
            await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)


async def test_one_huge_print_never_reaches_the_manager_whole(server: Server) -> None:
    """A single 64 MiB `print` is one stream message: the gateway cuts it to the output cap before
    sending it on, so the manager's peak memory grows by far less than the message."""
    pid = server.proc.pid
    if not reset_hwm(pid):
        import pytest

        pytest.skip("cannot reset VmHWM here (/proc/PID/clear_refs needs root)")
    async with _client(server) as km:
        session = (await _create(km, 1))[0]
        try:
            assert (await session.run("1+1")).result == "2"
            reset_hwm(pid)
            before = _hwm_kb(pid)
            r = await session.run("print('z' * (64 * 2**20))\n'done'", timeout_seconds=300)
            growth_mb = (_hwm_kb(pid) - before) / 1024
            assert r.status == "ok" and r.result == "'done'" and r.truncated
            assert CAP - 2048 <= len(r.stdout.encode()) <= CAP
            assert growth_mb < 32, f"the manager's peak grew {growth_mb:.0f} MB for a 64 MiB print"
        finally:
            await session.close()
