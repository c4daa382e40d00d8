"""The REST front door (tornado): thin handlers over the SessionManager."""
