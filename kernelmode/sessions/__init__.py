"""Sessions: the SessionManager (the core every front door calls), its store and its reaper."""

from .manager import SessionManager

__all__ = ["SessionManager"]
