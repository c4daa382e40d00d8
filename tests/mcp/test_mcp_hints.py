"""Errors a model can act on, through the official MCP client and REST: a missing module names
the ways to install it, a network failure says the sandbox is offline by design, and an error
of any other kind is shown exactly as before (kernel/hints.py)."""

from __future__ import annotations

from mcp_types import TextContent

from tests.conftest import Server

from .conftest import Connect

MISSING = "import kmtest_not_installed_anywhere"
# `.invalid` never resolves; the kernel has no interface but lo, so nothing is sent anywhere.
OFFLINE = "import urllib.request\nurllib.request.urlopen('http://kernelmode-test.invalid/', timeout=5)"


def _text(r: object) -> str:
    return "\n".join(b.text for b in r.content if isinstance(b, TextContent))  # type: ignore[attr-defined]


async def test_mcp_errors_say_what_to_do_next(mcp_connect: Connect) -> None:
    async with mcp_connect() as client:
        r = await client.call_tool("run_python", {"code": MISSING})
        assert r.is_error
        text = _text(r)
        assert "ModuleNotFoundError" in text and "%pip install kmtest_not_installed_anywhere" in text, text
        assert "install_packages" in text, text

        r = await client.call_tool("run_python", {"code": OFFLINE})
        assert r.is_error
        assert "no network by design" in _text(r) and "tools.help()" in _text(r), _text(r)

        r = await client.call_tool("run_python", {"code": "raise MemoryError()"})
        assert r.is_error and "MiB (limits.memory_mb)" in _text(r), _text(r)  # names the session's limit

        r = await client.call_tool("run_python", {"code": "raise ValueError('plain')"})
        assert r.is_error and "ValueError: plain" in _text(r) and "kernelmode:" not in _text(r), _text(r)
        # The session is untouched by any of it.
        r = await client.call_tool("run_python", {"code": "x = 6 * 7\nx"})
        assert not r.is_error and r.structured_content["result"] == "42"  # type: ignore[index]


def test_rest_error_values_carry_the_hint(server: Server) -> None:
    with server.client() as api:
        sid = api.post("/v1/sessions", json={}).json()["session_id"]
        try:
            err = api.post(f"/v1/sessions/{sid}/execute", json={"code": MISSING}).json()["error"]
            assert err["ename"] == "ModuleNotFoundError"
            assert err["evalue"].startswith("No module named 'kmtest_not_installed_anywhere'. kernelmode: "
                                            "install it into this session"), err
            err = api.post(f"/v1/sessions/{sid}/execute", json={"code": OFFLINE}).json()["error"]
            # the sandbox's egress bridge answers a session without egress (urllib: HTTPError, a URLError)
            assert err["ename"] in ("URLError", "HTTPError") and "no network by design" in err["evalue"], err
        finally:
            api.delete(f"/v1/sessions/{sid}")
