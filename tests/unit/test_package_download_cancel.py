"""A pip download whose install is cancelled (an MCP client cancels the call, the server stops)
ends its pip process: none is left running on the host against the index."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from kernelmode.packages.fetch import FetchOptions, download
from tests.unit.test_packages import TARGET


def _pip_children(marker: str) -> list[int]:
    """Our child processes whose command line names ``marker`` (the download's folder)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and marker in cmdline:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


async def test_a_cancelled_download_ends_its_pip(tmp_path: Path) -> None:
    # An index on loopback that accepts connections (the backlog) and never answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    dest = tmp_path / "wheels-cancel-test"
    dest.mkdir()
    (tmp_path / "c.txt").write_text("")
    options = FetchOptions(f"http://127.0.0.1:{silent.getsockname()[1]}/simple", (), 10 << 20, 600)
    task = asyncio.create_task(download(dest, ["kmtest-app==1.0"], TARGET, tmp_path / "c.txt", options))
    try:
        pids: list[int] = []
        while not pids:  # pip has started
            assert not task.done(), task
            await asyncio.sleep(0.05)
            pids = _pip_children(str(dest))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert _pip_children(str(dest)) == []
        assert not any(_alive(pid) for pid in pids)  # killed and reaped
    finally:
        for pid in _pip_children(str(dest)):
            os.kill(pid, 9)
        silent.close()
