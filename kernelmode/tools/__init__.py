"""Host tools that kernel code calls as ``tools.NAME(...)``: the registry, the broker that
answers calls from kernels, Python-callable tools and upstream MCP servers' tools."""
