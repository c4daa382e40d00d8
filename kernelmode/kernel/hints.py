"""Hints on errors a model can act on: runs INSIDE every kernel (standard library only).

Three failures look like something else to a model that reads only the error: a missing module
(it does not know packages can be installed), a network failure (by design, yet it reads as a
transient DNS problem) and a ``MemoryError`` (it does not know the session has a limit it may
raise). An IPython custom exception handler appends one sentence saying what to do next to such
an error's message, so every front door shows it alike (REST ``error.evalue``, MCP text, a
console's traceback); every other exception is shown exactly as IPython would.

Loaded once per kernel process by the preamble's boot code, with its config as JSON:
``{"installs": bool, "memory_mb": int | null}``.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from typing import Any

NETWORK_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EADDRNOTAVAIL}
NETWORK_HINT = (
    "kernelmode: this sandbox has no network by design (no DNS, no route), so retrying will not "
    "help. Fetch data through a host tool (tools.help() lists them), or upload it as a file to "
    "/mnt/data and read it from there."
)
# With egress (the proxy's socket is in the sandbox), HTTP(S) clients that honour HTTP_PROXY get
# out to the allowed hosts; only code that skips the proxy meets the missing network.
EGRESS_SOCKET = "/run/kernelmode/egress/proxy.sock"
EGRESS_NETWORK_HINT = (
    "kernelmode: this sandbox has no network of its own (no DNS, no route): HTTP and HTTPS go "
    "through the session's egress proxy (the HTTP_PROXY/HTTPS_PROXY variables, which requests, "
    "httpx, urllib and pip honour) to the hosts its egress policy allows."
)
# Added to a refusal by the egress proxy or the sandbox's bridge (an HTTP 403 whose status line
# says why, starting "kernelmode: "): that it is a policy, not an outage.
EGRESS_REFUSAL_HINT = (
    "kernelmode: this is the session's egress policy, so retrying will not help. Fetch data "
    "through a host tool (tools.help() lists them), upload it as a file to /mnt/data, or ask "
    "the operator to allow the host."
)


def module_hint(name: str | None, installs: bool) -> str:
    if not installs:
        return ("kernelmode: this server does not install packages; use what the kernel has "
                "(help('modules') lists it) or ask the operator to add the package.")
    pkg = (name or "PACKAGE").split(".")[0]
    return (f"kernelmode: install it into this session with `%pip install {pkg}` in a cell, the MCP "
            f"tool install_packages, or REST POST /v1/sessions/{{id}}/packages (the name on PyPI "
            f"may differ from the module's: e.g. sklearn is scikit-learn).")


def memory_hint(memory_mb: int | None) -> str:
    """= kernelmode.protocol.memory_hint, which the manager uses (tests/unit/test_protocol.py)."""
    limit = f"its limit of {memory_mb} MiB" if memory_mb else "its memory limit"
    return (f"kernelmode: the session reached {limit} (limits.memory_mb): create the session with a "
            "larger limits.memory_mb (up to the server's ceiling), or work on the data in chunks.")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and those in its chain (causes, contexts, a few args and ``reason``s: how
    requests, urllib3, urllib and httpx wrap one another), at most 32, each once."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo and len(seen) < 32:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        # a few args only: an exception's args are whatever the code raised (a huge tuple, too)
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None), *tuple(getattr(e, "args", ()))[:8]]


def network_failure(exc: BaseException) -> OSError | None:
    """The socket error of a name that could not be resolved or a network that cannot be reached,
    anywhere in the exception's chain; or None."""
    for e in _chain(exc):
        if isinstance(e, socket.gaierror) or (isinstance(e, OSError) and e.errno in NETWORK_ERRNOS):
            return e
    return None


def is_network_failure(exc: BaseException) -> bool:
    return network_failure(exc) is not None


def egress_refusal(exc: BaseException) -> bool:
    """Whether the exception (or one in its chain) is a refusal answered by the egress proxy or
    the bridge: urllib's HTTPError, http.client's tunnel error (requests' ProxyError wraps it)."""
    for e in _chain(exc):
        text = str(e)[:2000]
        if "kernelmode: " in text and "403" in text:  # a 503 (proxy down) is worth a retry
            return True
    return False


def _add(exc: BaseException, hint: str) -> None:
    if hint in str(exc):
        return
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}. {hint}",)
    elif hasattr(exc, "add_note"):  # Python 3.11+; the message is an object: the traceback shows the note
        exc.add_note(hint)


def with_hint(exc: BaseException, config: dict[str, Any]) -> bool:
    """Add the hint that fits ``exc`` to its message; False when none fits."""
    if isinstance(exc, ModuleNotFoundError):
        exc.msg = f"{exc.msg}. {module_hint(exc.name, bool(config.get('installs', True)))}"
        return True
    if isinstance(exc, MemoryError):
        exc.args = (" ".join(str(a) for a in (*exc.args, memory_hint(config.get("memory_mb")))),)
        return True
    cause = network_failure(exc)
    if cause is None:
        if not egress_refusal(exc):
            return False
        msg = getattr(exc, "msg", None)
        if isinstance(msg, str) and isinstance(getattr(exc, "code", None), int):  # urllib's HTTPError
            if EGRESS_REFUSAL_HINT not in msg:  # its text is its code and msg, not its args
                exc.msg = f"{msg}. {EGRESS_REFUSAL_HINT}"  # type: ignore[attr-defined]
        else:
            _add(exc, EGRESS_REFUSAL_HINT)
        return True
    hint = EGRESS_NETWORK_HINT if os.path.exists(EGRESS_SOCKET) else NETWORK_HINT
    if cause.strerror:  # wrappers that print their cause (urllib's URLError) show it too
        cause.strerror = f"{cause.strerror}. {hint}"
    _add(exc, hint)
    return True


def install(shell: Any, config: dict[str, Any]) -> None:
    """Register the handler for every ``Exception`` (anything else IPython shows as usual)."""

    def handler(self: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None) -> None:
        try:
            with_hint(value, config)
        except Exception:  # noqa: BLE001 - a hint must never hide the user's error
            pass
        self.showtraceback((etype, value, tb), tb_offset=tb_offset, running_compiled_code=True)

    shell.set_custom_exc((Exception,), handler)
