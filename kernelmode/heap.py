"""Large buffers go back to the OS when freed, so a burst of big requests (tool calls of a few MB,
uploads, kernel messages) does not leave the manager's RSS high for good.

glibc's malloc serves blocks over a threshold (128 KiB at start) with mmap and unmaps them at
free; but every mmapped block freed raises that threshold to its size (up to 32 MiB), after which
multi-MB buffers come from the heap, whose freed holes stay resident. A fixed threshold keeps them
mmapped. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 1024 * 1024  # below it, the heap as usual (cheaper for the many small buffers)


def release_large_buffers(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold for this process; False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
