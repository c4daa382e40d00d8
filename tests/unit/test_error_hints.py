"""kernel/hints.py: which errors get a hint, and that the hint lands in the message."""

from __future__ import annotations

import errno
import io
import socket
import urllib.error

from kernelmode.kernel import hints


def test_a_missing_module_names_the_ways_to_install_it() -> None:
    e = ModuleNotFoundError("No module named 'sklearn'", name="sklearn")
    assert hints.with_hint(e, {"installs": True})
    assert str(e).startswith("No module named 'sklearn'. kernelmode: install it")
    assert "%pip install sklearn" in str(e) and "install_packages" in str(e)
    off = ModuleNotFoundError("No module named 'x'", name="x")
    hints.with_hint(off, {"installs": False})
    assert "does not install packages" in str(off)


def test_network_failures_are_found_through_the_wrappers() -> None:
    gai = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    assert hints.is_network_failure(gai)
    assert hints.is_network_failure(urllib.error.URLError(gai))
    assert hints.is_network_failure(OSError(errno.ENETUNREACH, "Network is unreachable"))

    class Wrapper(Exception):  # as requests/httpx wrap the socket error
        pass

    try:
        try:
            raise gai
        except OSError as inner:
            raise Wrapper("HTTPSConnectionPool(host='x.invalid'): Max retries") from inner
    except Wrapper as outer:
        assert hints.is_network_failure(outer)
        assert hints.with_hint(outer, {})
        assert "no network by design" in str(outer)
    assert not hints.is_network_failure(FileNotFoundError(errno.ENOENT, "No such file"))
    assert not hints.is_network_failure(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))


def test_an_oserror_keeps_its_errno_and_gets_the_hint_in_its_text() -> None:
    e = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    hints.with_hint(e, {})
    assert e.errno == socket.EAI_AGAIN
    assert str(e).startswith("[Errno -3] Temporary failure in name resolution. kernelmode: this sandbox")


def test_memory_error_names_the_limit_and_other_errors_are_untouched() -> None:
    m = MemoryError()
    hints.with_hint(m, {"memory_mb": 512})
    assert "512 MiB" in str(m) and "limits.memory_mb" in str(m)
    v = ValueError("plain")
    assert not hints.with_hint(v, {"installs": True, "memory_mb": 512})
    assert str(v) == "plain"


def test_an_egress_refusal_says_it_is_the_policy() -> None:
    refused = urllib.error.HTTPError("http://x.test/", 403, "kernelmode: x.test is not in this session's "
                                     "egress allow-list", {}, io.BytesIO(b""))  # type: ignore[arg-type]
    assert hints.with_hint(refused, {}) and str(refused).startswith("HTTP Error 403: kernelmode: x.test is not")
    assert "retrying will not help" in str(refused) and "tools.help()" in str(refused)
    tunnel = OSError("Tunnel connection failed: 403 kernelmode: x.test is not in this session's egress allow-list")
    assert hints.with_hint(tunnel, {}) and "egress policy, so retrying will not help" in str(tunnel)
    # An upstream's own 403 is the upstream's business.
    assert not hints.with_hint(urllib.error.HTTPError("http://x.test/", 403, "Forbidden", {}, io.BytesIO(b"")), {})  # type: ignore[arg-type]
