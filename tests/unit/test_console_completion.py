"""`kernelmode console`'s Tab completion against a real kernel that answers late.

jupyter console waits a fixed time for a completion reply and, when it gives up, leaves the late
reply queued: the next Tab then reads that stale reply, finds it is not its own, and shows nothing
(and so on, one behind, until the next execute drains the channel). kernelmode's console wraps
the completer so a late reply is dropped and each Tab gets its own answer.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from kernelmode.console.app import _completions_never_crash


@pytest.fixture(scope="module")
def kc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    km = KernelManager()
    km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    km.start_kernel(cwd=str(tmp_path_factory.mktemp("ws")))
    client = km.blocking_client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        yield client
    finally:
        client.stop_channels()
        with contextlib.suppress(Exception):
            km.shutdown_kernel(now=True)


def completer(client: Any, timeout: float) -> SimpleNamespace:
    """The two attributes of jupyter console's ZMQCompleter that complete_request uses."""
    c = SimpleNamespace(client=client, timeout=timeout)
    _completions_never_crash(c)
    return c


def test_a_late_reply_is_not_the_next_tabs_answer(kc: Any) -> None:
    kc.execute_interactive("a_long_variable_name = 1", timeout=60)
    # The kernel is busy for 2 s: a Tab that waits 0.2 s gives up, and its reply comes later.
    kc.execute("import time; time.sleep(2)")
    first = completer(kc, 0.2).complete_request("a_long_v", 8)
    assert first["status"] == "ok"
    # The next Tab reads past the execute's reply and the first Tab's late reply to its own.
    second = completer(kc, 60).complete_request("a_long_var", 10)
    assert "a_long_variable_name" in second["matches"], second
    # And a Tab on an idle kernel is answered as usual.
    third = completer(kc, 60).complete_request("a_long", 6)
    assert "a_long_variable_name" in third["matches"], third


def test_no_answer_in_time_is_no_completion(kc: Any) -> None:
    kc.execute("import time; time.sleep(1)")
    r = completer(kc, 0.1).complete_request("a_lo", 4)
    assert r["matches"] == [] and r["cursor_start"] == r["cursor_end"] == 4
