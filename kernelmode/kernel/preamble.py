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

import importlib
import inspect
import json
import os
import sys
import threading
import types
import uuid
from typing import Any, Literal

# Copies of kernelmode.protocol's names (this file runs where kernelmode is not installed);
# tests/unit/test_protocol.py holds them equal.
MARKER = "\x00kernelmode-tool-call\x00"
PING = "__kernelmode_ping__"  # answered by the manager itself: proves the stdin path works
SEARCH = "__kernelmode_search__"  # answered by the manager: tools.search(), over this session's tools
PIP = "__kernelmode_pip__"  # answered by the manager itself: installs packages into this session
PACKAGES_ENV = "KM_PACKAGES_DIR"  # where the session's package layer is mounted
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
    req = schema.get("required")
    required = {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()
    props = schema.get("properties")
    params = []
    for pname, pschema in (props if isinstance(props, dict) else {}).items():
        pschema = pschema if isinstance(pschema, dict) else {}  # JSON Schema allows `true` here
        default = inspect.Parameter.empty if pname in required else pschema.get("default")
        try:
            annotation = _annotation(pschema, schema)
        except Exception:  # a schema no type fits: shown untyped, never a broken preamble
            annotation = Any
        try:
            params.append(inspect.Parameter(pname, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                            annotation=annotation))
        except ValueError:  # not a Python name ("from", "x-y"): passed as tools.t(**{"from": ...})
            continue
    params.sort(key=lambda p: p.default is not inspect.Parameter.empty)
    return inspect.Signature(params)


_JSON_TYPES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool,
                               "null": type(None), "array": list, "object": dict}


def _annotation(schema: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """A Python type for a JSON Schema (best effort: what help() and ``?`` show a model)."""
    if depth > 6 or not isinstance(schema, dict):
        return Any
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        node: Any = root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        return _annotation(node, root, depth + 1)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str | int | bool) for v in enum):
        return Literal[tuple(enum)]
    options = schema.get("anyOf") or schema.get("oneOf")
    kind = schema.get("type")
    if isinstance(options, list) or isinstance(kind, list):
        subs = options if isinstance(options, list) else [{**schema, "type": k} for k in kind or []]
        parts = [_annotation(o, root, depth + 1) for o in subs]
        if Any in parts or not parts:
            return Any
        union = parts[0]
        for p in parts[1:]:
            union = union | p
        return union
    if kind == "array" and isinstance(schema.get("items"), dict):
        return list[_annotation(schema["items"], root, depth + 1)]  # type: ignore[misc]
    return _JSON_TYPES.get(kind, Any) if isinstance(kind, str) else Any


def _doc(spec: dict[str, Any], sig: inspect.Signature) -> str | None:
    """The tool's description, then one line per parameter (type, default, its description)."""
    text = (spec.get("description") or "").strip()
    props = (spec.get("parameters") or {}).get("properties")
    props = props if isinstance(props, dict) else {}
    lines = []
    for p in sig.parameters.values():
        kind = "" if p.annotation is inspect.Parameter.empty else inspect.formatannotation(p.annotation)
        default = "required" if p.default is inspect.Parameter.empty else f"default {p.default!r}"
        pschema = props.get(p.name)
        about = " ".join(str(pschema.get("description") or "").split()) if isinstance(pschema, dict) else ""
        lines.append(f"    {p.name} ({kind}, {default})" + (f": {about}" if about else ""))
    if lines:
        text += ("\n\n" if text else "") + "Parameters:\n" + "\n".join(lines)
    return text or None


def make_tool(bridge: _Bridge, spec: dict[str, Any]) -> Any:
    """A real function per tool, so that help(tools.add) and inspect.signature work."""
    name: str = spec["name"]
    sig = _signature(spec)
    order = list(sig.parameters)  # positional arguments go where the signature shows them

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
    tool.__module__ = "tools." + name.rsplit(".", 1)[0] if "." in name else "tools"
    tool.__doc__ = _doc(spec, sig)
    tool.__signature__ = sig  # type: ignore[attr-defined]
    tool.spec = spec  # type: ignore[attr-defined]
    return tool


