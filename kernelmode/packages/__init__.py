"""Packages on demand while the kernel stays offline: the manager downloads wheels for the
kernel's target into a shared, hash-checked cache (``cache``, ``fetch``, ``target``), checks them
against the policy (``policy``), and unpacks them into the session's read-only layer
(``layer``); ``service`` puts it together. Nothing from a package runs on the host.

Import from the modules (``kernelmode.packages.service`` ...): this package's ``__init__`` stays
empty so that the client can take ``errors`` without the rest.
"""
