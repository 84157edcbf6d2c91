"""Which resolved addresses the egress proxy may connect a sandbox to:
globally routable unicast only, so no job reaches the host, its Postgres,
the cloud metadata service (169.254.169.254, 100.100.100.200) or anything
else inside, whichever spelling of an internal address a resolver returns.

An IPv6 address that carries an IPv4 address (IPv4-mapped, IPv4-compatible,
6to4, Teredo server and client, NAT64) is refused when any IPv4 inside it is
not global. Besides `ipaddress`' `is_global` (which differs between Python
releases), the IANA special-purpose registries are spelled out below, so an
address is refused when either says it is not global, on every Python.
IPv6 outside 2000::/3 (the only space IANA allocates for global unicast) is
refused, except the forms whose destination is their IPv4 address.
(docs/security.md, rule E1.)
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

SHOWN_CHARS = 60  # of a malformed address, repeated in the refusal


def _v4(label: str, *networks: str) -> tuple[str, tuple[IPv4Network, ...]]:
    return label, tuple(IPv4Network(n) for n in networks)


def _v6(label: str, *networks: str) -> tuple[str, tuple[IPv6Network, ...]]:
    return label, tuple(IPv6Network(n) for n in networks)


# Not globally reachable, most specific first: the first match names the refusal.
V4_SPECIAL = (
    _v4("unspecified", "0.0.0.0/32"),
    _v4("this-network", "0.0.0.0/8"),
    _v4("loopback", "127.0.0.0/8"),
    _v4("private", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"),
    _v4("shared", "100.64.0.0/10"),  # RFC 6598 (carrier-grade NAT; cloud metadata at 100.100.100.200)
    _v4("link-local", "169.254.0.0/16"),
    _v4("special-purpose", "192.0.0.0/24"),  # IETF protocol assignments
    _v4("documentation", "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24"),
    _v4("benchmarking", "198.18.0.0/15"),
    _v4("multicast", "224.0.0.0/4"),
    _v4("broadcast", "255.255.255.255/32"),
    _v4("reserved", "240.0.0.0/4"),
)
V6_SPECIAL = (
    _v6("unspecified", "::/128"),
    _v6("loopback", "::1/128"),
    _v6("multicast", "ff00::/8"),
    _v6("link-local", "fe80::/10"),
    _v6("site-local", "fec0::/10"),  # deprecated, RFC 3879
    _v6("unique-local", "fc00::/7"),
    _v6("discard-only", "100::/64"),
    _v6("Teredo", "2001::/32"),
    _v6("special-purpose", "2001::/23"),  # IETF protocol assignments
    _v6("documentation", "2001:db8::/32", "3fff::/20"),
    _v6("local-use NAT64", "64:ff9b:1::/48"),
    _v6("deprecated IPv4-compatible", "::/96"),
)
GLOBAL_UNICAST = IPv6Network("2000::/3")
IPV4_COMPATIBLE = IPv6Network("::/96")
NAT64 = IPv6Network("64:ff9b::/96")  # the well-known prefix, RFC 6052
NAT64_LOCAL = IPv6Network("64:ff9b:1::/48")  # RFC 8215
SIX_TO_FOUR = IPv6Network("2002::/16")


class AddressGuard:
    """Which resolved addresses a sandbox may never be connected to."""

    def __init__(self, allowed_networks: Iterable[str] = ()) -> None:
        # only for tests and deliberate setups: a test server on 127.0.0.1
        self.allowed = tuple(ipaddress.ip_network(n, strict=False) for n in allowed_networks)

    def refusal(self, address: str) -> str | None:
        """None when a sandbox may connect to `address`, else why not (one
        line, naming the address). Never raises, whatever `address` is."""
        ip = _parse(address)
        if ip is None:
            return f"malformed address {_shown(address)}"
        # as given: an IPv6 spelling of an allowed IPv4 address is not allowed
        if any(ip in net for net in self.allowed):
            return None
        return not_global(ip, address.partition("%")[0])


def not_global(ip: IPv4Address | IPv6Address, shown: str | None = None) -> str | None:
    """Why `ip` is not a globally routable unicast address, or None if it is.
    `shown` is how the address was written (a valid address, so one line)."""
    shown = shown or str(ip)
    if isinstance(ip, IPv4Address):
        why = _v4_refusal(ip, shown)
        return None if why is None else f"{why}, which is not globally routable"
    for where, inner in embedded_ipv4(ip):
        why = _v4_refusal(inner, str(inner))
        if why is not None:
            return f"{why} {where} {shown}, which is not globally routable"
    if ip.ipv4_mapped is not None or ip in SIX_TO_FOUR or ip in NAT64:
        return None  # the IPv4 address inside is the destination, and it is global
    why = _v6_refusal(ip, shown)
    return None if why is None else f"{why}, which is not globally routable"


def embedded_ipv4(ip: IPv6Address) -> list[tuple[str, IPv4Address]]:
    """The IPv4 addresses an IPv6 address carries, each with where it sits."""
    found: list[tuple[str, IPv4Address]] = []
    low32 = IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.ipv4_mapped is not None:
        found.append(("inside the IPv4-mapped address", ip.ipv4_mapped))
    elif ip in IPV4_COMPATIBLE and int(ip) > 1:  # :: and ::1 are themselves
        found.append(("inside the IPv4-compatible address", low32))
    if ip.sixtofour is not None:
        found.append(("inside the 6to4 address", ip.sixtofour))
    if ip.teredo is not None:
        server, client = ip.teredo
        found += [("as the server of the Teredo address", server),
                  ("as the client of the Teredo address", client)]
    if ip in NAT64:
        found.append(("inside the NAT64 address", low32))
    elif ip in NAT64_LOCAL:
        found.append(("inside the local-use NAT64 address", low32))
    return found


def _v4_refusal(ip: IPv4Address, shown: str) -> str | None:
    for label, networks in V4_SPECIAL:
        for net in networks:
            if ip in net:
                return f"{label} address {shown} ({net})"
    if not ip.is_global or ip.is_multicast:
        return f"non-global address {shown}"
    return None


def _v6_refusal(ip: IPv6Address, shown: str) -> str | None:
    for label, networks in V6_SPECIAL:
        for net in networks:
            if ip in net:
                return f"{label} address {shown} ({net})"
    if ip not in GLOBAL_UNICAST:
        return f"reserved address {shown} (outside {GLOBAL_UNICAST})"
    if not ip.is_global or ip.is_multicast:
        return f"non-global address {shown}"
    return None


def _parse(address: object) -> IPv4Address | IPv6Address | None:
    """An address as getaddrinfo gives it; an IPv6 zone (fe80::1%eth0) is dropped."""
    if not isinstance(address, str):  # ip_address() would also take ints and packed bytes
        return None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    return IPv6Address(int(ip)) if isinstance(ip, IPv6Address) else ip


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
