"""Egress through real sandboxes (gvisor and process): each batch reaches
only what its tenant allows, through its own proxy, and nothing else: not
the other tenant's hosts, not Postgres, not another batch's proxy. Test
servers listen on 127.0.0.1; the proxy's guard allows exactly 127.0.0.1/32
(Postgres is refused by policy, not by the guard)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import tests.apps.net  # noqa: F401  (registers net.* here too: the host applies handler narrowing)
from tenantq import JobSpec, Queue
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.observe import metrics
from tenantq.registry import REGISTRY
from tenantq.sandbox.batch import SandboxExecutor
from tenantq.sandbox.driver import SandboxDriver
from tenantq.sandbox.egress import EgressConfig
from tenantq.store.db import Database
from tests.acceptance.helpers import query

NET_APP = "tests.apps.net"


class Named(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = self.server.name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def servers() -> Iterator[dict[str, int]]:
    started = []
    for name in ("alpha", "beta"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Named)
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
    yield {s.name: s.server_address[1] for s in started}  # type: ignore[attr-defined]
    for s in started:
        s.shutdown()
        s.server_close()


def _drain(db: Database, driver: SandboxDriver) -> None:
    executor = SandboxExecutor(driver, REGISTRY, NET_APP,
                               egress=EgressConfig(allow_networks=("127.0.0.1/32",)))
    stats = Worker(db, executor, WorkerConfig(concurrency=2, batch_size=5, once=True)).run()
    assert stats.dead == 0 and stats.retried == 0, stats.snapshot()


def test_each_tenant_reaches_only_its_own_hosts(driver: SandboxDriver, db: Database, queue: Queue,
                                                servers: dict[str, int]) -> None:
    alpha, beta = (f"http://127.0.0.1:{servers[n]}/" for n in ("alpha", "beta"))
    queue.set_tenant("tenant-a", egress=f"127.0.0.1:{servers['alpha']}")
    queue.set_tenant("tenant-b", egress=f"127.0.0.1:{servers['beta']}")
    before = metrics.EGRESS_REQUESTS.labels("tenant-a", "blocked")._value.get()
    job_a = queue.enqueue("tenant-a", "net.get", {"urls": [alpha, beta]})
    job_b = queue.enqueue("tenant-b", "net.get", {"urls": [beta, alpha]})
    _drain(db, driver)
    a, b = queue.job(job_a), queue.job(job_b)
    assert a.status == b.status == "done", (a, b)
    assert a.result[0] == {"ok": True, "status": 200, "body": "alpha"}
    assert b.result[0] == {"ok": True, "status": 200, "body": "beta"}
    for refused, host in ((a.result[1], f"127.0.0.1:{servers['beta']}"),
                          (b.result[1], f"127.0.0.1:{servers['alpha']}")):
        assert refused["ok"] is False and refused["status"] == 403, refused
        assert f"{host} is not allowed" in refused["error"], refused
    # visible on the job page, counted on the batch and in the metrics
    assert [blk["host"] for blk in a.egress_blocked] == [f"127.0.0.1:{servers['beta']}"]
    (record,) = query(db, "SELECT egress FROM batches WHERE tenant_id = 'tenant-a'")
    assert record["egress"]["allowed"] == 1 and record["egress"]["blocked"] == 1
    assert record["egress"]["bytes_in"] > 0
    assert metrics.EGRESS_REQUESTS.labels("tenant-a", "blocked")._value.get() == before + 1


def test_no_way_out_but_the_own_proxy(driver: SandboxDriver, db: Database, queue: Queue,
                                      servers: dict[str, int], data_dir: Any) -> None:
    queue.set_tenant("tenant-a", egress=f"127.0.0.1:{servers['alpha']}")
    pg = ("127.0.0.1", 5432)
    job_a = queue.enqueue("tenant-a", "net.direct", {"tcp": [pg, ("127.0.0.1", servers["alpha"])]})
    via_proxy = queue.enqueue("tenant-a", "net.get", {"urls": ["http://127.0.0.1:5432/"]})
    # a tenant without egress: no socket at all; and another sandbox's socket
    # path (host or guest) leads nowhere
    other_socket = str(data_dir / "sandboxes" / driver.name)
    job_none = queue.enqueue("tenant-none", "net.direct", {
        "tcp": [pg], "unix": ["/tenantq/egress/proxy.sock", other_socket]})
    _drain(db, driver)
    direct, none = queue.job(job_a).result, queue.job(job_none).result
    assert not any(v == "connected" for v in direct["tcp"].values()), direct
    assert direct["egress_dir"] == ["proxy.sock"] and direct["proxy_env"].startswith("http://127.0.0.1:")
    proxied = queue.job(via_proxy).result[0]
    assert proxied["status"] == 403 and "127.0.0.1:5432 is not allowed" in proxied["error"], proxied
    assert none["egress_dir"] == [] and none["proxy_env"] is None, none
    assert not any(v == "connected" for v in [*none["tcp"].values(), *none["unix"].values()]), none


def test_a_handler_narrows_its_tenant_policy(driver: SandboxDriver, db: Database, queue: Queue,
                                             servers: dict[str, int]) -> None:
    alpha = f"http://127.0.0.1:{servers['alpha']}/"
    queue.set_tenant("tenant-a", egress=f"127.0.0.1:{servers['alpha']}")
    wide, narrow = queue.enqueue_many([JobSpec("tenant-a", "net.get", {"urls": [alpha]}),
                                       JobSpec("tenant-a", "net.narrowed", {"urls": [alpha]})])
    _drain(db, driver)
    assert queue.job(wide).result[0]["body"] == "alpha"
    refused = queue.job(narrow).result[0]
    assert refused["status"] == 403 and "not allowed for its handler" in refused["error"], refused
    assert [b["host"] for b in queue.job(narrow).egress_blocked] == [f"127.0.0.1:{servers['alpha']}"]
