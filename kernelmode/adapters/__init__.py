"""Agent-framework adapters: kernelmode as a single "run Python" tool of an agent framework.

Each adapter is a thin layer over ``kernelmode.Client`` and lives in its own module, which
imports its framework; this package imports none of them, so the frameworks stay optional:

- ``kernelmode.adapters.langchain.as_langchain_tool`` (LangChain, LangGraph):
  ``pip install 'kernelmode[langchain]'``
- ``kernelmode.adapters.crewai.as_crewai_tool`` (CrewAI): ``pip install 'kernelmode[crewai]'``

Both share ``SessionRunner`` (``_runner.py``): one session, created on first use and reused, so
variables persist across the agent's calls; the result is rendered for a model by
``kernelmode.mcp.render.run_text``, as the MCP server does.
"""

from ._runner import DEFAULT_DESCRIPTION, SessionRunner

__all__ = ["DEFAULT_DESCRIPTION", "SessionRunner"]
