"""Sandbox backends: jupyter_client kernel provisioners registered by entry point.

- ``kernelmode-bwrap`` (:mod:`.bwrap`): bubblewrap namespaces + cgroups/rlimits (the default).
- ``kernelmode-none`` (:mod:`.local`): a plain local process, for development only.

The gateway process imports these; the manager only installs the kernelspec that names them.
"""
