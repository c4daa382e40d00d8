"""Settings of egress: which hosts kernel code may reach through the host-side proxy, the secrets
the proxy adds to their requests, and its caps (kernelmode/egress/ enforces them).

Unset or empty ``egress.allow``: no egress at all, as without this section. Host patterns are
lowercase names where ``*`` stands for any run of characters (dots included), with an optional
``:port`` (default: 80 and 443): ``api.github.com``, ``*.githubusercontent.com``,
``files.example.com:8443``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, field_validator

from ..egress.patterns import check_host_pattern, check_patterns
from ..models import EgressNarrowing
from .base import _Section

__all__ = ["EgressNarrowing", "EgressSecret", "EgressSettings"]

# A name or IPv4 address and a port: also a valid KERNEL_* launch value (gateway/launch.py).
HOST_PORT = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,252}:[0-9]{1,5}$"

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
    intercepts TLS to these hosts with a certificate from the deployment's CA (`ca_dir`), which
    the kernels then trust (remote kernels: `remote_ca_bundle`); other hosts are tunnelled without
    decryption. An upstream can still echo the header back to the kernel."""
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
    listen: str | None = Field(None, pattern=HOST_PORT)
    """`host:port` where `kernelmode egress-proxy` listens (TCP) for kernels on other hosts
    (Enterprise Gateway nodes, Kubernetes pods), e.g. `0.0.0.0:3128`. Unset: that command refuses
    to start. `serve` never listens here: local kernels use their own unix socket."""
    metrics_listen: str | None = Field(None, pattern=HOST_PORT)
    """`host:port` where `kernelmode egress-proxy` answers `GET /metrics` (Prometheus: its
    `kernelmode_egress_*` counters). Unset: no metrics endpoint. Never the `listen` port: kernels
    reach that one."""
    proxy_address: str | None = Field(None, pattern=HOST_PORT)
    """`host:port` at which kernels on an external gateway (`gateway.url`) reach that proxy, e.g.
    `egress-proxy.kernelmode.svc:3128`. Set, each such kernel is launched with its own token
    (`KERNEL_KM_EGRESS_TOKEN`) and this address (`KERNEL_KM_EGRESS_PROXY`), from which its
    kernelspec or pod template makes `HTTP_PROXY`; unset, remote kernels have no egress."""
    ca_dir: Path | None = None
    """Directory of the deployment's interception CA (`ca.pem`, key `ca-key.pem` mode 0600),
    created there on first use if absent. Unset: `<data_dir>/egress`. Every `kernelmode
    egress-proxy` replica (and a manager with local kernels) must read the same CA: point them all
    at one copy (on Kubernetes, a Secret mounted into the proxies only; make it with `kernelmode
    egress-proxy --make-ca`)."""
    remote_ca_bundle: str | None = None
    """Path, on the gateway's nodes or in its kernel pods, of the CA bundle remote kernels trust
    (the system CAs, `upstream_ca_file` and the deployment CA: `kernelmode egress-proxy
    --write-ca-bundle FILE` writes it). Set, such kernels get `SSL_CERT_FILE` & co. naming it,
    as local kernels do. Unset, a session with a secret rule on a remote kernel is refused (403):
    its kernel would not trust the certificates the proxy mints."""

    @field_validator("allow", "deny", mode="after")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        return check_patterns(v)

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

    @field_validator("remote_ca_bundle", mode="after")
    @classmethod
    def _bundle_path(cls, v: str | None) -> str | None:
        from ..gateway.launch import PATH_VALUE  # its launch value is checked by the same rule

        if v is not None and not (len(v) <= 255 and PATH_VALUE.fullmatch(v)):
            raise ValueError(f"egress.remote_ca_bundle: {v!r} must be an absolute path of letters, "
                             "digits, '.', '_', '-' and '/' (no '..'), e.g. /etc/kernelmode/egress-ca/ca-bundle.pem")
        return v

    @field_validator("upstream_ca_file", mode="after")
    @classmethod
    def _ca_file(cls, v: Path | None) -> Path | None:
        if v is not None and not v.expanduser().is_file():
            raise ValueError(f"{v} is not a file")
        return None if v is None else v.expanduser().absolute()
