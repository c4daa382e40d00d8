"""`kernelmode console`: a person's frontend (jupyter console...) on a live session's kernel."""
