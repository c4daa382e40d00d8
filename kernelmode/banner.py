"""The short block `kernelmode serve` prints on stdout once it serves: where, with which token,
and the lines a newcomer pastes to use it (shell, Python client, an MCP client).

The first line, ``kernelmode serving on URL  (sandbox: ...)``, is what scripts and the test
fixtures read. A token the user chose (``--token``, ``$KERNELMODE_TOKEN``, the config file) is
never printed in full, and the pasted lines name ``$KERNELMODE_TOKEN`` instead; a generated one
must be shown, or nobody could use the server.
"""

from __future__ import annotations

from typing import Literal

TokenSource = Literal["generated", "--token", "KERNELMODE_TOKEN", "config"]
_FROM = {"--token": "from --token", "KERNELMODE_TOKEN": "from $KERNELMODE_TOKEN",
         "config": "from server.token in the config"}


def mask(token: str) -> str:
    """Enough to tell two tokens apart, not enough to use one."""
    return f"{token[:4]}… ({len(token)} characters)" if len(token) >= 12 else "****"


def startup_block(url: str, token: str, source: TokenSource, sandbox: str, mcp: bool) -> str:
    if source == "generated":
        shown = f"{token}  (generated; set KERNELMODE_TOKEN to choose one)"
        bearer, export = token, f"  export KERNELMODE_URL={url} KERNELMODE_TOKEN={token}"
    else:
        shown = f"{mask(token)}  ({_FROM[source]})"
        # The user has the token: the lines name it, and the shell fills it in.
        bearer = "$KERNELMODE_TOKEN"
        export = (f"  export KERNELMODE_URL={url}" if source == "KERNELMODE_TOKEN"
                  else f"  export KERNELMODE_URL={url} KERNELMODE_TOKEN=<the token you gave>")
    mcp_url = url + "/mcp"
    lines = [
        f"kernelmode serving on {url}  (sandbox: {sandbox})",
        f"  REST API  {url}/v1  (OpenAPI: {url}/openapi.json)",
        f"  MCP       {mcp_url}  (streamable HTTP)" if mcp else "  MCP       off (mcp.enabled: false)",
        f"  token     {shown}",
        "Shell, Python client, `kernelmode console`, `kernelmode mcp --url`:",
        export,
    ]
    if mcp:
        lines += ["Claude Code:",
                  f'  claude mcp add --transport http kernelmode {mcp_url} --header "Authorization: Bearer {bearer}"']
    return "\n".join(lines)
