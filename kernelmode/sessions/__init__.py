"""Sessions: the SessionManager (the core every front door calls) and its rooms: kernels (one
kernel's lifecycle), pool, runner (one run), files, admission, listing, forks, gateway_loss,
recovery, reaper, runs (polling), store."""

from .manager import SessionManager

__all__ = ["SessionManager"]
