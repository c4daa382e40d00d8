"""The egress decision, pure (no packets): patterns, deny, narrowing, and the addresses refused by
default (loopback, the metadata address, private and unique-local ranges, the manager's own)."""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import ValidationError

from kernelmode.config import EgressNarrowing, EgressSettings, Settings
from kernelmode.egress.policy import decide_addresses, decide_name, narrow, server_policy
from kernelmode.errors import EgressRefused

POLICY = server_policy(EgressSettings(
    allow=["api.github.com", "*.githubusercontent.com", "files.example.com:8443", "10.1.2.3", "*.lan"],
    deny=["gist.githubusercontent.com"], allow_addresses=["10.1.2.0/24"],
    secrets=[{"host": "api.github.com", "header": "Authorization", "value": "Bearer s3cret"}]))


@pytest.mark.parametrize(("host", "port", "allowed", "rule"), [
    ("api.github.com", 443, True, "api.github.com"),
    ("API.GitHub.com.", 80, True, "api.github.com"),
    ("api.github.com", 8443, False, "not_allowed"),
    ("raw.githubusercontent.com", 443, True, "*.githubusercontent.com"),
    ("a.b.githubusercontent.com", 443, True, "*.githubusercontent.com"),
    ("githubusercontent.com", 443, False, "not_allowed"),
    ("gist.githubusercontent.com", 443, False, "gist.githubusercontent.com"),  # deny wins
    ("files.example.com", 8443, True, "files.example.com:8443"),
    ("files.example.com", 443, False, "not_allowed"),
    ("example.com", 443, False, "not_allowed"),
    ("evil-api.github.com", 443, False, "not_allowed"),
    ("10.1.2.3", 80, True, "10.1.2.3"),             # a literal opened by allow_addresses and named
    ("10.1.2.4", 80, False, "not_allowed"),          # opened by address but not named
    ("169.254.169.254", 80, False, "ip_literal"),
    ("127.0.0.1", 80, False, "ip_literal"),
    ("[::1]", 443, False, "ip_literal"),
])
def test_name_decision(host: str, port: int, allowed: bool, rule: str) -> None:
    d = decide_name(POLICY, host, port)
    assert (d.allowed, d.rule) == (allowed, rule)
    if not allowed:
        assert host.strip("[]").lower().rstrip(".") in d.reason


def test_refusal_says_allow_list() -> None:
    assert decide_name(POLICY, "example.com", 443).reason == \
        "example.com is not in this session's egress allow-list"


@pytest.mark.parametrize(("address", "kind"), [
    ("127.0.0.1", "loopback"), ("127.0.0.2", "loopback"), ("::1", "loopback"),
    ("169.254.169.254", "metadata"), ("fd00:ec2::254", "metadata"), ("169.254.1.1", "link-local"),
    ("fe80::1", "link-local"), ("10.0.0.1", "private"), ("172.16.5.4", "private"),
    ("192.168.1.1", "private"), ("fd12:3456::1", "private"), ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:169.254.169.254", "metadata"), ("2002:a9fe:a9fe::1", "metadata"),
    ("0.0.0.0", "loopback"), ("::", "loopback"), ("100.64.0.1", "not a public"), ("224.0.0.1", "not a public"),
    ("192.0.2.1", "private"),
])
def test_addresses_refused_by_default(address: str, kind: str) -> None:
    d = decide_addresses(POLICY, decide_name(POLICY, "x.lan", 443), [address])
    assert not d.allowed and d.rule == "address" and kind in d.reason, d.reason


def test_public_address_allowed_and_exactly_the_checked_ones_kept() -> None:
    d = decide_addresses(POLICY, decide_name(POLICY, "x.lan", 443), ["140.82.112.5", "140.82.112.5"])
    assert d.allowed and d.addresses == ("140.82.112.5",)


def test_one_refused_address_refuses_the_name() -> None:
    d = decide_addresses(POLICY, decide_name(POLICY, "x.lan", 443), ["140.82.112.5", "10.9.9.9"])
    assert not d.allowed and "10.9.9.9" in d.reason