class _Group(types.ModuleType):
    """Tools by attribute (``tools.add``), by key (``tools["add"]``), listable with dir().

    A module (``tools``, ``tools.github``), so that ``from tools.github import list_commits``
    works (``register_modules``) and ``help(tools.github)`` lists its functions."""

    def __init__(self, label: str, members: dict[str, Any]) -> None:
        super().__init__("tools" + (f".{label}" if label else ""))
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
                  "needed a person's approval was refused). Find tools for a need with "
                  "tools.search('what to do'); import them with `from tools.NAME import TOOL`."]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self._help_text()


class Tools(_Group):
    """The ``tools`` object of a kernel."""

    def search(self, query: str, limit: int = 8) -> Matches:
        """The tools of this session that best fit an intent ("list a repository's commits"),
        best first: each a dict with name, description, signature and score."""
        __tracebackhide__ = True
        if not isinstance(query, str) or not query.strip():
            raise TypeError("tools.search(query): query must be a non-empty string")
        try:
            found = self.__dict__["_bridge"].call(SEARCH, {"query": query, "limit": limit})
        except ToolError as e:  # say what the code called, not the reserved name
            raise ToolError(str(e).replace(SEARCH, "tools.search", 1)) from None
        return Matches(found or [])

    search_tools = search  # still there when a tool or MCP server is itself named "search"


class Matches(list[dict[str, Any]]):
    """The answer of tools.search(): a list of dicts that displays as the calls to make."""

    def __repr__(self) -> str:
        if not self:
            return "No tool of this session matches; try other words, or tools.help()."
        lines = []
        for m in self:
            prefix = m["name"].rpartition(".")[0]
            lines.append(f"tools.{prefix + '.' if prefix else ''}{m.get('signature') or m['name']}")
            if m.get("description"):
                lines.append(f"    {m['description']}")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


def register_modules(tools: Tools) -> None:
    """Put ``tools`` and each group in sys.modules: ``from tools.github import list_commits``."""
    for name in [n for n in sys.modules if n == "tools" or n.startswith("tools.")]:
        # Ours from an earlier install too (a reconnect runs the preamble again: another _Group class).
        if type(sys.modules[name]).__name__ in ("_Group", "Tools"):
            del sys.modules[name]
    stack: list[_Group] = [tools]
    while stack:
        group = stack.pop()
        sys.modules[group.__name__] = group
        funcs = [k for k, v in group._members.items() if not isinstance(v, _Group)]
        group.__dict__["__all__"] = sorted(funcs)
        subs = [v for v in group._members.values() if isinstance(v, _Group)]
        if group is not tools:
            group.__doc__ = (f"Host tools of {group._label!r} ({len(funcs)}): call them like functions; "
                             "they run outside the sandbox. A failing tool raises ToolError.")
        stack.extend(subs)
    tools.__doc__ = tools._help_text()


def build(specs: list[dict[str, Any]], raw_input: Any) -> Tools:
    bridge = _Bridge(raw_input)
    root: dict[str, Any] = {}
    for spec in specs:
        parts = spec["name"].split(".")
        node = root
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, _Group(".".join(parts[: i + 1]), {}))
            if not isinstance(child, _Group):
                break
            node = child._members
        else:
            node[parts[-1]] = make_tool(bridge, spec)
    tools = Tools("", root)
    tools.__dict__["_bridge"] = bridge
    if "search" in root:  # a tool or server named "search" keeps its name; tools.search_tools searches
        tools.__dict__["search"] = root["search"]
    return tools


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
    # ipykernel sleeps 0.5 ms before each execute_reply, so that a frontend that stops reading at
    # the reply has the cell's last output by then. kernelmode's runs, jupyter console and
    # JupyterLab all read a cell until its idle status, which IOPub sends after every output:
    # here the pause is only dead time on every run (bench/RESULTS.md, issue 18).
    if hasattr(kernel, "_execute_sleep"):
        kernel._execute_sleep = 0
    for stream in (sys.stdout, sys.stderr):
        lean_flush(stream)
    global _bridge
    _bridge = _Bridge(original)
    namespace["tools"] = build(json.loads(specs_json), original)
    register_modules(namespace["tools"])
    namespace["ToolError"] = ToolError
    namespace["ToolDenied"] = ToolDenied
    # exit()/quit() would stop the kernel's loop: the session's kernel is not the code's to end.
    # It still tells a console to leave (the ask_exit payload), keeping the kernel.
    shell.ask_exit = lambda: _ask_exit_keeping_kernel(shell)
    # IPython builds its display formatters on first use; do it now, not in the user's first run.
    shell.display_formatter.format(0)
    _install_pip(shell)


