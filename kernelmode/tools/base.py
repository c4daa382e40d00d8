"""What every host tool is: a spec the kernel and the model can read, and an async call."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field


class ToolInfo(BaseModel):
    model_config = ConfigDict(defer_build=True)  # built at its first use (models._Model)
    """A tool as listed by ``GET /v1/tools`` and sent to kernels (``tools.help()``)."""

    name: str = Field(description="Full name: 'add', or 'server.tool' for an upstream MCP server's tool.")
    namespace: str | None = Field(None, description="The upstream MCP server's name, if any.")
    description: str = ""
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON Schema of the keyword arguments.",
    )
    signature: str = Field("", description="Python signature, e.g. 'add(a: int, b: int = 0)'.")
    requires_approval: bool = Field(False, description="Each call waits for a person's yes/no.")


class ToolMatch(BaseModel):
    model_config = ConfigDict(defer_build=True)  # built at its first use (models._Model)
    """One answer of ``search_tools``: enough for a model to call the tool from code."""

    name: str = Field(description="Full name: 'add', or 'server.tool' for an upstream MCP server's tool.")
    description: str = Field("", description="The first line of the tool's description.")
    signature: str = Field("", description="Python signature, e.g. 'list_commits(owner: str, repo: str)'.")
    score: float = Field(description="BM25 relevance to the query (higher is better; only > 0 is answered).")


class Tool(Protocol):
    info: ToolInfo

    async def call(self, arguments: dict[str, Any], timeout: float) -> Any:
        """Run the tool with keyword ``arguments``; return plain JSON-able data.

        Raises ToolFailed (with a message fit for the caller) on any failure, including the
        timeout.
        """
        ...
