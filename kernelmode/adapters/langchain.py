"""kernelmode as a LangChain tool (and so a LangGraph one): ``pip install 'kernelmode[langchain]'``.

::

    from langchain.agents import create_agent          # LangGraph's agent loop
    from kernelmode import Client
    from kernelmode.adapters.langchain import as_langchain_tool

    km = Client("http://127.0.0.1:8888", token="...")
    python = as_langchain_tool(km)                     # one tool: run_python(code: str)
    agent = create_agent(model, [python])
    agent.invoke({"messages": [("user", "What is the total of sales.csv?")]})
    python.close()                                     # delete the tool's session

The tool runs every call in one session, created on the first call and reused, so variables,
imports and files persist across the agent's steps. It answers with the text the MCP server
gives a model (``kernelmode.mcp.render.run_text``): status, stdout, stderr, the last
expression's value, a traceback, saved files. An exception in the code is such an answer (status
ERROR), not a Python exception; a failure of the service itself (unreachable server, too many
sessions) is a ``ToolException``, which the tool hands to the model as text by default
(``handle_tool_error=True``; set it to False to have it raised).

Sync (``invoke``) and async (``ainvoke``) both work: made from a ``Client`` or ``Session``, the
async path runs the sync client in a worker thread; made from an ``AsyncClient`` or
``AsyncSession``, it is natively async, and then only the async path (``ainvoke``, ``aclose``)
is available.

Host tools: the functions of your application that kernel code should reach (``tools.NAME(...)``
in the kernel) are registered on the server (``kernelmode.yaml`` ``tools:`` / ``mcp_servers:``,
or ``ToolRegistry`` in library mode), not given to LangChain: the agent gets this single tool and
calls them from its code, as many times as it likes in one step. See ``kernelmode.adapters.crewai``
for more on that design.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForToolRun, CallbackManagerForToolRun
from langchain_core.tools import BaseTool, ToolException
from langchain_core.tools.base import ArgsSchema
from pydantic import BaseModel, Field, PrivateAttr

from ..errors import KernelmodeError
from ._runner import DEFAULT_BUDGET, DEFAULT_DESCRIPTION, SessionRunner, Target


class RunPythonInput(BaseModel):
    code: str = Field(description="Python source to run. The value of the last expression is "
                                  "returned, like in a notebook cell.")


class KernelmodeTool(BaseTool):
    """A LangChain tool that runs Python in one kernelmode session (see the module docstring)."""

    name: str = "run_python"
    description: str = DEFAULT_DESCRIPTION
    args_schema: ArgsSchema | None = RunPythonInput
    handle_tool_error: bool | str | Callable[[ToolException], Any] | None = True

    _runner: SessionRunner = PrivateAttr()

    def __init__(self, runner: SessionRunner, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._runner = runner

    @property
    def runner(self) -> SessionRunner:
        return self._runner

    @property
    def session_id(self) -> str | None:
        """The session in use (None before the first call, when the tool creates it)."""
        return self._runner.session_id

    def _run(self, code: str, run_manager: CallbackManagerForToolRun | None = None) -> str:
        try:
            return self._runner.run(code)
        except KernelmodeError as e:
            raise ToolException(f"kernelmode could not run the code ({e.code}): {e.message}") from e

    async def _arun(self, code: str, run_manager: AsyncCallbackManagerForToolRun | None = None) -> str:
        try:
            return await self._runner.arun(code)
        except KernelmodeError as e:
            raise ToolException(f"kernelmode could not run the code ({e.code}): {e.message}") from e

    def close(self) -> None:
        """Delete the session the tool created; the next call would start a new one. A session
        handed to ``as_langchain_tool`` is the caller's and is left alone."""
        self._runner.close()

    async def aclose(self) -> None:
        await self._runner.aclose()


def as_langchain_tool(client_or_session: Target, *, name: str = "run_python",
                      description: str | None = None, session: Mapping[str, Any] | None = None,
                      timeout_seconds: float | None = None, budget: int = DEFAULT_BUDGET,
                      **tool_kwargs: Any) -> KernelmodeTool:
    """A LangChain ``BaseTool`` taking ``code: str`` that runs it in one kernelmode session.

    ``client_or_session``: a ``Client``/``AsyncClient`` (the tool creates its session on first
    use and ``close()`` deletes it) or an existing ``Session``/``AsyncSession`` (used as is).
    ``session``: ``create_session`` arguments for the session the tool creates, e.g.
    ``{"tools": ["price"], "limits": {"memory_mb": 1024}, "ttl_seconds": 3600}``.
    ``timeout_seconds``: limit of each run (server default 60 s). ``budget``: characters kept of
    each text part of a result. Other keyword arguments go to the tool (``tags``,
    ``handle_tool_error``, ``return_direct``...).
    """
    runner = SessionRunner(client_or_session, session_options=session,
                           timeout_seconds=timeout_seconds, budget=budget)
    return KernelmodeTool(runner, name=name, description=description or DEFAULT_DESCRIPTION,
                          **tool_kwargs)
