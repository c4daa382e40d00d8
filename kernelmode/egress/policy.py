"""A session's effective egress policy and the proxy's decision on each connection.

The policy is narrowed in two steps (``narrow``): the tenant's ``server.tenants[].egress``, then
the session's request; each can only remove. The decision is pure (no I/O, so it is unit-tested
without packets): ``decide_name`` checks the host and port against the patterns (deny wins) and
refuses IP literals not opened by address; ``decide_addresses`` checks every address the name
resolved to, and the proxy connects only to those it checked (no DNS rebinding window).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.egress import EgressSecret, EgressSettings
from ..errors import EgressRefused
from ..models import EgressInfo, EgressNarrowing
from .patterns import first_uncovered, host_matches, split_pattern

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

METADATA_ADDRESSES = frozenset({ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")})


@dataclass(frozen=True)
class EgressPolicy:
    """What one session may reach. ``allow`` empty: no egress (the session gets no proxy)."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    secrets: tuple[EgressSecret, ...] = ()
    hosts: dict[str, str] = field(default_factory=dict)
    allow_addresses: tuple[IPNetwork, ...] = ()
    upstream_ca_file: Path | None = None
    max_bytes: int = 0
    max_connections: int = 0
    idle_timeout_seconds: float = 60.0

    @property
    def enabled(self) -> bool:
        return bool(self.allow)

    def secrets_for(self, host: str) -> tuple[EgressSecret, ...]:
        return tuple(s for s in self.secrets if host_matches(s.host, host))

    def public(self) -> dict[str, Any] | None:
        """The policy as session info shows it: secret rules without their values."""
        if not self.enabled:
            return None
        return {"allow": list(self.allow), "deny": list(self.deny),
                "secrets": [{"host": s.host, "header": s.header} for s in self.secrets],
                "max_bytes_per_session": self.max_bytes,
                "max_connections_per_session": self.max_connections}


def server_policy(settings: EgressSettings) -> EgressPolicy:
    return EgressPolicy(
        allow=tuple(settings.allow), deny=tuple(settings.deny), secrets=tuple(settings.secrets),
        hosts=dict(settings.hosts),
        allow_addresses=tuple(ipaddress.ip_network(c) for c in settings.allow_addresses),
        upstream_ca_file=settings.upstream_ca_file, max_bytes=settings.max_bytes_per_session,
        max_connections=settings.max_connections_per_session,
        idle_timeout_seconds=settings.idle_timeout_seconds)


def narrow(policy: EgressPolicy, by: EgressNarrowing | None, *, who: str = "this session") -> EgressPolicy:
    """``policy`` narrowed by a tenant's or a session's settings. EgressRefused names the first
    allow pattern that ``policy`` does not cover (or that its deny list refuses outright)."""
    if by is None:
        return policy
    allow = policy.allow
    if by.allow is not None:
        wider = first_uncovered(list(policy.allow), by.allow)
        if wider is None:
            # A host the deny list refuses is refused here too, unless the policy's own allow
            # list names it (a stored session's or a fork's narrowing repeats that list; deny
            # still wins for it at the proxy).
            wider = next((a for a in by.allow if "*" not in a and a not in policy.allow
                          and _denied(policy.deny, *_one(a))), None)
        if wider is not None:
            raise EgressRefused(f"egress to {wider!r} is not allowed for {who}: ask only for hosts "
                                f"within {list(policy.allow)!r}" if policy.allow else
                                f"egress to {wider!r} is not allowed: this server has no egress",
                                details={"host": wider, "allowed": list(policy.allow)})
        allow = tuple(by.allow)
    deny = policy.deny + tuple(d for d in by.deny if d not in policy.deny)
    return EgressPolicy(
        allow=allow, deny=deny, secrets=policy.secrets if allow else (), hosts=policy.hosts,
        allow_addresses=policy.allow_addresses, upstream_ca_file=policy.upstream_ca_file,
        max_bytes=_lower(policy.max_bytes, by.max_bytes_per_session),
        max_connections=_lower(policy.max_connections, by.max_connections_per_session),
        idle_timeout_seconds=policy.idle_timeout_seconds)


def session_policy(settings: EgressSettings, tenant: str, tenant_egress: EgressNarrowing | None,
                   asked: EgressNarrowing | None, *, remote: bool = False) -> EgressPolicy:
    """A new session's policy: the server's, narrowed by its tenant's, then by what it asked for
    (EgressRefused, 403, when it asked for more). ``remote``: its kernel runs on an external
    gateway, which trusts the proxy's CA only with egress.remote_ca_bundle (else a secret rule it
    can reach is refused here, not as a certificate error inside the kernel)."""
    policy = narrow(server_policy(settings), tenant_egress, who=f"tenant {tenant!r}")
    policy = narrow(policy, asked, who=f"tenant {tenant!r}")
    if remote and settings.remote_ca_bundle is None:
        intercepted = next((s.host for s in policy.secrets for a in policy.allow
                            if host_matches(split_pattern(a)[0], s.host) or host_matches(s.host, split_pattern(a)[0])),
                           None)
        if intercepted is not None:
            raise EgressRefused(
                f"egress to {intercepted!r} has a secret rule, which kernels on this server's gateway cannot "
                "use yet: the operator must set egress.remote_ca_bundle (docs/security-model.md); until then "
                "ask only for hosts without one", details={"host": intercepted})
    return policy


