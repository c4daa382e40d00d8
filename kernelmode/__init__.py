"""kernelmode: a self-hosted, stateful, sandboxed Python interpreter service for AI agents."""

__version__ = "0.1.0"
