"""Sessions: the SessionManager (the core every front door calls) and its rooms: kernels (one
kernel's lifecycle), pool, runner (one run), files, recovery, reaper, runs (polling), store."""

from .manager import SessionManager

__all__ = ["SessionManager"]