def egress_info(policy: EgressPolicy) -> EgressInfo | None:
    """``SessionInfo.egress``: the policy without secret values (None: no egress)."""
    view = policy.public()
    return None if view is None else EgressInfo.model_validate(view)


def narrowing_of(info: EgressInfo | None) -> EgressNarrowing:
    """The narrowing that gives a session's stored policy again (a fork's, a recovered one's)."""
    if info is None:
        return EgressNarrowing(allow=[])
    return EgressNarrowing(allow=info.allow, deny=info.deny, max_bytes_per_session=info.max_bytes_per_session,
                           max_connections_per_session=info.max_connections_per_session)


def stored_policy(settings: EgressSettings, info: EgressInfo | None) -> EgressPolicy:
    """A session's policy rebuilt from its info (after a restart: secrets and addresses come
    from the settings of now). A policy the settings no longer cover is no egress at all."""
    try:
        return narrow(server_policy(settings), narrowing_of(info))
    except EgressRefused:
        return EgressPolicy()


def _lower(cap: int, asked: int | None) -> int:
    return cap if asked is None else min(cap, asked)


def _one(pattern: str) -> tuple[str, int]:
    host, ports = split_pattern(pattern)
    return host, ports[0]


def _denied(deny: Iterable[str], host: str, port: int) -> str | None:
    """The deny pattern that refuses ``host:port`` (one without a port refuses every port)."""
    for rule in deny:
        glob, ports = split_pattern(rule)
        if (":" not in rule or port in ports) and host_matches(glob, host):
            return rule
    return None


# -- the decision ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """The answer for one connection: allowed (with the addresses to connect to), or refused
    with the one-line reason the 403 body and the audit line give."""

    allowed: bool
    host: str
    port: int
    rule: str | None = None  # the allow or deny pattern that decided, or the refusal's kind
    reason: str = ""
    addresses: tuple[str, ...] = ()


def _refuse(host: str, port: int, rule: str, reason: str) -> Decision:
    return Decision(False, host, port, rule, reason)


def not_allowed(host: str) -> str:
    return f"{host} is not in this session's egress allow-list"


def ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def decide_name(policy: EgressPolicy, host: str, port: int) -> Decision:
    """Host and port against the patterns: deny wins, then the first allow that matches. An IP
    literal must also be opened by ``allow_addresses`` (it never goes through a name check)."""
    host = host.strip().rstrip(".").lower()
    if not policy.enabled:
        return _refuse(host, port, "no_egress", "this session has no egress")
    if (rule := _denied(policy.deny, host, port)) is not None:
        return _refuse(host, port, rule, f"{host} is denied by this session's egress policy ({rule})")
    literal = ip_literal(host)
    if literal is not None and not _opened(policy, literal):
        return _refuse(host, port, "ip_literal", f"{host} is an IP address, which egress reaches "
                       "only when egress.allow_addresses opens it")
    allow = next((r for r in policy.allow
                  if port in split_pattern(r)[1] and host_matches(split_pattern(r)[0], host)), None)
    if allow is None:
        where = f"{host}:{port}" if port not in (80, 443) else host
        return _refuse(host, port, "not_allowed", not_allowed(where))
    return Decision(True, host, port, allow, addresses=(str(literal),) if literal else ())


def _opened(policy: EgressPolicy, address: IPAddress) -> bool:
    return any(address.version == net.version and address in net for net in policy.allow_addresses)


def refusal_kind(address: IPAddress, own: frozenset[IPAddress] = frozenset()) -> str | None:
    """Why an address is refused by default, or None for a public address."""
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped or address.sixtofour
        if mapped is not None:  # ::ffff:a.b.c.d and 2002:a.b.c.d::/48 reach the IPv4 address
            inner = refusal_kind(mapped, own)
            if inner is not None:
                return inner
    if address in own:
        return "the manager's own address"
    if address in METADATA_ADDRESSES:
        return "the cloud metadata address"
    if address.is_loopback or address.is_unspecified:  # 0.0.0.0 and :: reach this host
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_private:  # RFC 1918, unique-local fc00::/7, and the other special ranges
        return "a private address"
    if address.is_multicast or address.is_reserved or not address.is_global:
        return "not a public address"
    return None


def decide_addresses(policy: EgressPolicy, decision: Decision, resolved: Iterable[str],
                     own: frozenset[IPAddress] = frozenset()) -> Decision:
    """The name's resolved addresses, each checked: one refused address refuses the name (a
    resolver answer that mixes public and private addresses is a rebinding attempt as often as
    not). The allowed decision carries exactly the addresses checked."""
    addresses: list[str] = []
    for text in resolved:
        address = ipaddress.ip_address(text)
        if not _opened(policy, address) and (kind := refusal_kind(address, own)) is not None:
            return _refuse(decision.host, decision.port, "address",
                           f"{decision.host} resolves to {address}, {kind}, which egress does not reach")
        if str(address) not in addresses:
            addresses.append(str(address))
    if not addresses:
        return _refuse(decision.host, decision.port, "unresolved", f"{decision.host} does not resolve")
    return Decision(True, decision.host, decision.port, decision.rule, addresses=tuple(addresses))
