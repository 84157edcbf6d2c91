"""The entry point run inside the namespace (tests/adversarial/egress_netns.py
has the resolver, the traps and the first scenarios), and two more:

- `flood` (rule E3): names that really resolve (the resolver answers every
  `*.flood.test` with 127.0.0.1) under a wildcard rule, each tunnel
  intercepted (the tenant has an injected secret) and its TLS handshake done,
  so that every name costs a leaf certificate: ten tenants' batches of 260
  names. Past 256 names a batch's new name is refused before DNS; the
  process's peak RSS grows little once the caches are full; no leaf is
  written to disk; a neighbour's requests on the same hub stay fast.
- `names` (docs/egress.md: "a disallowed name never reaches DNS"): tricky
  CONNECT targets and absolute URIs under `*.allowed.test`; every question the
  resolver is asked must be for a name under it.
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tenantq.egress.proxy import BatchProxy
from tenantq.egress.tls import TenantCA
from tests.adversarial.egress_netns import (
    Resolver,
    Stage,
    enter_namespace,
    scenario_internal,
    scenario_rebind,
    traps,
)
from tests.adversarial.egress_upstream import Upstream
from tests.adversarial.egress_world import ask, head_only, read_until_closed, reset_hwm, status_of, vm_hwm_kb

MAX_NAMES = 256
NAMES_PER_BATCH = MAX_NAMES + 4
TENANTS = 10  # x 128 leaf certificates a tenant may cache > the 1,024 in all
NEIGHBOUR_SECONDS = 2.0
LATE_GROWTH_MB = 32


def _one_name(proxy: BatchProxy, ca: TenantCA, name: str, port: int) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(15)
        raw.connect(str(proxy.path))
        raw.sendall(f"CONNECT {name}:{port} HTTP/1.1\r\n\r\n".encode())
        status = status_of(raw.recv(4096))
        if " 200" not in status:
            return status
        try:
            ctx = ssl.create_default_context(cadata=ca.cert_pem.decode())
            with ctx.wrap_socket(raw, server_hostname=name) as tls:
                tls.sendall(f"GET /m/digest/x HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
                return "tunnel: " + status_of(read_until_closed(tls, 15)[0])
        except (OSError, ssl.SSLError) as exc:
            return f"tunnel: {type(exc).__name__}: {exc}"[:200]


def scenario_flood(stage: Stage) -> None:
    secure = Upstream("secure", stage.ca.server_context())
    plain = Upstream("plain")
    resolver = Resolver(lambda name, qtype, nth: ["127.0.0.1"] if name.endswith(".flood.test") else None)
    resolver.start()
    neighbour = stage.open("neighbour", "acme", f"127.0.0.1:{plain.port}", job=99)
    waits: list[float] = []
    done = threading.Event()

    def neighbour_requests() -> None:
        while not done.wait(0.2):
            t = time.monotonic()
            request = f"GET http://127.0.0.1:{plain.port}/m/digest/n HTTP/1.1\r\n\r\n"
            reply = ask(neighbour, request.encode(), 20)
            waits.append(time.monotonic() - t if " 200" in status_of(reply) else float("inf"))

    watcher = threading.Thread(target=neighbour_requests, daemon=True)
    watcher.start()
    reset_hwm()
    peaks: list[int] = [vm_hwm_kb()]
    try:
        for t in range(TENANTS):
            proxy = stage.open(f"flood{t}", f"mallory{t}", f"*.flood.test:{secure.port}",
                               secure_port=secure.port, job=t + 1)
            ca = TenantCA(stage.work / "cas", f"mallory{t}")
            results = [_one_name(proxy, ca, f"n{i}-t{t}.flood.test", secure.port)
                       for i in range(NAMES_PER_BATCH)]
            judge_batch(stage, t, results, resolver)
            stage.hub.close(proxy)
            stage.opened.remove(proxy)
            peaks.append(vm_hwm_kb())
    finally:
        done.set()
        watcher.join(timeout=30)
    half = TENANTS // 2
    late = (peaks[-1] - peaks[half]) / 1024
    stage.notes.append(f"peak RSS per batch (MB): {[round(p / 1024) for p in peaks]}")
    if late > LATE_GROWTH_MB:
        stage.problems.append(f"rule E3: the peak RSS still grew {late:.0f} MB over the last "
                              f"{TENANTS - half} batches of {NAMES_PER_BATCH} intercepted names (the leaf "
                              f"caches are full by then: 128 per tenant, 1,024 in all)")
    on_disk = [str(p.relative_to(stage.work)) for p in (stage.work / "cas").rglob("*")
               if p.is_file() and ("leaf" in p.name or "flood" in p.read_bytes().decode("latin-1"))]
    if on_disk:
        stage.problems.append(f"rule E3: leaf certificates written to disk: {on_disk[:5]} ({len(on_disk)})")
    slow = [w for w in waits if w > NEIGHBOUR_SECONDS]
    stage.notes.append(f"neighbour: {len(waits)} requests, slowest {max(waits, default=0):.2f} s")
    if not waits or slow:
        stage.problems.append(f"rule E3: the neighbour's requests during the flood: {len(slow)} of "
                              f"{len(waits)} took over {NEIGHBOUR_SECONDS:g} s (or failed)")
    secure.stop()
    plain.stop()


def judge_batch(stage: Stage, t: int, results: list[str], resolver: Resolver) -> None:
    early = [r for r in results[:MAX_NAMES] if not r.startswith("tunnel: HTTP/1.1 200")]
    if early:
        stage.problems.append(f"batch {t}: {len(early)} of the first {MAX_NAMES} names failed: {early[:3]}")
    late = results[MAX_NAMES:]
    if not all(r.startswith("HTTP/1.1 403") and "256 host names" in r for r in late):
        stage.problems.append(f"rule E3, batch {t}: names past {MAX_NAMES} were not refused with the bound's "
                              f"reason: {late}")
    asked = {f"n{i}-t{t}.flood.test" for i in range(MAX_NAMES, NAMES_PER_BATCH)} & set(resolver.asked)
    if asked:
        stage.problems.append(f"rule E3, batch {t}: names past the bound reached DNS: {sorted(asked)}")


def scenario_names(stage: Stage) -> None:
    plain = Upstream("plain")
    p = plain.port

    def answer(name: str, qtype: int, nth: int) -> list[str] | None:
        if name.endswith(".allowed.test"):
            return ["127.0.0.1"]
        return ["127.0.0.2"] if "evil" in name else None

    resolver = Resolver(answer)
    resolver.start()
    set_traps = traps(p)
    proxy = stage.open("names", "mallory", f"*.allowed.test:{p}")
    targets = ["evil.test", "allowed.test", "x.allowed.test.evil.test", "evil.test\\.allowed.test",
               "evil.test%2eallowed.test", "evil.test/.allowed.test", "evil.test#.allowed.test",
               "evil.test?.allowed.test", f"evil.test:{p}@x.allowed.test", f"x.allowed.test:{p}@evil.test",
               "evil.test .allowed.test", "EVIL.TEST", "evil\u3002test", "evil.test\u3002", ".allowed.test",
               "*.allowed.test", "x.allowed.test..", "evil.test\tx.allowed.test", "evil.test,x.allowed.test",
               "evil.test;x.allowed.test", "[evil.test]", "evil.test.", "xn--evil-.test", "a..allowed.test",
               "-.allowed.test", "x" * 64 + ".allowed.test", ("y" * 60 + ".") * 5 + "allowed.test"]
    statuses = {}
    for target in targets:
        host = target if ":" in target.rsplit("@", 1)[-1] else f"{target}:{p}"
        connect_line = f"CONNECT {host} HTTP/1.1\r\n\r\n"
        statuses[f"CONNECT {target}"] = status_of(head_only(proxy, connect_line.encode()))
        statuses[f"GET {target}"] = status_of(head_only(proxy, f"GET http://{host}/ HTTP/1.1\r\n"
                                                               f"Connection: close\r\n\r\n".encode()))
    for uri in (f"http://x.allowed.test:{p}@evil.test:{p}/", f"http://evil.test:{p}\\@x.allowed.test:{p}/",
                f"http://evil.test:{p}#@x.allowed.test:{p}/", f"http://evil.test:{p}?@x.allowed.test:{p}/"):
        statuses[f"GET {uri}"] = status_of(head_only(proxy, f"GET {uri} HTTP/1.1\r\nConnection: close\r\n\r\n"
                                                               .encode()))
    control = status_of(head_only(proxy, f"GET http://ok.allowed.test:{p}/ HTTP/1.1\r\n\r\n".encode()))
    bad = sorted({n for n in resolver.asked if not n.rstrip(".").endswith(".allowed.test")})
    if bad:
        stage.problems.append(f"docs/egress.md (policy before DNS): names no rule allows reached the "
                              f"resolver: {bad}")
    hits = [(t.address, t.hits[:2]) for t in set_traps if t.hits]
    if hits:
        stage.problems.append(f"a name no rule allows was connected to: {hits}")
    silent = [k for k, v in statuses.items() if not v.startswith("HTTP/1.1 ")]
    if silent:
        stage.problems.append(f"docs/egress.md (malformed requests get 400): no reply at all to {silent}")
    if " 200" not in control:
        stage.problems.append(f"test control: an allowed name does not work here: {control!r}")
    stage.notes += [f"{k}: {v}" for k, v in statuses.items()]
    plain.stop()


SCENARIOS: dict[str, Callable[[Stage], None]] = {
    "internal": scenario_internal, "rebind": scenario_rebind, "flood": scenario_flood,
    "names": scenario_names}


def main() -> None:
    scenario, work = sys.argv[1], Path(sys.argv[2])
    enter_namespace(work)
    stage = Stage(work)
    try:
        SCENARIOS[scenario](stage)
    except Exception as exc:
        stage.problems.append(f"the scenario raised {type(exc).__name__}: {exc}")
    finally:
        stage.close()
    print(json.dumps({"problems": stage.problems, "notes": stage.notes}))


if __name__ == "__main__":
    main()