_OUTSTREAM_STATE = ("_flush_buffers", "_flush_pending", "_subprocess_flush_pending", "_buffers", "_buffer_lock", "echo")


def lean_flush(stream: Any) -> None:
    """Make an ipykernel OutStream's flush() return at once when it has nothing to send.

    ipykernel flushes stdout and stderr twice per cell that shows a result (before the
    execute_result, before the execute_reply), and each flush is a round trip to the IOPub
    thread (two events through its pipe, then a wait) even with nothing written: CPU on every
    run (bench/kernel_cpu.py, issue 18). With nothing buffered, no flush pending and no send in
    progress, the round trip only waits for messages already queued to the IOPub thread, which
    sends them in order before anything queued later (IOPub's order, idle last, is unchanged).
    Issue 32: a cell ending while a starved IOPub thread's timed flush held the buffers it took,
    not yet queued, sent its idle status first (a run ends at idle: output lost). So taking them
    (``_flush_buffers``, looked up when a flush runs) marks the stream until ``_flush`` has
    queued their messages, and a flush that sees the mark waits. Other streams: left alone."""
    if not all(hasattr(stream, name) for name in _OUTSTREAM_STATE):
        return
    flush = getattr(stream.flush, "__wrapped__", stream.flush)  # a second install wraps once
    take = getattr(stream._flush_buffers, "__wrapped__", stream._flush_buffers)
    stream._kernelmode_sending = getattr(stream, "_kernelmode_sending", 0)

    def marked_take() -> Any:
        stream._kernelmode_sending += 1  # before the buffers are taken (the first next())
        try:
            yield from take()
        finally:
            stream._kernelmode_sending -= 1

    def lean() -> None:
        if stream._flush_pending or stream._subprocess_flush_pending or stream.echo is not None:
            flush()
            return
        with stream._buffer_lock:
            empty = not stream._buffers
        if not empty or stream._kernelmode_sending:  # read after the buffers, set before they go
            flush()

    marked_take.__wrapped__ = take  # type: ignore[attr-defined]
    lean.__wrapped__ = flush  # type: ignore[attr-defined]
    stream._flush_buffers, stream.flush = marked_take, lean


def _install_pip(shell: Any) -> None:
    """The session's package layer goes AFTER the kernel's own packages on sys.path (it can add,
    never shadow), and `%pip install` / `!pip install` ask the manager instead of the network."""
    layer = os.environ.get(PACKAGES_ENV)
    if layer and layer not in sys.path:
        sys.path.append(layer)
    shell.register_magic_function(pip_magic, "line", "pip")
    system = getattr(shell.system, "__wrapped__", shell.system)

    def system_with_pip(cmd: str) -> Any:
        words = cmd.split()
        for head in (["pip"], ["pip3"], ["python", "-m", "pip"], ["python3", "-m", "pip"]):
            if words[:len(head)] == head:
                return pip_magic(" ".join(words[len(head):]))
        return system(cmd)

    system_with_pip.__wrapped__ = system  # type: ignore[attr-defined]
    shell.system = system_with_pip


def pip_magic(line: str) -> None:
    """%pip install NAME[==VERSION] ...: the manager downloads wheels, the kernel stays offline."""
    __tracebackhide__ = True
    words = [w for w in line.split() if w not in ("-q", "--quiet", "-U", "--upgrade")]
    if not words or words[0] != "install" or len(words) < 2 or any(w.startswith("-") for w in words[1:]):
        raise ToolError("only `pip install NAME[==VERSION] ...` works here: the kernel has no network; "
                        "kernelmode's manager fetches wheels from its index for you")
    assert _bridge is not None
    try:
        result = _bridge.call(PIP, {"packages": words[1:]})
    except ToolError as e:
        raise ToolError(str(e).replace(PIP + ": ", "pip install: ", 1)) from None
    importlib.invalidate_caches()
    done = ", ".join(f"{p['name']}-{p['version']}" for p in result.get("installed", []))
    there = ", ".join(f"{p['name']}-{p['version']}" for p in result.get("already", []))
    if done:
        print(f"Successfully installed {done}")
    if there:
        print(f"Already present: {there}")


def _ask_exit_keeping_kernel(shell: Any) -> None:
    shell.keepkernel_on_exit = True
    type(shell).ask_exit(shell)
