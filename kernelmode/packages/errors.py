"""The errors of packages on demand (rows of the tree in kernelmode/errors.py)."""

from __future__ import annotations

from ..errors import Forbidden, InvalidRequest, KernelmodeError


class PackageRefused(Forbidden):
    """A package the policy refuses (the message names the rule), or one that would replace a
    package of the kernel's own environment."""

    code = "package_refused"


class NoWheel(InvalidRequest):
    """No wheel for the kernel's interpreter and platform: kernelmode never builds on the host."""

    code = "no_wheel"


class PackageFetchFailed(KernelmodeError):
    """The download failed for another reason (index unreachable, pip failed)."""

    code = "package_fetch_failed"
    http_status = 502
