"""The egress proxy's address guard: only globally routable unicast gets
through, however an internal address is spelled (IPv4, or IPv6 carrying
IPv4: mapped, compatible, 6to4, Teredo, NAT64); the operator's allow-list
admits exactly the addresses it names; garbage is refused, never raised."""

from __future__ import annotations

import ipaddress
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenantq.egress.guard import AddressGuard, embedded_ipv4
from tenantq.egress.policy import EgressPolicy, parse_rules
from tenantq.egress.proxy import EgressHub

# address -> the start of its refusal, or None when it must get through
TABLE: dict[str, str | None] = {
    # IPv4
    "100.100.100.200": "shared address 100.100.100.200 (100.64.0.0/10)",  # cloud metadata (Alibaba)
    "100.64.0.1": "shared address 100.64.0.1",
    "100.127.255.254": "shared address",
    "169.254.169.254": "link-local address 169.254.169.254",
    "127.0.0.1": "loopback address 127.0.0.1",
    "127.255.255.254": "loopback",
    "10.0.0.1": "private address 10.0.0.1",
    "172.16.0.1": "private address 172.16.0.1",
    "172.31.255.255": "private",
    "192.168.1.1": "private address 192.168.1.1",
    "0.0.0.0": "unspecified address 0.0.0.0",
    "0.1.2.3": "this-network address 0.1.2.3",
    "255.255.255.255": "broadcast address 255.255.255.255",
    "224.0.0.1": "multicast address 224.0.0.1",
    "239.255.255.250": "multicast",
    "192.0.0.1": "special-purpose address 192.0.0.1",
    "198.18.0.1": "benchmarking address 198.18.0.1",
    "192.0.2.1": "documentation address 192.0.2.1",
    "203.0.113.7": "documentation",
    "240.0.0.1": "reserved address 240.0.0.1",
    # IPv6
    "::1": "loopback address ::1",
    "::": "unspecified address ::",
    "fe80::1": "link-local address fe80::1",
    "fe80::1%eth0": "link-local address fe80::1 ",  # the zone is dropped
    "fec0::1": "site-local",
    "fc00::1": "unique-local address fc00::1",
    "fd12:3456::1": "unique-local",
    "ff02::1": "multicast address ff02::1",
    "ff0e::1": "multicast",
    "100::1": "discard-only",
    "2001:db8::1": "documentation",
    "5f00::1": "reserved address 5f00::1 (outside 2000::/3)",
    # IPv6 carrying a non-global IPv4
    "::ffff:127.0.0.1":
        "loopback address 127.0.0.1 (127.0.0.0/8) inside the IPv4-mapped address ::ffff:127.0.0.1",
    "::ffff:169.254.169.254": "link-local address 169.254.169.254 (169.254.0.0/16) inside the IPv4-mapped",
    "::ffff:100.100.100.200": "shared address 100.100.100.200",
    "::127.0.0.1": "loopback address 127.0.0.1 (127.0.0.0/8) inside the IPv4-compatible address ::127.0.0.1",
    "::10.0.0.1": "private address 10.0.0.1",
    "2002:7f00:0001::1": "loopback address 127.0.0.1 (127.0.0.0/8) inside the 6to4 address 2002:7f00:0001::1",
    "2002:0a00:0001::": "private address 10.0.0.1 (10.0.0.0/8) inside the 6to4 address",
    "2002:a9fe:a9fe::1": "link-local address 169.254.169.254",
    "2002:e000:0001::1": "multicast address 224.0.0.1",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2":  # Teredo: server 65.54.227.120, client 192.0.2.45
        "documentation address 192.0.2.45 (192.0.2.0/24) as the client of the Teredo address",
    "2001:0:7f00:1::1": "loopback address 127.0.0.1 (127.0.0.0/8) as the server of the Teredo address",
    "2001:0:808:808:0:f7f7:f7f7:f7f7":  # a global server and client: Teredo is still not global
        "Teredo address 2001:0:808:808:0:f7f7:f7f7:f7f7 (2001::/32)",
    "64:ff9b::127.0.0.1": "loopback address 127.0.0.1 (127.0.0.0/8) inside the NAT64 address",
    "64:ff9b::a9fe:a9fe": "link-local address 169.254.169.254 (169.254.0.0/16) inside the NAT64 address",
    "64:ff9b::100.100.100.200": "shared address 100.100.100.200",
    "64:ff9b:1::10.0.0.1": "private address 10.0.0.1 (10.0.0.0/8) inside the local-use NAT64 address",
    "64:ff9b:1::8.8.8.8": "local-use NAT64 address 64:ff9b:1::8.8.8.8 (64:ff9b:1::/48)",
    "::8.8.8.8": "deprecated IPv4-compatible address ::8.8.8.8",
    # globally routable unicast
    "8.8.8.8": None,
    "1.1.1.1": None,
    "93.184.216.34": None,
    "2606:4700:4700::1111": None,
    "2a00:1450:4001:80b::200e": None,
    "2002:0808:0808::1": None,  # 6to4 of 8.8.8.8
    "64:ff9b::8.8.8.8": None,  # NAT64 (well-known prefix) of 8.8.8.8
    "::ffff:8.8.8.8": None,
}
GARBAGE = ["", " ", "garbage", "localhost", "1.2.3", "1.2.3.4.5", "256.1.1.1", "01.2.3.4", "8.8.8.8 ",
           " 8.8.8.8", "8.8.8.8\n", "8.8.8.8/32", "[::1]", "::1::", "fe80::1%", "1.2.3.4%eth0",
           "\x00", "::ffff:1.2.3.4.5", "2002:7f00:1::1:1:1:1:1:1", "\udcff", "x" * 10_000]


