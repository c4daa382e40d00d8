"""kernelmode as a CrewAI tool: ``pip install 'kernelmode[crewai]'``.

::

    from crewai import Agent
    from kernelmode import Client
    from kernelmode.adapters.crewai import as_crewai_tool

    km = Client("http://127.0.0.1:8888", token="...")
    python = as_crewai_tool(km)                        # one tool: run_python(code: str)
    analyst = Agent(role="Analyst", goal="...", backstory="...", tools=[python])
    ...
    python.close()                                     # delete the tool's session

**One tool for the framework, every host tool inside the kernel.** Register the host
application's tools once, on the kernelmode server, and kernel code calls them as
``tools.NAME(...)``:

- server mode: name Python callables (``function: my_app.tools:price``) and upstream MCP servers
  under ``tools:`` / ``mcp_servers:`` in ``kernelmode.yaml``; the server process imports and runs
  them, outside the sandbox, with the network and the credentials;
- library mode: ``ToolRegistry().register(func)`` and ``KernelmodeApp(settings, registry)``
  (see ``examples/library_mode.py``).

The CrewAI agent then gets this single "run Python" tool, not one CrewAI tool per function: it
writes code that loops over ``tools.price(...)`` hundreds of times, filters and aggregates in the
kernel, and reads back only the compact result. ``tools.help()`` in the kernel lists what is
available (``GET /v1/tools`` from outside); ``as_crewai_tool(km, session={"tools": [...]})``
restricts the tool's session to some of them.

The tool runs every call in one session, created on the first call and reused, so variables,
imports and files persist across the agent's steps; it answers with the text the MCP server
gives a model (``kernelmode.mcp.render.run_text``). An exception in the code is such an answer
(status ERROR, with the traceback), not a Python exception; a failure of the service itself
(unreachable server, too many sessions) raises ``KernelmodeError``, which CrewAI reports to the
agent. CrewAI tools are synchronous here, so the tool takes a ``Client`` or a ``Session``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from crewai.tools import BaseTool
from pydantic import BaseModel, Field, PrivateAttr

from ..client import Client, Session
from ._runner import DEFAULT_BUDGET, DEFAULT_DESCRIPTION, SessionRunner


class RunPythonInput(BaseModel):
    code: str = Field(description="Python source to run. The value of the last expression is "
                                  "returned, like in a notebook cell.")


class KernelmodeCrewTool(BaseTool):
    """A CrewAI tool that runs Python in one kernelmode session (see the module docstring)."""

    name: str = "run_python"
    description: str = DEFAULT_DESCRIPTION
    args_schema: type[BaseModel] = RunPythonInput

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

    def _run(self, code: str) -> str:
        return self._runner.run(code)

    def close(self) -> None:
        """Delete the session the tool created; the next call would start a new one. A session
        handed to ``as_crewai_tool`` is the caller's and is left alone."""
        self._runner.close()


def as_crewai_tool(client_or_session: Client | Session, *, name: str = "run_python",
                   description: str | None = None, session: Mapping[str, Any] | None = None,
                   timeout_seconds: float | None = None, budget: int = DEFAULT_BUDGET,
                   **tool_kwargs: Any) -> KernelmodeCrewTool:
    """A CrewAI ``BaseTool`` taking ``code: str`` that runs it in one kernelmode session.

    ``client_or_session``: a ``Client`` (the tool creates its session on first use and
    ``close()`` deletes it) or an existing ``Session`` (used as is, never deleted by the tool).
    ``session``: ``create_session`` arguments for the session the tool creates, e.g.
    ``{"tools": ["price"], "limits": {"memory_mb": 1024}, "ttl_seconds": 3600}``.
    ``timeout_seconds``: limit of each run (server default 60 s). ``budget``: characters kept of
    each text part of a result. Other keyword arguments go to the tool (``result_as_answer``,
    ``max_usage_count``...).
    """
    if not isinstance(client_or_session, (Client, Session)):
        raise TypeError("as_crewai_tool needs a kernelmode Client or Session (CrewAI calls tools "
                        f"synchronously), not {type(client_or_session).__name__}")
    runner = SessionRunner(client_or_session, session_options=session,
                           timeout_seconds=timeout_seconds, budget=budget)
    return KernelmodeCrewTool(runner, name=name, description=description or DEFAULT_DESCRIPTION,
                              **tool_kwargs)
