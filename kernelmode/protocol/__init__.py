"""The wire between kernelmode's processes: names that the manager, the Kernel Gateway's
extensions and the code inside kernels must spell alike.

- :mod:`.frames`: the kernel websocket frames (``v1.kernel.websocket.jupyter.org``), parsed with
  bounds, by the manager and by the gateway extensions.
- Here: the names the manager and the in-kernel modules (kernelmode/kernel/) share. Those modules
  are sent into kernels as source and run where kernelmode is not installed, so they keep their
  own copies of these literals; tests/unit/test_protocol.py holds each copy equal to the name here.

Every process imports this package: it imports nothing of kernelmode but ``errors`` (the
frame codec's refusals).
"""

from __future__ import annotations

# The tool channel (kernel/preamble.py): an input_request whose prompt is MARKER + a JSON request.
MARKER = "\x00kernelmode-tool-call\x00"
PING = "__kernelmode_ping__"  # a reserved tool name answered by the manager: proves the stdin path works
SEARCH = "__kernelmode_search__"  # ... answered with tools.search() over the session's tools
PIP = "__kernelmode_pip__"  # ... answered by installing packages into the session (%pip)
PACKAGES_ENV = "KM_PACKAGES_DIR"  # the kernel's env var naming where its package layer is mounted

# The file agent (kernel/file_agent.py).
FILES_TARGET = "kernelmode.files"  # the comm target the manager opens for workspace files
CHANGES_COMM = "kernelmode-files-changes"  # comm_id of a post-run change note too large for the reply
NOTE_KEY = "kernelmode_changes"  # the execute_reply metadata field of the post-run change note

# Snapshots (kernel/snapshot.py): the display message that answers the manager's snapshot call.
SNAPSHOT_MIME = "application/vnd.kernelmode.snapshot+json"


def memory_hint(memory_mb: int | None) -> str:
    """The sentence added to a MemoryError in the kernel (kernel/hints.py), and the detail of a
    kernel the manager saw killed for memory: one text wherever the model reads it."""
    limit = f"its limit of {memory_mb} MiB" if memory_mb else "its memory limit"
    return (f"kernelmode: the session reached {limit} (limits.memory_mb): create the session with a "
            "larger limits.memory_mb (up to the server's ceiling), or work on the data in chunks.")