@pytest.mark.parametrize(("address", "refused"), list(TABLE.items()))
def test_only_globally_routable_unicast_gets_through(address: str, refused: str | None) -> None:
    reason = AddressGuard().refusal(address)
    if refused is None:
        assert reason is None, f"{address} was refused: {reason}"
        return
    assert reason is not None, f"{address} got through"
    assert reason.startswith(refused), reason
    assert reason.endswith(", which is not globally routable"), reason
    assert "\n" not in reason


def test_the_table_covers_what_it_must() -> None:
    assert len(TABLE) >= 30
    assert sum(v is None for v in TABLE.values()) >= 5


@pytest.mark.parametrize("address", GARBAGE)
def test_garbage_is_refused_and_never_raises(address: str) -> None:
    reason = AddressGuard(["127.0.0.1/32"]).refusal(address)
    assert reason is not None and reason.startswith("malformed address ")
    assert "\n" not in reason and len(reason) < 100, reason


@pytest.mark.parametrize("value", [None, 134744072, b"\x08\x08\x08\x08", ipaddress.ip_address("8.8.8.8")])
def test_non_strings_are_refused(value: object) -> None:
    # ipaddress.ip_address would take an int or packed bytes; the guard takes text only
    assert AddressGuard().refusal(value) is not None  # type: ignore[arg-type]


def test_random_bytes_never_raise() -> None:
    rng = random.Random(6598)
    guard = AddressGuard(["127.0.0.1/32", "::1/128"])
    for _ in range(2000):
        text = "".join(rng.choice("0123456789abcdef:.%f[]/ ") for _ in range(rng.randint(0, 45)))
        reason = guard.refusal(text)
        assert reason is None or "\n" not in reason


def test_random_global_ipv4_in_every_wrapper_passes_and_internal_never_does() -> None:
    rng = random.Random(4291)
    guard = AddressGuard()
    for _ in range(3000):
        v4 = ipaddress.IPv4Address(rng.getrandbits(32))
        six_to_four = ipaddress.IPv6Address((0x2002 << 112) | (int(v4) << 80) | 1)
        spellings = [f"::ffff:{v4}", f"64:ff9b::{v4}", str(six_to_four)]
        admitted = [guard.refusal(s) is None for s in spellings]
        if guard.refusal(str(v4)) is None:
            assert all(admitted), (v4, spellings)
        else:
            assert not any(admitted), (v4, spellings)
        # the deprecated IPv4-compatible and the local-use NAT64 spellings never pass
        assert guard.refusal(f"::{v4}") is not None
        assert guard.refusal(f"64:ff9b:1::{v4}") is not None


