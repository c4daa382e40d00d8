"""kernelmode's preamble: runs INSIDE every kernel and defines ``tools`` there.

Standard library only, and nothing from the rest of kernelmode: this file's source is sent to
kernels whose environment does not have kernelmode installed. The manager runs it (silently) in
every new and every restarted kernel, then calls :func:`install` with the tool specs as JSON.

A call ``tools.NAME(**kwargs)`` travels over the kernel's own Jupyter stdin channel: an
``input_request`` whose prompt is MARKER + a JSON request, answered by the manager with an
``input_reply`` holding a JSON reply. No network is involved, and the manager knows the calling
session from the channel the request arrived on, never from anything in the request.
"""

from __future__ import annotations

import inspect
import json
import threading
import uuid
from typing import Any

MARKER = "\x00kernelmode-tool-call\x00"
PING = "__kernelmode_ping__"  # answered by the manager itself: proves the stdin path works
NO_INPUT_MESSAGE = (
    "no interactive input: kernelmode runs code unattended, so input() and getpass() are not "
    "available. Put the values in the code, or upload a file to /mnt/data and read it."
)


class ToolError(Exception):
    """A host tool failed, does not exist, or is not allowed in this session."""


class ToolDenied(ToolError):
    """A tool call that required a person's approval was denied (or got no answer in time)."""


class UnknownToolError(ToolError, AttributeError):
    """No such tool in this session (also an AttributeError, so hasattr() works)."""


class NoInteractiveInput(EOFError):
    """input()/getpass() called in a kernel that nobody types into."""


def _no_input(prompt: str = "", *args: Any, **kwargs: Any) -> str:
    raise NoInteractiveInput(NO_INPUT_MESSAGE)


class _Bridge:
    """Sends one request at a time over the stdin channel (replies are not matched by the
    protocol, so concurrent calls from threads are serialised here)."""

    def __init__(self, raw_input: Any) -> None:
        self._raw_input = raw_input
        self._lock = threading.Lock()

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        __tracebackhide__ = True  # IPython: show the user's line, not the bridge's
        call_id = uuid.uuid4().hex
        try:
            request = json.dumps({"id": call_id, "tool": name, "arguments": arguments})
        except (TypeError, ValueError) as e:
            raise TypeError(f"tools.{name}: arguments must be JSON data (dict, list, str, numbers, "
                            f"bool, None): {e}") from None
        except RecursionError:
            raise ToolError(f"{name}: the arguments are nested too deeply") from None
        with self._lock:
            raw = self._raw_input(MARKER + request)
        try:
            reply = json.loads(raw)
        except ValueError:
            raise ToolError(f"{name}: the manager sent an unreadable reply") from None
        if not isinstance(reply, dict):
            raise ToolError(f"{name}: the manager sent an unreadable reply")
        # id None: the manager refused a request it could not read (too large) for this call.
        if reply.get("id") != call_id and not (reply.get("id") is None and reply.get("ok") is False):
            raise ToolError(f"{name}: the manager's reply does not match this call")
        if reply.get("ok"):
            return reply.get("result")
        if reply.get("denied"):
            raise ToolDenied(f"{name}: {reply.get('error', 'denied')}")
        raise ToolError(f"{name}: {reply.get('error', 'failed')}")


