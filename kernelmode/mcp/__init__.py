"""The MCP front door: tools for agents over streamable HTTP (/mcp) and stdio (`kernelmode mcp`)."""
