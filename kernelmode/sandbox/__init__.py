"""Sandbox backends: jupyter_client kernel provisioners registered by entry point.

- ``kernelmode-bwrap`` (:mod:`.bwrap`): bubblewrap namespaces + cgroups/rlimits (the default).
- ``kernelmode-docker`` (:mod:`.docker_backend`): a container of the kernel image per kernel.
- ``kernelmode-none`` (:mod:`.local`): a plain local process, for development only.

Where each module runs (tests/unit/test_import_graph.py holds the split):

- the Kernel Gateway process: the provisioners above and their base (:mod:`.base`);
- their own processes, started by path with ``python -I``: the launchers (:mod:`.launcher`,
  :mod:`.docker_launcher`), which import nothing of kernelmode;
- the manager: :mod:`.kernelspec` (installs the kernelspec naming a provisioner, checks bwrap);
- both: the pure helpers (:mod:`.spec`, :mod:`.bwrap_command`, :mod:`.docker_engine`,
  :mod:`.seccomp`, :mod:`.uids`, :mod:`.cgroups`).
"""
