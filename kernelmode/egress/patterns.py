"""The host pattern language of egress (``egress.allow``, ``deny``, secret rules, narrowing):
lowercase names where ``*`` stands for any run of characters (dots included), with an optional
``:port`` (none: 80 and 443). Imports nothing of kernelmode, so settings and request models can
both use it."""

from __future__ import annotations

import re

HOST_PATTERN = re.compile(r"^[a-z0-9*]([a-z0-9*.-]{0,252}[a-z0-9*])?(:[0-9]{1,5})?$")
DEFAULT_PORTS = (80, 443)


def check_host_pattern(entry: str) -> str:
    """``entry`` lowercased, or ValueError saying what a host pattern looks like."""
    v = entry.strip().lower()
    if v.startswith("[") or not HOST_PATTERN.match(v):
        raise ValueError(f"{entry!r} is not a host pattern: a name with optional '*' and ':port' "
                         "(e.g. 'api.github.com', '*.example.com:8443')")
    _, _, port = v.partition(":")
    if port and not 1 <= int(port) <= 65535:
        raise ValueError(f"{entry!r}: port {port} is out of range")
    return v


def check_patterns(values: list[str]) -> list[str]:
    return [check_host_pattern(v) for v in values]


def split_pattern(entry: str) -> tuple[str, tuple[int, ...]]:
    """``(host glob, ports)`` of a checked pattern; no port means 80 and 443."""
    host, _, port = entry.partition(":")
    return host, (int(port),) if port else DEFAULT_PORTS


def host_matches(glob: str, host: str) -> bool:
    """Does the host glob (``*``: any characters, dots included) match this name?"""
    return re.fullmatch(".*".join(re.escape(p) for p in glob.split("*")), host) is not None


def pattern_covers(outer: str, inner: str) -> bool:
    """Is every (host, port) that ``inner`` matches also matched by ``outer``? ``inner``'s stars
    are taken as text, which ``outer``'s stars can match (outer's other characters are never a
    star, so a star of inner can only fall inside one of outer's)."""
    outer_host, outer_ports = split_pattern(outer)
    inner_host, inner_ports = split_pattern(inner)
    return set(inner_ports) <= set(outer_ports) and host_matches(outer_host, inner_host)


def first_uncovered(outer: list[str], inner: list[str]) -> str | None:
    """The first pattern of ``inner`` that no pattern of ``outer`` covers, or None."""
    return next((p for p in inner if not any(pattern_covers(o, p) for o in outer)), None)