def test_allow_addresses_opens_a_range_only() -> None:
    name = decide_name(POLICY, "x.lan", 443)
    assert decide_addresses(POLICY, name, ["10.1.2.77"]).allowed
    assert not decide_addresses(POLICY, name, ["10.1.3.1"]).allowed


def test_manager_own_address_refused() -> None:
    own = frozenset({ipaddress.ip_address("140.82.112.5")})
    d = decide_addresses(POLICY, decide_name(POLICY, "x.lan", 443), ["140.82.112.5"], own)
    assert not d.allowed and "manager's own" in d.reason


def test_no_egress_refuses_everything() -> None:
    d = decide_name(server_policy(EgressSettings()), "api.github.com", 443)
    assert not d.allowed and d.rule == "no_egress"


def test_narrowing() -> None:
    tenant = narrow(POLICY, EgressNarrowing(allow=["*.githubusercontent.com"], deny=["x.githubusercontent.com"],
                                            max_connections_per_session=4), who="tenant 't'")
    assert tenant.allow == ("*.githubusercontent.com",) and tenant.max_connections == 4
    assert "x.githubusercontent.com" in tenant.deny and "gist.githubusercontent.com" in tenant.deny
    session = narrow(tenant, EgressNarrowing(allow=["raw.githubusercontent.com"]))
    assert session.allow == ("raw.githubusercontent.com",) and session.max_connections == 4
    for wider in (["api.github.com"], ["*.com"], ["raw.githubusercontent.com:8080"],
                  ["gist.githubusercontent.com"]):
        with pytest.raises(EgressRefused) as e:
            narrow(tenant, EgressNarrowing(allow=wider))
        assert e.value.code == "egress_refused" and e.value.http_status == 403
        assert wider[0] in e.value.message


def test_public_view_has_no_secret_values() -> None:
    view = POLICY.public()
    assert view is not None and view["secrets"] == [{"host": "api.github.com", "header": "Authorization"}]
    assert "s3cret" not in repr(view)


def test_settings_refuse_bad_entries_and_wider_tenants() -> None:
    for bad in ({"allow": ["http://x.com"]}, {"allow": ["x.com:99999"]}, {"hosts": {"a.test": "nope"}},
                {"allow_addresses": ["10.0.0.0/33"]},
                {"secrets": [{"host": "x.com", "header": "A", "value": "v\r\nX: y"}]}):
        with pytest.raises(ValidationError):
            EgressSettings.model_validate(bad)
    with pytest.raises(ValidationError, match="only narrow"):
        Settings.model_validate({"egress": {"allow": ["a.com"]}, "server": {"tenants": [
            {"name": "t", "token": "t" * 16, "egress": {"allow": ["*.com"]}}]}})


def test_deny_without_a_port_refuses_every_port() -> None:
    policy = server_policy(EgressSettings(allow=["*.example.com:8443", "*.example.com"],
                                          deny=["bad.example.com", "odd.example.com:8443"]))
    assert not decide_name(policy, "bad.example.com", 8443).allowed
    assert not decide_name(policy, "odd.example.com", 8443).allowed
    assert decide_name(policy, "odd.example.com", 443).allowed


def test_a_stored_or_forked_policy_keeps_an_allowed_host_its_deny_list_refuses() -> None:
    """An allow entry that deny also refuses (deny wins at the proxy) must not turn a session's
    stored policy into no egress at all, nor its fork into a 403; asking for it anew still is one."""
    from kernelmode.egress.policy import egress_info, narrowing_of, stored_policy
    settings = EgressSettings(allow=["a.example.com", "b.example.com"], deny=["b.example.com"])
    policy = server_policy(settings)
    again = stored_policy(settings, egress_info(policy))
    assert again == policy and decide_name(again, "b.example.com", 443).allowed is False
    assert narrow(policy, narrowing_of(egress_info(policy))) == policy  # a fork
    with pytest.raises(EgressRefused):
        narrow(server_policy(EgressSettings(allow=["*.example.com"], deny=["b.example.com"])),
               EgressNarrowing(allow=["b.example.com"]))
