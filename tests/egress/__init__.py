"""Egress: the policy, its decision and the host-side proxy, with real upstream servers on loopback (no kernels)."""
