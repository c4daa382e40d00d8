"""Host tools made from Python callables: signature, JSON Schema and validation from type hints."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, create_model
from pydantic import ValidationError as PydanticValidationError

from ..errors import ConfigError, ToolFailed
from .base import ToolInfo


def _in_daemon_thread(func: Callable[..., Any], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
    """Run a sync tool in its own daemon thread. On timeout the caller gets its answer at once;
    a tool that never returns cannot hold up shutdown (executor threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, func(**kwargs))
        except BaseException as e:  # handed to the awaiting coroutine
            outcome = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop may be closed by now
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, name=f"tool-{getattr(func, '__name__', 'call')}", daemon=True).start()
    return future


def _format_signature(name: str, sig: inspect.Signature) -> str:
    return f"{name}{str(sig).replace('NoneType', 'None')}"


class PythonTool:
    """A sync or async callable of the manager's process, exposed to kernels."""

    def __init__(self, func: Callable[..., Any], name: str | None = None, description: str | None = None) -> None:
        self.func = func
        name = str(name or getattr(func, "__name__", ""))
        if not name.isidentifier():
            raise ConfigError(f"tool name {name!r} is not a Python identifier")
        try:
            hints = get_type_hints(func)
        except Exception:  # unresolvable annotations: fall back to no types
            hints = {}
        sig = inspect.signature(func)
        fields: dict[str, Any] = {}
        params = []
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.kind is p.POSITIONAL_ONLY:
                raise ConfigError(f"tool {name}: positional-only parameter {p.name!r} is not supported")
            annotation = hints.get(p.name, Any)
            default = ... if p.default is p.empty else p.default
            fields[p.name] = (annotation, default)
            params.append(p.replace(annotation=annotation if p.name in hints else p.empty))
        self._args_model: type[BaseModel] = create_model(
            f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
        )
        shown = sig.replace(parameters=params, return_annotation=hints.get("return", sig.empty))
        schema = self._args_model.model_json_schema()
        schema.pop("title", None)
        self.info = ToolInfo(
            name=name,
            description=(description or inspect.getdoc(func) or "").strip(),
            parameters=schema,
            signature=_format_signature(name, shown),
        )
        self._is_async = inspect.iscoroutinefunction(func)

    async def call(self, arguments: dict[str, Any], timeout: float) -> Any:
        try:
            validated = self._args_model.model_validate(arguments)
        except PydanticValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}"
                for err in e.errors(include_url=False)
            )
            raise ToolFailed(f"invalid arguments: {problems}") from None
        kwargs = {k: getattr(validated, k) for k in type(validated).model_fields}
        try:
            if self._is_async:
                result = await asyncio.wait_for(self.func(**kwargs), timeout)
            else:
                result = await asyncio.wait_for(_in_daemon_thread(self.func, kwargs), timeout)
        except asyncio.TimeoutError:
            raise ToolFailed(f"timed out after {timeout:g} s") from None
        except ToolFailed:
            raise
        except Exception as e:
            raise ToolFailed(f"{type(e).__name__}: {e}") from e
        if isinstance(result, BaseModel):
            return result.model_dump(mode="json")
        return result


def load_callable(ref: str) -> Callable[..., Any]:
    """'package.module:attr.path' -> the object, with a clear ConfigError."""
    module_name, _, attr_path = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"tool function {ref!r}: cannot import {module_name!r}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ConfigError(f"tool function {ref!r}: {module_name} has no {attr_path!r}") from e
    if not callable(obj):
        raise ConfigError(f"tool function {ref!r} is not callable")
    return obj  # type: ignore[no-any-return, unused-ignore]
