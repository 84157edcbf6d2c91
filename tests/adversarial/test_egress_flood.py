"""Rule E3 (docs/security.md) and docs/egress.md "Bounded per sandbox",
attacked from inside real sandboxes on both drivers: a tenant with an
injected secret (so the proxy intercepts every TLS tunnel and makes a leaf
certificate per name) asks a wildcard rule for 260 distinct names that
really resolve, three batches in a row; asks another wildcard rule for 260
names that cannot resolve; and opens 300 connections to its proxy at once.

Names resolve through a hosts file bound over /etc/hosts in the worker's own
mount namespace (`unshare --mount`: the host's file is untouched), every
`nI-tJ.flood.test` to 127.0.0.1, where a TLS upstream with a `*.flood.test`
certificate listens. What must hold: the first 256 names of a batch work and
every new one after is refused before DNS with the bound's reason (for the
names that cannot resolve too: a 403 for the bound, not a DNS failure), with
an egress block row; a name already used stays usable; connections past 256
are closed at once and the proxy serves again after; no leaf certificate is
written under <data_dir>/egress-ca; the dispatcher's peak RSS stays within
the harness's bound; the neighbour's egress requests, enqueued to run during
the flood, finish within its normal wait."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.adversarial import harness
from tests.adversarial.checks import ACME, MALLORY, NEIGHBOUR_WAIT_SECONDS
from tests.adversarial.egress_upstream import Upstream, UpstreamCA
from tests.adversarial.harness import Arena, Hostile

APP = "tests.adversarial.egress_app"
MAX_NAMES, ASKED = 256, 260
FLOOD_BATCHES = 3
CONNECTIONS, MAX_CONNECTIONS = 300, 256
BOUND_REASON = "256 host names"


@pytest.fixture
def upstreams(arena: Arena, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Upstream]]:
    monkeypatch.setattr(harness, "APP", APP)
    ca = UpstreamCA(tmp_path / "upstream-ca", ("localhost", "127.0.0.1", "*.flood.test"))
    made = {"secure": Upstream("secure", ca.server_context()), "plain": Upstream("plain")}
    secure = made["secure"].port
    data = json.loads(arena.secrets_file.read_text())
    data[MALLORY]["KEY"] = {"value": "sk/flood-value-never-inside-Zz=", "inject": {
        "host": f"localhost:{secure}", "header": "Authorization", "format": "Bearer {value}"}}
    arena.secrets_file.write_text(json.dumps(data))
    arena.env.update({"TENANTQ_EGRESS_ALLOW_NETWORKS": "127.0.0.1/32",
                      "TENANTQ_EGRESS_UPSTREAM_CA": str(ca.ca_path)})
    arena.queue.set_tenant(MALLORY, egress=f"*.flood.test:{secure},localhost:{secure},*.flood.invalid:443")
    arena.queue.set_tenant(ACME, egress=f"127.0.0.1:{made['plain'].port}")
    hosts = tmp_path / "hosts"
    names = [f"n{i}-t{t}.flood.test" for t in range(FLOOD_BATCHES) for i in range(ASKED)]
    hosts.write_text(Path("/etc/hosts").read_text() + "".join(f"127.0.0.1 {n}\n" for n in names))
    arena.cmd = ["unshare", "--mount", "--", "/bin/sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
                 str(hosts), *arena.cmd]
    try:
        yield made
    finally:
        for upstream in made.values():
            upstream.stop()


def _judge_names(arena: Arena, job_id: int, label: str, *, resolvable: bool) -> None:
    info = arena.job(job_id)
    result: dict[str, Any] = info.result if isinstance(info.result, dict) else {}
    got: list[str] = result.get("results", [])
    p = arena.problems
    if info.status != "done" or len(got) != ASKED + 1:
        p.append(f"{label}: the job did not report every name: {info.status} {(info.last_error or '')[:300]}")
        return
    early, late, again = got[:MAX_NAMES], got[MAX_NAMES:ASKED], got[ASKED]
    if resolvable:
        failed = [(i, r) for i, r in enumerate(early) if " | HTTP/1.1 200" not in r]
        if failed:
            p.append(f"{label}: {len(failed)} of the first {MAX_NAMES} names did not work: {failed[:3]}")
    elif any(BOUND_REASON in r for r in early):
        p.append(f"{label}: a name within the first {MAX_NAMES} was refused by the bound: {early[:3]}")
    wrong = [r for r in late if not (r.startswith("HTTP/1.1 403") and BOUND_REASON in r)]
    if wrong:
        p.append(f"rule E3, {label}: names {MAX_NAMES + 1}-{ASKED} of one batch were not refused before DNS "
                 f"with the bound's reason: {wrong}")
    if BOUND_REASON in again or (resolvable and " | HTTP/1.1 200" not in again):
        p.append(f"{label}: the batch's first name, asked again past the bound, no longer works: {again!r}")
    reasons = [b.get("reason", "") for b in getattr(info, "egress_blocked", []) or []]
    if not any(BOUND_REASON in r for r in reasons):
        p.append(f"rule E3, {label}: no egress block row for the names past the bound: {reasons[:3]}")


@pytest.mark.timeout(600)
def test_name_and_connection_floods_are_bounded(arena: Arena, upstreams: dict[str, Upstream],
                                                data_dir: Path) -> None:
    secure, plain = upstreams["secure"].port, upstreams["plain"].port
    floods: list[int] = []
    extra: dict[str, int] = {}
    neighbours: list[int] = []
    ask = {"url": f"http://127.0.0.1:{plain}/m/digest/acme"}

    def stage(t: int) -> Callable[[Arena], None]:
        """One flood batch at a time (with one more attack), and the neighbour's egress due meanwhile
        (tracked with the hostile jobs, so that the serving worker runs until they are settled)."""
        def enqueue(a: Arena) -> None:
            floods.append(a.attack("egx.names", {"pattern": f"n{{}}-t{t}.flood.test", "count": ASKED,
                                                 "port": secure, "tls": True}))
            if t == 0:
                extra["invalid"] = a.attack("egx.names", {"pattern": "n{}.flood.invalid", "count": ASKED,
                                                          "port": 443})
            if t == 1:
                extra["conns"] = a.attack("egx.conns", {"count": CONNECTIONS, "after_port": secure,
                                                        "after_name": "n0-t1.flood.test"})
            ids = [a.queue.enqueue(ACME, "egx.get", ask, max_attempts=1, delay=d) for d in (3.0, 9.0)]
            neighbours.extend(ids)
            a.hostile += [Hostile(job_id, "egx.get", ask, 1, False) for job_id in ids]
        return enqueue

    arena.sibling(1)
    arena.run("--concurrency", "3", "--batch-size", "1", once=False, timeout=480,
              stages=[stage(t) for t in range(FLOOD_BATCHES)])
    invalid, conns = extra["invalid"], extra["conns"]
    for t, job_id in enumerate(floods):
        _judge_names(arena, job_id, f"flood batch {t} (names that resolve)", resolvable=True)
    _judge_names(arena, invalid, "names that cannot resolve", resolvable=False)
    info = arena.job(conns)
    r: dict[str, Any] = info.result if isinstance(info.result, dict) else {}
    still_open = r.get("opened", 0) - r.get("closed_by_proxy", 0)
    if info.status != "done" or still_open > MAX_CONNECTIONS or " 200" not in str(r.get("after", "")):
        arena.problems.append(f"{CONNECTIONS} connections at once (docs: at most {MAX_CONNECTIONS}, a new "
                              f"one past that closed at once, the proxy serving after): {info.status} {r} "
                              f"{(info.last_error or '')[:200]}")
    for job_id in neighbours:
        n = arena.job(job_id)
        result = n.result if isinstance(n.result, dict) else {}
        late = None
        if n.finished_at is not None and n.run_after is not None:
            late = (n.finished_at - max(n.run_after, arena.runs[0].started_at)).total_seconds()
        if n.status != "done" or result.get("status") != 200 or late is None or late > NEIGHBOUR_WAIT_SECONDS:
            arena.problems.append(f"the neighbour's egress job {job_id} during the flood: {n.status}, "
                                  f"{str(result)[:160]}, done {late} s after it was due "
                                  f"(normal: within {NEIGHBOUR_WAIT_SECONDS:g} s)")
    leaves = [p.name for p in (data_dir / "egress-ca").rglob("*") if p.is_file() and "leaf" in p.name]
    if leaves:
        arena.problems.append(f"rule E3: {len(leaves)} leaf certificates written under egress-ca/: "
                              f"{leaves[:3]}")
    arena.verdict()
