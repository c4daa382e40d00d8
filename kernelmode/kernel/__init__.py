"""Code that runs INSIDE kernels (stdlib only; imports nothing else from kernelmode)."""