def test_embedded_ipv4_finds_every_form() -> None:
    def found(address: str) -> list[str]:
        return [str(v4) for _, v4 in embedded_ipv4(ipaddress.IPv6Address(address))]

    assert found("::ffff:10.1.2.3") == ["10.1.2.3"]
    assert found("::10.1.2.3") == ["10.1.2.3"]
    assert found("::1") == [] and found("::") == []
    assert found("2002:0a01:0203::5") == ["10.1.2.3"]
    assert found("2001:0:4136:e378:8000:63bf:3fff:fdd2") == ["65.54.227.120", "192.0.2.45"]
    assert found("64:ff9b::10.1.2.3") == ["10.1.2.3"]
    assert found("64:ff9b:1::10.1.2.3") == ["10.1.2.3"]
    assert found("2606:4700:4700::1111") == []


def test_the_allow_list_admits_exactly_what_it_names_as_given() -> None:
    guard = AddressGuard(["127.0.0.1/32", "10.20.0.0/16"])
    assert guard.refusal("127.0.0.1") is None
    assert guard.refusal("10.20.30.40") is None
    assert guard.refusal("127.0.0.2") is not None
    assert guard.refusal("10.21.0.1") is not None
    assert guard.refusal("169.254.169.254") is not None
    assert guard.refusal("100.100.100.200") is not None
    # an IPv6 spelling of an allowed IPv4 address is judged on its own
    for wrapped in ("::ffff:127.0.0.1", "::127.0.0.1", "2002:7f00:1::1", "64:ff9b::127.0.0.1",
                    "::ffff:10.20.30.40", "64:ff9b::a14:1e28"):
        reason = guard.refusal(wrapped)
        assert reason is not None and "inside the" in reason, (wrapped, reason)
    assert guard.refusal("8.8.8.8") is None, "the allow-list adds, it never removes"


def test_an_allowed_ipv6_network_matches_ipv6_only() -> None:
    guard = AddressGuard(["::1/128", "fd00:1::/32"])
    assert guard.refusal("::1") is None
    assert guard.refusal("fd00:1::5") is None
    assert guard.refusal("fe80::1%lo") is not None
    assert guard.refusal("127.0.0.1") is not None


@pytest.fixture
def strict_hub() -> Iterator[EgressHub]:
    hub = EgressHub(AddressGuard(["127.0.0.1/32"]))  # as the proxy tests and TENANTQ_EGRESS_ALLOW_NETWORKS
    yield hub
    hub.shutdown()


def _ask(path: Path, head: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(head)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_the_proxy_refuses_metadata_and_wrapped_loopback(strict_hub: EgressHub, tmp_path: Path) -> None:
    targets = {"100.100.100.200:80": "shared address 100.100.100.200",
               "169.254.169.254:80": "link-local address 169.254.169.254",
               "[::ffff:127.0.0.1]:80": "loopback address 127.0.0.1",
               "[2002:7f00:1::1]:80": "loopback address 127.0.0.1",
               "[64:ff9b::a9fe:a9fe]:80": "link-local address 169.254.169.254"}
    policy = EgressPolicy("acme", parse_rules(",".join(targets)))
    proxy = strict_hub.open(tmp_path / "g.sock", policy, lambda: (7, None))
    for target, why in targets.items():
        reply = _ask(proxy.path, f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
        status = reply.split(b"\r\n")[0].decode()
        shown = target.replace("[", "").replace("]", "")
        assert status.startswith(f"HTTP/1.1 403 tenantq egress: {shown} resolves to a {why}"), status
    stats = strict_hub.close(proxy)
    assert (stats.allowed, stats.blocked) == (0, len(targets))
