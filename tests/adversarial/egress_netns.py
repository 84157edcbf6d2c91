"""Run inside a network and mount namespace of its own (`unshare --net --mount`,
started by tests/adversarial/test_egress_dns.py): a resolver the test controls
for the egress proxy (docs/security.md rules E1 and E3, docs/egress.md).

The namespace has only its loopback; /etc/resolv.conf is bound, in this mount
namespace only, to a file naming a tiny DNS server on 127.0.0.1:53 that this
process runs and that logs every question. Addresses the proxy must never
connect to (cloud metadata, RFC 6598, private, loopback, and their IPv6
wrappings) are added to the namespace's `lo`, each with a trap listener on the
port the rules allow: nothing outside this namespace can reach them, and a
connection to one is seen. A global address (8.8.8.8) gets a listener too, as
the control that shows a connection would be seen.

    python -m tests.adversarial.egress_netns_main SCENARIO WORKDIR
    # prints one line: {"problems": [...], "notes": [...]}
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tenantq.egress.inject import Injection
from tenantq.egress.policy import EgressPolicy, parse_rule, parse_rules
from tenantq.egress.proxy import AddressGuard, BatchProxy, EgressHub
from tenantq.egress.tls import TenantCA, upstream_context
from tests.adversarial.egress_upstream import Upstream, UpstreamCA
from tests.adversarial.egress_world import head_only, status_of

TRAPS_V4 = ("127.0.0.2", "169.254.169.254", "100.100.100.200", "10.0.0.1", "192.168.1.1", "172.16.0.1",
            "192.0.2.1", "198.18.0.1")
TRAPS_V6 = ("2002:a9fe:a9fe::1", "64:ff9b::a9fe:a9fe", "64:ff9b:1::a9fe:a9fe",
            "2001:0:4136:e378:8000:63bf:5601:5601", "fc00::1", "::1")
GLOBAL_V4 = "8.8.8.8"
# name (under inside.test) -> the answers its A and AAAA questions get
INSIDE: dict[str, list[str]] = {
    "meta": ["169.254.169.254"], "shared": ["100.100.100.200"], "private": ["10.0.0.1"],
    "private2": ["192.168.1.1"], "private3": ["172.16.0.1"], "doc": ["192.0.2.1"], "bench": ["198.18.0.1"],
    "loop2": ["127.0.0.2"], "unspecified": ["0.0.0.0"], "mapped": ["::ffff:169.254.169.254"],
    "mapped-loop": ["::ffff:127.0.0.2"], "sixtofour": ["2002:a9fe:a9fe::1"], "nat64": ["64:ff9b::a9fe:a9fe"],
    "nat64-local": ["64:ff9b:1::a9fe:a9fe"], "teredo": ["2001:0:4136:e378:8000:63bf:5601:5601"],
    "ula": ["fc00::1"], "loop6": ["::1"], "mixed": ["127.0.0.1", "169.254.169.254"],
    "mixed-v6": ["127.0.0.1", "::ffff:169.254.169.254"], "control": [GLOBAL_V4],
}


# -- the resolver ---------------------------------------------------------------------------


class Resolver(threading.Thread):
    """UDP DNS on 127.0.0.1:53: `answer(name, qtype, nth)` gives the addresses
    for the nth question of that (name, type); None is NXDOMAIN."""

    def __init__(self, answer: Callable[[str, int, int], list[str] | None]) -> None:
        super().__init__(daemon=True)
        self.answer = answer
        self.asked: list[str] = []
        self.counts: dict[tuple[str, int], int] = {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 53))

    def run(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
                self.sock.sendto(self.reply(data), peer)
            except OSError:
                return
            except (ValueError, IndexError, struct.error):
                continue

    def reply(self, query: bytes) -> bytes:
        qid, _, _qd = struct.unpack(">HHH", query[:6])
        labels, at = [], 12
        while query[at]:
            labels.append(query[at + 1:at + 1 + query[at]].decode("latin-1"))
            at += 1 + query[at]
        qtype = struct.unpack(">H", query[at + 1:at + 3])[0]
        question = query[12:at + 5]
        name = ".".join(labels).lower()
        self.asked.append(name)
        nth = self.counts.get((name, qtype), 0)
        self.counts[(name, qtype)] = nth + 1
        found = self.answer(name, qtype, nth)
        if found is None:
            return struct.pack(">HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question
        records = b""
        count = 0
        for address in found:
            ip = ipaddress.ip_address(address)
            rtype = 1 if ip.version == 4 else 28
            if rtype == qtype:
                records += struct.pack(">HHHIH", 0xC00C, rtype, 1, 0, len(ip.packed)) + ip.packed
                count += 1
        return struct.pack(">HHHHHH", qid, 0x8180, 1, count, 0, 0) + question + records


def enter_namespace(work: Path) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for address in (*TRAPS_V4, GLOBAL_V4):
        if not address.startswith("127."):
            subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True)
    for address in TRAPS_V6:
        if address != "::1":
            subprocess.run(["ip", "-6", "addr", "add", f"{address}/128", "dev", "lo", "nodad"], check=True)
    conf = work / "resolv.conf"
    conf.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    subprocess.run(["mount", "--bind", str(conf), "/etc/resolv.conf"], check=True)


class Trap(threading.Thread):
    """A listener on one address that records who connected and what they sent."""

    def __init__(self, address: str, port: int) -> None:
        super().__init__(daemon=True)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.address = address
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(64)
        self.hits: list[bytes] = []

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                data = b""
                with contextlib.suppress(OSError):
                    data = conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\ntrap")
                self.hits.append(data[:200])


def traps(port: int) -> list[Trap]:
    made = [Trap(a, port) for a in (*TRAPS_V4, *TRAPS_V6, GLOBAL_V4)]
    for t in made:
        t.start()
    return made


# -- scenarios ---------------------------------------------------------------------------------


class Stage:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.ca = UpstreamCA(work / "upstream-ca", ("localhost", "127.0.0.1", "*.flood.test"))
        self.hub = EgressHub(AddressGuard(["127.0.0.1/32"]), upstream_context(str(self.ca.ca_path)))
        self.opened: list[BatchProxy] = []

    def open(self, name: str, tenant: str, rules: str, *, secure_port: int | None = None,
             job: int = 1) -> BatchProxy:
        extra: dict[str, Any] = {}
        if secure_port is not None:
            injection = Injection("KEY", "sk/netns-value-Zz=", f"tenantq-placeholder-KEY-{job:032x}",
                                  parse_rule(f"localhost:{secure_port}"), header="Authorization",
                                  template="Bearer {value}")
            extra = {"injections": (injection,),
                     "ca": TenantCA(self.work / "cas", tenant)}
        proxy = self.hub.open(self.work / f"{name}.sock", EgressPolicy(tenant, parse_rules(rules)),
                              lambda: (job, None), **extra)
        self.opened.append(proxy)
        return proxy

    def close(self) -> None:
        for proxy in self.opened:
            with contextlib.suppress(Exception):
                self.hub.close(proxy)
        self.hub.shutdown()


def scenario_internal(stage: Stage) -> None:
    """An allowed name whose answer is internal (or wraps an internal address)."""
    plain = Upstream("plain")
    port = plain.port
    resolver = Resolver(lambda name, qtype, nth: INSIDE.get(name.removesuffix(".inside.test"))
                        if name.endswith(".inside.test") else None)
    resolver.start()
    set_traps = traps(port)
    proxy = stage.open("inside", "mallory", f"*.inside.test:{port}")
    for label in INSIDE:
        for how, data in (("CONNECT", f"CONNECT {label}.inside.test:{port} HTTP/1.1\r\n\r\n"),
                          ("GET", f"GET http://{label}.inside.test:{port}/t/{label} HTTP/1.1\r\n"
                                  f"Connection: close\r\n\r\n")):
            status = status_of(head_only(proxy, data.encode()))
            stage.notes.append(f"{how} {label}: {status}")
            if label == "control":
                continue
            if not status.startswith("HTTP/1.1 403") and not (label.startswith("mixed") and " 200" in status):
                stage.problems.append(f"rule E1: {how} {label}.inside.test (answers {INSIDE[label]}) got "
                                      f"{status!r}, not a 403 from the address guard")
    for trap in set_traps:
        if trap.hits and trap.address != GLOBAL_V4:
            stage.problems.append(f"rule E1: the proxy connected to {trap.address}: {trap.hits[:3]}")
    if not next(t for t in set_traps if t.address == GLOBAL_V4).hits:
        stage.problems.append("test control: the proxy never reached the global address 8.8.8.8 here, so a "
                              "trap connection would not have been seen either")
    for req in plain.requests:
        label = req.lines()[0].split("/t/")[-1].split(" ")[0]
        if label not in ("mixed", "mixed-v6"):
            stage.problems.append(f"rule E1: a request for {label} (answers {INSIDE.get(label)}) reached "
                                  f"127.0.0.1 (the unspecified address is this host)")
    plain.stop()


def scenario_rebind(stage: Stage) -> None:
    """The answer changes between the policy's look-up and the connect: the
    first question for a name gets 127.0.0.1 (allowed here), every later one
    127.0.0.2 (loopback the guard refuses), in v4 and in v4-mapped v6."""
    plain = Upstream("plain")
    port = plain.port

    def answer(name: str, qtype: int, nth: int) -> list[str] | None:
        if not name.endswith(".rebind.test"):
            return None
        if name.startswith("v6"):
            return ["127.0.0.1"] if nth == 0 else ["::ffff:127.0.0.2"]
        return ["127.0.0.1"] if nth == 0 else ["127.0.0.2"]

    resolver = Resolver(answer)
    resolver.start()
    set_traps = traps(port)
    proxy = stage.open("rebind", "mallory", f"*.rebind.test:{port}")
    for i in range(6):
        for name in (f"r{i}.rebind.test", f"v6r{i}.rebind.test"):
            reply = head_only(proxy, f"CONNECT {name}:{port} HTTP/1.1\r\n\r\n".encode())
            stage.notes.append(f"CONNECT {name}: {status_of(reply)}")
            head_only(proxy, f"GET http://{name}:{port}/again HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
    hits = [(t.address, t.hits[:2]) for t in set_traps if t.hits and t.address != GLOBAL_V4]
    if hits:
        stage.problems.append(f"rule E1 (DNS rebinding): the proxy connected to an address its guard never "
                              f"checked: {hits}")
    asked = sum(1 for n in resolver.asked if n.endswith(".rebind.test"))
    stage.notes.append(f"{asked} questions for *.rebind.test; {len(plain.requests)} requests reached "
                       f"127.0.0.1")
    plain.stop()