def _signature(spec: dict[str, Any]) -> inspect.Signature:
    schema = spec.get("parameters") or {}
    required = set(schema.get("required") or [])
    params = []
    for pname, pschema in (schema.get("properties") or {}).items():
        if not pname.isidentifier():
            continue
        default = inspect.Parameter.empty if pname in required else (pschema or {}).get("default")
        params.append(inspect.Parameter(pname, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
    params.sort(key=lambda p: p.default is not inspect.Parameter.empty)
    return inspect.Signature(params)


def make_tool(bridge: _Bridge, spec: dict[str, Any]) -> Any:
    """A real function per tool, so that help(tools.add) and inspect.signature work."""
    name: str = spec["name"]
    order = list(((spec.get("parameters") or {}).get("properties") or {}).keys())

    def tool(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if len(args) > len(order):
            raise TypeError(f"tools.{name}() takes {len(order)} positional arguments "
                            f"but {len(args)} were given")
        for pname, value in zip(order, args, strict=False):
            if pname in kwargs:
                raise TypeError(f"tools.{name}() got multiple values for argument {pname!r}")
            kwargs[pname] = value
        return bridge.call(name, kwargs)

    tool.__name__ = name.rsplit(".", 1)[-1]
    tool.__qualname__ = f"tools.{name}"
    tool.__module__ = "kernelmode_tools"
    tool.__doc__ = (spec.get("description") or "").strip() or None
    tool.__signature__ = _signature(spec)  # type: ignore[attr-defined]
    tool.spec = spec  # type: ignore[attr-defined]
    return tool


class _Group:
    """Tools by attribute (``tools.add``), by key (``tools["add"]``), listable with dir()."""

    def __init__(self, label: str, members: dict[str, Any]) -> None:
        self.__dict__["_label"] = label
        self.__dict__["_members"] = members

    def __getattr__(self, name: str) -> Any:
        members = self.__dict__.get("_members", {})
        if name in members:
            return members[name]
        if name.startswith("__") or name.startswith("_repr_") or name.startswith("_ipython"):
            raise AttributeError(name)  # Python and IPython probing for protocols
        raise UnknownToolError(f"unknown tool {self._qualified(name)!r}: {self._known()}")

    def __getitem__(self, name: str) -> Any:
        node: Any = self
        for part in name.split("."):
            if not isinstance(node, _Group) or part not in node._members:
                raise UnknownToolError(f"unknown tool {self._qualified(name)!r}: {self._known()}")
            node = node._members[part]
        return node

    def __dir__(self) -> list[str]:
        return sorted(self._members)

    def __iter__(self) -> Any:
        return iter(sorted(self._members))

    def __contains__(self, name: object) -> bool:
        try:
            self[str(name)]
        except UnknownToolError:
            return False
        return True

    def _qualified(self, name: str) -> str:
        return f"{self._label}.{name}" if self._label else name

    def _known(self) -> str:
        return "call tools.help() to list the tools" if self._members else "no tools are available"

    def _all_tools(self) -> list[Any]:
        out: list[Any] = []
        for member in self._members.values():
            out.extend(member._all_tools() if isinstance(member, _Group) else [member])
        return sorted(out, key=lambda t: t.spec["name"])

    def help(self) -> None:
        """Print every tool with its signature and description."""
        print(self._help_text())

    def _help_text(self) -> str:
        tools = self._all_tools()
        if not tools:
            return "No host tools are available in this session."
        lines = ["Host tools (they run outside the sandbox; call them like functions):", ""]
        for t in tools:
            name = t.spec["name"]
            prefix = name.rsplit(".", 1)[0] + "." if "." in name else ""
            lines.append(f"  tools.{prefix}{t.spec.get('signature') or name.rsplit('.', 1)[-1]}"
                         + ("  [asks a person first]" if t.spec.get("requires_approval") else ""))
            desc = (t.spec.get("description") or "").strip()
            if desc:
                lines.extend("      " + line for line in desc.splitlines())
        lines += ["", "A failing or unknown tool raises ToolError (ToolDenied when a call that "
                  "needed a person's approval was refused)."]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self._help_text()


class Tools(_Group):
    """The ``tools`` object of a kernel."""


def build(specs: list[dict[str, Any]], raw_input: Any) -> Tools:
    bridge = _Bridge(raw_input)
    root: dict[str, Any] = {}
    for spec in specs:
        parts = spec["name"].split(".")
        node = root
        for part in parts[:-1]:
            child = node.setdefault(part, _Group(part, {}))
            if not isinstance(child, _Group):
                break
            node = child._members
        else:
            node[parts[-1]] = make_tool(bridge, spec)
    return Tools("", root)


_bridge: _Bridge | None = None


def ping() -> None:
    """One round trip over stdin (the manager runs this right after install)."""
    assert _bridge is not None
    if _bridge.call(PING, {}) != "pong":
        raise ToolError("the manager did not answer the stdin ping")


def install(specs_json: str, namespace: dict[str, Any]) -> None:
    """Define ``tools`` and ``ToolError`` in ``namespace``; make input()/getpass() fail fast."""
    shell = namespace["get_ipython"]()
    kernel = shell.kernel
    # The kernel's own raw_input (bound method of its class) stays reachable for the bridge;
    # user code's input() goes through kernel.raw_input, which now refuses at once.
    original = type(kernel).raw_input.__get__(kernel)
    kernel.raw_input = _no_input
    kernel.getpass = _no_input
    global _bridge
    _bridge = _Bridge(original)
    namespace["tools"] = build(json.loads(specs_json), original)
    namespace["ToolError"] = ToolError
    namespace["ToolDenied"] = ToolDenied
    # exit()/quit() would stop the kernel's loop: the session's kernel is not the code's to end.
    # It still tells a console to leave (the ask_exit payload), keeping the kernel.
    shell.ask_exit = lambda: _ask_exit_keeping_kernel(shell)
    # IPython builds its display formatters on first use; do it now, not in the user's first run.
    shell.display_formatter.format(0)


def _ask_exit_keeping_kernel(shell: Any) -> None:
    shell.keepkernel_on_exit = True
    type(shell).ask_exit(shell)


def boot_code(specs: list[dict[str, Any]]) -> str:
    """The code the manager runs in a kernel: this module, loaded as its own module (so that
    its helpers do not litter the user's namespace), then install(). Data goes in as string
    literals made by repr(), never pasted into code."""
    with open(__file__, encoding="utf-8") as f:
        source = f.read()
    return (
        "def __kernelmode_boot(source, specs):\n"
        "    import sys, types\n"
        "    mod = types.ModuleType('kernelmode_preamble')\n"
        "    exec(compile(source, '<kernelmode preamble>', 'exec'), mod.__dict__)\n"
        "    sys.modules['kernelmode_preamble'] = mod\n"
        "    mod.install(specs, get_ipython().user_ns)\n"
        "    mod.ping()\n"
        f"__kernelmode_boot({source!r}, {json.dumps(specs)!r})\n"
        "del __kernelmode_boot\n"
    )
