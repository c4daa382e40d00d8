"""Code loaded INTO the Kernel Gateway process (not the manager's): its traitlets config
(``config/kernel_gateway_config.py``, with the kernelspec template beside it) and the classes
that config names: the websocket connection that bounds and batches kernel messages
(:mod:`.kg_extensions`, :mod:`.ws_batch`) and the kernel manager sized for many kernels.

It imports only the shared rooms (``protocol``, ``errors``, ``heap``), never the manager's:
tests/unit/test_import_graph.py holds the rule. The sandbox provisioners the gateway also loads
live in ``kernelmode.sandbox`` (found through their entry points).
"""
