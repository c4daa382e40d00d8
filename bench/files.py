"""100 MB upload and download through the kernel's channels vs a local file copy of the same bytes.

Uploads (PUT /v1/sessions/{id}/files/{path}, streamed from the client) and downloads (GET,
streamed to the client) travel manager -> gateway websocket -> kernel file agent as 2 MiB
binary buffers of comm messages, each checked and acknowledged (artifacts/channel.py). The
floor: ``shutil.copyfile`` of the same 100 MB on this host's disk. Also reported: the manager's
peak resident memory (VmHWM) before and after, which must not grow by the file's size.

    python bench/files.py [--rounds N] [--sandbox bwrap|docker] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from harness import BENCH, Stats, loadavg, require_kernel_venv, write_section
from servers import KmServer

MB = 1_000_000
SIZE = 100 * MB
BLOCK = hashlib.sha256(b"bench").digest() * (MB // 32)


def peak_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1000
    return 0.0


def _body() -> Iterator[bytes]:
    for _ in range(SIZE // MB):
        yield BLOCK


def write_source(path: Path) -> None:
    """The 100 MB a local copy copies (the same bytes the uploads send)."""
    with path.open("wb") as f:
        for block in _body():
            f.write(block)


def round_trip(api: httpx.Client, sid: str) -> tuple[float, float]:
    """Upload 100 MB into session ``sid`` (streamed), then download it: (upload ms, download ms)."""
    t0 = time.perf_counter()
    r = api.put(f"/v1/sessions/{sid}/files/big.bin", content=_body(), params={"overwrite": "true"},
                headers={"Content-Length": str(SIZE)})
    assert r.status_code == 201, r.text
    up = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    got = 0
    with api.stream("GET", f"/v1/sessions/{sid}/files/big.bin") as resp:
        for chunk in resp.iter_bytes(1 << 20):
            got += len(chunk)
    assert got == SIZE, f"downloaded {got} of {SIZE} bytes"
    return up, (time.perf_counter() - t0) * 1000


def copy_ms(src: Path, dst: Path) -> float:
    """One local ``shutil.copyfile`` of ``src`` (the floor), ms."""
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    ms = (time.perf_counter() - t0) * 1000
    dst.unlink()
    return ms


def mbs(s: Stats) -> float:
    """The median's throughput, MB/s."""
    return SIZE / MB / (s.median / 1000)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sandbox", choices=("bwrap", "docker"), default="bwrap")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    require_kernel_venv(p)
    up, down, copy = Stats("upload"), Stats("download"), Stats("copy")
    km = KmServer("files", {}, backend=args.sandbox)
    load_start = loadavg()
    km.start()
    try:
        assert km.srv is not None
        with km.srv.client(timeout=600) as api, tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "src.bin", Path(tmp) / "dst.bin"
            write_source(src)
            sid = api.post("/v1/sessions", json={}).json()["session_id"]
            peak_before = peak_mb(km.manager_pid)
            for i in range(args.rounds):
                u, d = round_trip(api, sid)
                up.samples.append(u)
                down.samples.append(d)
                copy.samples.append(copy_ms(src, dst))
                print(f"round {i + 1}: upload {up.samples[-1]:.0f} ms, download {down.samples[-1]:.0f} ms, "
                      f"copy {copy.samples[-1]:.0f} ms", flush=True)
            peak_after = peak_mb(km.manager_pid)
            api.delete(f"/v1/sessions/{sid}")
    finally:
        asyncio.run(km.stop())

    rows = [("upload (REST PUT -> kernel channel)", up), ("download (kernel channel -> REST GET)", down),
            ("local file copy (shutil.copyfile)", copy)]
    table = "\n".join(f"| {name} | {s.median:.0f} | {mbs(s):.0f} | {mbs(copy) / mbs(s):.1f}x |" for name, s in rows)
    body = f"""## Files through the kernel's channels (issue 19, `bench/files.py`)

100 MB, {args.rounds} rounds, sandbox {args.sandbox}; medians. The machine is shared and busy
(load average {load_start} at the start, {loadavg()} at the end): read the ratios, measured in the
same run, rather than the absolute figures.

| path | ms | MB/s | slower than a local copy |
|---|---:|---:|---:|
{table}

Manager peak resident memory (VmHWM): {peak_before:.0f} MB before, {peak_after:.0f} MB after
{args.rounds} round trips of 100 MB (grew {peak_after - peak_before:.0f} MB: the file is streamed in
2 MiB chunks, never held).
"""
    print(body)
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", "files", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
