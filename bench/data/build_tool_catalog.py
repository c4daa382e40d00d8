"""How bench/data/mcp_tools.json was made: real MCP servers' tool lists, from their repositories.

Run once by hand, against local clones (git directories) of the source repositories; the JSON it
writes is committed, so the benchmark and the tests need none of this. Every server of the file
names its source (repository @ commit : path). Sources:

* github: github/github-mcp-server's tool snapshots (``__toolsnaps__/*.snap``, its own test
  fixtures of ``tools/list``), without the ``_typed``/``_ff_`` variants.
* sentry: getsentry/sentry-mcp's generated ``toolDefinitions.json``.
* playwright: microsoft/playwright-mcp's generated tool reference in README.md.
* filesystem, memory, fetch, cloudflare_*: captured ``tools/list`` answers in
  jakemannix/mcp-proxy (demo/mcp-snapshots).
* slack, brave_search, gdrive, google_maps, postgres, aws_kb, everart, puppeteer, redis (TypeScript
  ``Tool`` literals, evaluated with node) and sqlite, git, time, sequential_thinking: the
  reference servers of modelcontextprotocol/servers (the archived ones at the commit before
  their removal).

Usage: python bench/data/build_tool_catalog.py MIRRORS_DIR > bench/data/mcp_tools.json, where
MIRRORS_DIR holds ``owner+name/repo`` git directories.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ARCHIVED = "1f705677a930ec618b7a16d87d00cee7db747ff2"  # modelcontextprotocol/servers before the archive


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout


def head(repo: Path) -> str:
    return git(repo, "rev-parse", "HEAD").strip()


def tool(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "description": description or "", "inputSchema": schema}


def github(m: Path) -> tuple[str, list[dict[str, Any]]]:
    repo, c = m / "github+github-mcp-server/repo", None
    c = head(repo)
    folder = "pkg/github/__toolsnaps__/"
    out = []
    for path in git(repo, "ls-tree", "--name-only", c, folder).split():
        if "_typed" in path or "_ff_" in path:
            continue
        snap = json.loads(git(repo, "show", f"{c}:{path}"))
        out.append(tool(snap["name"], snap.get("description", ""), snap["inputSchema"]))
    return f"github/github-mcp-server@{c[:12]}:{folder}", out


def sentry(m: Path) -> tuple[str, list[dict[str, Any]]]:
    repo = m / "getsentry+sentry-mcp/repo"
    c, path = head(repo), "packages/mcp-core/src/toolDefinitions.json"
    data = json.loads(git(repo, "show", f"{c}:{path}"))
    return f"getsentry/sentry-mcp@{c[:12]}:{path}", [tool(t["name"], t["description"], t["inputSchema"]) for t in data]


_PW_PARAM = re.compile(r"^\s+- `(\w+)` \(([^,)]+)(, optional)?\): ?(.*)$")


def playwright(m: Path) -> tuple[str, list[dict[str, Any]]]:
    repo = m / "microsoft+playwright-mcp/repo"
    c = head(repo)
    lines = git(repo, "show", f"{c}:README.md").splitlines()
    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(lines):
        hit = re.match(r"^- \*\*(browser_\w+)\*\*", lines[i])
        if not hit:
            i += 1
            continue
        name, desc, props, required = hit.group(1), "", {}, []
        i += 1
        while i < len(lines) and lines[i].startswith("  "):
            line = lines[i]
            if line.strip().startswith("- Description:"):
                desc = line.split(":", 1)[1].strip()
            p = _PW_PARAM.match(line)
            if p:
                props[p.group(1)] = {"type": p.group(2).strip(), "description": p.group(4).strip()}
                if not p.group(3):
                    required.append(p.group(1))
            i += 1
        out.setdefault(name, tool(name, desc, {"type": "object", "properties": props, "required": required}))
    return f"microsoft/playwright-mcp@{c[:12]}:README.md", list(out.values())


def snapshot(m: Path, file: str) -> tuple[str, list[dict[str, Any]]]:
    repo = m / "jakemannix+mcp-proxy/repo"
    c, path = head(repo), f"demo/mcp-snapshots/{file}"
    data = json.loads(git(repo, "show", f"{c}:{path}"))
    return f"jakemannix/mcp-proxy@{c[:12]}:{path}", [
        tool(t["name"], t.get("description", ""), t.get("inputSchema") or t.get("input_schema") or {})
        for t in data["tools"]]


def reference(m: Path, path: str, commit: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    repo = m / "modelcontextprotocol+servers/repo"
    c = commit or head(repo)
    src = git(repo, "show", f"{c}:{path}")
    here = Path(__file__).with_name("catalog_extract.py")
    kind = "py" if path.endswith(".py") else "ts"
    found = json.loads(subprocess.run([sys.executable, str(here), kind], input=src, capture_output=True,
                                      text=True, check=True).stdout)
    return f"modelcontextprotocol/servers@{c[:12]}:{path}", found


def main() -> None:
    m = Path(sys.argv[1])
    servers = {
        "github": github(m),
        "sentry": sentry(m),
        "playwright": playwright(m),
        "filesystem": snapshot(m, "server-filesystem.json"),
        "memory": snapshot(m, "server-memory.json"),
        "fetch": snapshot(m, "mcp-server-fetch.json"),
        "cloudflare_browser": snapshot(m, "cloudflare-browser.json"),
        "cloudflare_docs": snapshot(m, "cloudflare-docs.json"),
        "cloudflare_radar": snapshot(m, "cloudflare-radar.json"),
        "slack": reference(m, "src/slack/index.ts", ARCHIVED),
        "brave_search": reference(m, "src/brave-search/index.ts", ARCHIVED),
        "gdrive": reference(m, "src/gdrive/index.ts", ARCHIVED),
        "google_maps": reference(m, "src/google-maps/index.ts", ARCHIVED),
        "postgres": reference(m, "src/postgres/index.ts", ARCHIVED),
        "aws_kb": reference(m, "src/aws-kb-retrieval-server/index.ts", ARCHIVED),
        "everart": reference(m, "src/everart/index.ts", ARCHIVED),
        "puppeteer": reference(m, "src/puppeteer/index.ts", ARCHIVED),
        "redis": reference(m, "src/redis/src/index.ts", ARCHIVED),
        "sqlite": reference(m, "src/sqlite/src/mcp_server_sqlite/server.py", ARCHIVED),
        "git": reference(m, "src/git/src/mcp_server_git/server.py"),
        "time": reference(m, "src/time/src/mcp_server_time/server.py"),
        "sequential_thinking": reference(m, "src/sequentialthinking/index.ts", ARCHIVED),
    }
    doc = {"about": "Real MCP servers' tool lists (name, description, inputSchema) for the tool-search "
                    "benchmark; made by build_tool_catalog.py, each server with its source.",
           "servers": [{"name": k, "source": src, "tools": tools} for k, (src, tools) in servers.items()]}
    json.dump(doc, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
