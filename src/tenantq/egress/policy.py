"""Egress rules: `api.stripe.com`, `*.salesforce.com:443`, `10.0.0.7:8080`.

A rule names one host (or, with a leading `*.`, every subdomain of one, not
the domain itself) and optionally a port; without a port it allows 80 and
443. A tenant's rules are stored with the tenant (`tenantq tenant set T
--egress ...`, default: none, so no egress at all). A handler may narrow
them (`@tenantq.handler(..., egress=[...])`): a request must then match both
lists, so a handler can never widen what its tenant allows.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from tenantq.errors import InvalidInput

DEFAULT_PORTS = (80, 443)
MAX_RULES = 64
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True)
class Rule:
    host: str  # lower case, no trailing dot; "*.example.com" for subdomains
    port: int | None = None

    def matches(self, host: str, port: int) -> bool:
        if self.port is None and port not in DEFAULT_PORTS:
            return False
        if self.port is not None and port != self.port:
            return False
        host = normalise_host(host)
        if self.host.startswith("*."):
            return host.endswith(self.host[1:]) and host != self.host[2:]
        return host == self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


def normalise_host(host: str) -> str:
    return host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")


def valid_host(host: str) -> bool:
    """An IP literal or a DNS name (labels of 1-63 letters, digits, hyphens; 253 in all); `*.` allowed."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    name = host[2:] if host.startswith("*.") else host
    labels = name.split(".")
    return len(name) <= 253 and len(labels) >= 1 and all(_LABEL.match(label) for label in labels) \
        and not (host.startswith("*.") and len(labels) < 2)


def parse_rule(text: str) -> Rule:
    raw = text.strip()
    host, port = raw, None
    if raw.startswith("["):  # [v6]:port
        end = raw.find("]")
        host, rest = raw[1:end], raw[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise InvalidInput(f"egress rule {text!r}: expected [address]:port")
            port = rest[1:]
    elif raw.count(":") == 1:
        host, port = raw.split(":")
    host = normalise_host(host)
    if not host or not valid_host(host):
        raise InvalidInput(f"egress rule {text!r}: not a host name, *.domain or IP address")
    if port is None:
        return Rule(host)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidInput(f"egress rule {text!r}: port must be 1-65535")
    return Rule(host, int(port))


def parse_rules(rules: str | Iterable[str]) -> tuple[Rule, ...]:
    """`"a.com, *.b.com:443"` or a list of rules; empty means no egress."""
    items = rules.split(",") if isinstance(rules, str) else list(rules)
    parsed = tuple(dict.fromkeys(parse_rule(r) for r in items if r.strip()))
    if len(parsed) > MAX_RULES:
        raise InvalidInput(f"at most {MAX_RULES} egress rules per tenant, got {len(parsed)}")
    return parsed


@dataclass(frozen=True)
class EgressPolicy:
    """What one batch may reach: its tenant's rules, narrowed per handler."""

    tenant: str
    rules: tuple[Rule, ...]

    def allows(self, host: str, port: int, narrowed: tuple[Rule, ...] | None = None) -> bool:
        if not any(r.matches(host, port) for r in self.rules):
            return False
        return narrowed is None or any(r.matches(host, port) for r in narrowed)

    def __bool__(self) -> bool:
        return bool(self.rules)
