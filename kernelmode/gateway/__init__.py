"""Talking to the Jupyter Kernel Gateway: its process, its REST API, its kernel websockets."""
