"""Settings of egress: which hosts kernel code may reach through the host-side proxy, the secrets
the proxy adds to their requests, and its caps (kernelmode/egress/ enforces them).

Unset or empty ``egress.allow``: no egress at all, as without this section. Host patterns are
lowercase names where ``*`` stands for any run of characters (dots included), with an optional
``:port`` (default: 80 and 443): ``api.github.com``, ``*.githubusercontent.com``,
``files.example.com:8443``.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from pydantic import Field, field_validator

from .base import _Section

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


def _check_patterns(values: list[str]) -> list[str]:
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


class EgressSecret(_Section):
    """A header the proxy adds to (or replaces in) every request to a host; the kernel never sees
    its value, because the proxy intercepts TLS to that host to add it."""

    host: str
    """Host pattern the header is for (as in `egress.allow`, without a port: every allowed port)."""
    header: str = Field(pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$")
    """Header name, e.g. `Authorization`."""
    value: str = Field(min_length=1, max_length=8192)
    """Header value, usually from the manager's environment: `"Bearer ${GITHUB_TOKEN}"`. Never shown
    by the API (session info lists the host and header only) nor written to logs."""

    @field_validator("host", mode="after")
    @classmethod
    def _host(cls, v: str) -> str:
        v = check_host_pattern(v)
        if ":" in v:
            raise ValueError(f"{v!r}: a secret rule names a host without a port")
        return v

    @field_validator("value", mode="after")
    @classmethod
    def _one_line(cls, v: str) -> str:
        if any(c in v for c in "\r\n\0"):
            raise ValueError("a header value cannot hold a line break or NUL")
        return v


class EgressNarrowing(_Section):
    """What a tenant (`server.tenants[].egress`) or a session (`POST /v1/sessions` `egress`) may
    set: it can only narrow the policy above it."""

    allow: list[str] | None = Field(None, max_length=1000)
    """Host patterns; each must be covered by the level above's `allow` (a wider one is refused
    naming the host). `null`: the level above's list."""
    deny: list[str] = Field(default_factory=list, max_length=1000)
    """Host patterns refused on top of the level above's `deny`."""
    max_bytes_per_session: int | None = Field(None, ge=0)
    """Lowers `egress.max_bytes_per_session`."""
    max_connections_per_session: int | None = Field(None, ge=0)
    """Lowers `egress.max_connections_per_session`."""

    @field_validator("allow", "deny", mode="after")
    @classmethod
    def _patterns(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else _check_patterns(v)


class EgressSettings(_Section):
    """Egress (docs/security-model.md "Egress"): the kernel still has no network interface but
    `lo`; its only way out is a proxy on the host that enforces this policy."""

    allow: list[str] = Field(default_factory=list, max_length=10_000)
    """Host patterns kernel code may reach over HTTP or HTTPS: `api.github.com`,
    `*.githubusercontent.com` (`*` matches any characters, dots included), `host:8443` (without a
    port: 80 and 443). Empty: no egress (sessions have no proxy, as without this section)."""
    deny: list[str] = Field(default_factory=list, max_length=10_000)
    """Host patterns refused even when `allow` matches them (deny wins); without a port, on every
    port."""
    secrets: list[EgressSecret] = Field(default_factory=list)
    """Headers the proxy adds to requests to a host (`{host, header, value}`). The proxy
    intercepts TLS to these hosts with a certificate from the deployment's CA
    (`<data_dir>/egress/ca.pem`, created on first use), which the kernels then trust; other hosts
    are tunnelled without decryption. An upstream can still echo the header back to the kernel."""
    hosts: dict[str, str] = Field(default_factory=dict)
    """Static name → address map the proxy uses instead of DNS (on-premise services). The
    address is still checked like a resolved one (see `allow_addresses`)."""
    allow_addresses: list[str] = Field(default_factory=list)
    """CIDRs the proxy may connect to although they are refused by default (loopback,
    link-local such as the metadata address 169.254.169.254, private and unique-local ranges, the
    manager's own addresses), e.g. `10.1.2.0/24`. An IP literal as a host (`http://10.1.2.3/`) is
    refused unless its address is in this list and an `allow` pattern names it."""
    upstream_ca_file: Path | None = None
    """PEM file of CAs trusted for upstreams besides the system's (internal services). Used by the
    proxy to verify intercepted hosts and added to the kernels' CA bundle."""
    max_bytes_per_session: int = Field(1024 * 1024 * 1024, ge=0)
    """Bytes (up and down together) a session may move through the proxy; past it, open
    connections are cut and new ones refused with a 403 that says so."""
    max_connections_per_session: int = Field(32, ge=0)
    """Connections a session may hold open through the proxy at once; more are refused (403)."""
    idle_timeout_seconds: float = Field(60.0, gt=0)
    """A proxied connection with no byte either way for this long is closed (also bounds how long
    a client may take to send its request head)."""

    @field_validator("allow", "deny", mode="after")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        return _check_patterns(v)

    @field_validator("hosts", mode="after")
    @classmethod
    def _hosts(cls, v: dict[str, str]) -> dict[str, str]:
        out = {}
        for name, address in v.items():
            if "*" in name or ":" in check_host_pattern(name):
                raise ValueError(f"egress.hosts: {name!r} must be a plain host name")
            try:
                out[name.strip().lower()] = str(ipaddress.ip_address(address.strip()))
            except ValueError:
                raise ValueError(f"egress.hosts.{name}: {address!r} is not an IP address") from None
        return out

    @field_validator("allow_addresses", mode="after")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        out = []
        for cidr in v:
            try:
                out.append(str(ipaddress.ip_network(cidr.strip(), strict=False)))
            except ValueError:
                raise ValueError(f"egress.allow_addresses: {cidr!r} is not a CIDR such as "
                                 "'10.1.2.0/24'") from None
        return out

    @field_validator("upstream_ca_file", mode="after")
    @classmethod
    def _ca_file(cls, v: Path | None) -> Path | None:
        if v is not None and not v.expanduser().is_file():
            raise ValueError(f"{v} is not a file")
        return None if v is None else v.expanduser().absolute()
