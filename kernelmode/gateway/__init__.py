"""The manager's side of the Jupyter Kernel Gateway: its process (start, adopt, stop), its REST
API and its kernel websockets. What runs inside the gateway process is ``kernelmode.gateway_ext``."""
