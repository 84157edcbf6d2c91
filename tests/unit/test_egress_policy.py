"""Egress rules: parsing (one-line errors), matching, narrowing."""

from __future__ import annotations

import pytest

from tenantq.egress.policy import EgressPolicy, Rule, parse_rule, parse_rules
from tenantq.egress.proxy import AddressGuard
from tenantq.errors import InvalidInput


@pytest.mark.parametrize(("text", "rule"), [
    ("api.stripe.com", Rule("api.stripe.com")),
    ("API.Stripe.com.", Rule("api.stripe.com")),
    ("*.salesforce.com:443", Rule("*.salesforce.com", 443)),
    ("10.0.0.7:8080", Rule("10.0.0.7", 8080)),
    ("[::1]:8443", Rule("::1", 8443)),
])
def test_rules_parse(text: str, rule: Rule) -> None:
    assert parse_rule(text) == rule


@pytest.mark.parametrize(("text", "message"), [
    ("exa mple.com", "not a host name"),
    ("*.com", "not a host name"),
    ("a.*.com", "not a host name"),
    ("-bad.com", "not a host name"),
    ("ok.com:0", "port must be 1-65535"),
    ("ok.com:99999", "port must be 1-65535"),
    ("ok.com:http", "port must be 1-65535"),
    ("http://ok.com", "egress rule .http://ok.com.: "),
])
def test_bad_rules_are_refused_with_one_line(text: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=message) as err:
        parse_rule(text)
    assert "\n" not in str(err.value)


def test_a_list_is_deduplicated_and_bounded() -> None:
    assert parse_rules("a.com, a.com ,b.com:8080,") == (Rule("a.com"), Rule("b.com", 8080))
    assert parse_rules("") == ()
    with pytest.raises(InvalidInput, match="at most 64"):
        parse_rules([f"h{i}.com" for i in range(65)])


@pytest.mark.parametrize(("rule", "host", "port", "allowed"), [
    ("api.stripe.com", "api.stripe.com", 443, True),
    ("api.stripe.com", "API.STRIPE.COM.", 80, True),
    ("api.stripe.com", "api.stripe.com", 8443, False),  # no port: 80 and 443 only
    ("api.stripe.com", "evil-api.stripe.com", 443, False),
    ("api.stripe.com", "api.stripe.com.evil.com", 443, False),
    ("*.salesforce.com:443", "eu.salesforce.com", 443, True),
    ("*.salesforce.com:443", "a.b.salesforce.com", 443, True),
    ("*.salesforce.com:443", "salesforce.com", 443, False),
    ("*.salesforce.com:443", "evilsalesforce.com", 443, False),
    ("*.salesforce.com:443", "eu.salesforce.com", 80, False),
    ("127.0.0.1:9000", "127.0.0.1", 9000, True),
])
def test_matching(rule: str, host: str, port: int, allowed: bool) -> None:
    assert parse_rule(rule).matches(host, port) is allowed


def test_a_handler_narrows_but_never_widens() -> None:
    policy = EgressPolicy("acme", parse_rules("api.stripe.com,*.salesforce.com"))
    assert policy.allows("api.stripe.com", 443)
    narrowed = parse_rules("api.stripe.com,pastebin.com")
    assert policy.allows("api.stripe.com", 443, narrowed)
    assert not policy.allows("eu.salesforce.com", 443, narrowed), "narrowed away"
    assert not policy.allows("pastebin.com", 443, narrowed), "a handler cannot widen"
    assert not EgressPolicy("acme", ()).allows("api.stripe.com", 443)


@pytest.mark.parametrize(("address", "refused"), [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.5", "private"),
    ("172.16.0.1", "private"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("0.0.0.0", "unspecified"), ("::ffff:127.0.0.1", "loopback"), ("224.0.0.1", "multicast"),
    ("93.184.216.34", None), ("2606:2800:220:1::1", None),
])
def test_the_guard_refuses_internal_addresses(address: str, refused: str | None) -> None:
    reason = AddressGuard().refusal(address)
    assert (reason is None) if refused is None else (reason is not None and reason.startswith(refused))


def test_the_guard_allows_exactly_the_configured_networks() -> None:
    guard = AddressGuard(["127.0.0.1/32"])
    assert guard.refusal("127.0.0.1") is None
    assert guard.refusal("127.0.0.2") is not None
    assert guard.refusal("10.0.0.1") is not None
