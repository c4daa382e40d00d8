"""What the MCP server tells the model: its instructions, and how code calls a host tool."""

from __future__ import annotations

from ..tools.registry import ToolRegistry


def instructions(tools: ToolRegistry) -> str:
    """The server's instructions to the model (the host tools are listed, so: after they started)."""
    infos = tools.infos()
    listed = "\n".join(f"- {call_form(t.name, t.signature)}: {t.description.splitlines()[0] if t.description else ''}"
                       for t in infos)
    if len(infos) > LIST_AT_MOST:  # a long list costs the context that code mode saves: search instead
        host = (f"Code can call {len(infos)} host tools (they run outside the sandbox, with the network), "
                "from servers " + ", ".join(sorted(tools.namespaces) or ["(none)"]) + " and the host. Find "
                "the ones you need with search_tools('what you want to do'), or tools.search(...) from code.")
    else:
        host = (f"Code can call these host tools (they run outside the sandbox, with the network):\n{listed}"
                if infos else "No host tools are configured.")
    return (
        "kernelmode runs Python in a sandboxed, stateful Jupyter kernel. Variables, imports and "
        "loaded data persist between run_python calls of the same session, so build an analysis "
        "step by step instead of repeating work. The kernel has no network. Files live in "
        "/mnt/data: upload_file puts data there, and files your code writes there are kept and "
        "listed with download links; read_artifact shows you an image or text file. numpy, pandas "
        "and matplotlib are installed (plots appear as images). A long run keeps going in the "
        "background: run_python then returns status RUNNING with a run_id for get_run. A package "
        "the kernel lacks: install_packages (or `%pip install NAME` in code) fetches it for you.\n" + host
    )


# More host tools than this, and the instructions point to search_tools instead of listing them.
LIST_AT_MOST = 8


def call_form(name: str, signature: str) -> str:
    """How code calls a tool: ``tools.github.list_commits(owner: str, ...)``."""
    prefix = name.rpartition(".")[0]
    return f"tools.{prefix + '.' if prefix else ''}{signature or name.rpartition('.')[2] + '(...)'}"
