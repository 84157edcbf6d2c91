"""Egress proxy cost: the latency a request gains by going through the
batch's proxy instead of straight to the same local server (p50/p99), on the
host (client -> proxy socket -> server) and from inside a sandbox (job ->
guest forwarder -> proxy socket -> server, the only way out there), and the
per-batch cost of setting a proxy up and tearing it down.

Every request opens a new connection, as clients do through a proxy by
default; the server is a local http.server on 127.0.0.1 (the proxy's guard is
told to allow exactly that address).
"""

from __future__ import annotations

import http.client
import shutil
import socket
import statistics
import tempfile
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import tenantq
from bench.common import machine_info, save, scratch_schema
from tenantq.dispatch.executors.contract import EgressUsed, JobEnded, JobStarted
from tenantq.dispatch.executors.sandboxed import SandboxExecutor
from tenantq.dispatch.executors.warm import WarmPolicy
from tenantq.domain.records import Batch, ClaimedJob
from tenantq.egress.config import EgressConfig
from tenantq.egress.policy import EgressPolicy, parse_rules
from tenantq.egress.proxy import AddressGuard, EgressHub
from tenantq.registry import REGISTRY
from tenantq.sandbox.driver import SandboxDriver
from tenantq.sandbox.drivers import bwrap_works, runsc_works
from tenantq.sandbox.drivers.gvisor import GVisorDriver
from tenantq.sandbox.drivers.process import ProcessDriver

console = Console(width=150)
APP = "bench.egress_app"


class Small(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"x" * 256
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.unix_path)


def _direct(port: int) -> float:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/")
    conn.getresponse().read()
    conn.close()
    return time.perf_counter() - t0


def _proxied(path: str, port: int) -> float:
    t0 = time.perf_counter()
    conn = UnixHTTPConnection(path)
    conn.request("GET", f"http://127.0.0.1:{port}/")
    conn.getresponse().read()
    conn.close()
    return time.perf_counter() - t0


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def in_sandbox(driver: SandboxDriver, port: int, n: int) -> list[float]:
    executor = SandboxExecutor(driver, REGISTRY, APP, policy=WarmPolicy(snapshots=False),
                               egress=EgressConfig(allow_networks=("127.0.0.1/32",)))
    job = ClaimedJob(1, "bench", "egressbench.gets", {"n": n, "url": f"http://127.0.0.1:{port}/"}, 1, 1)
    batch = Batch(1, "bench", "default", datetime.now(UTC), (job,), egress=(f"127.0.0.1:{port}",))
    out: list[float] = []

    def report(event: JobStarted | JobEnded | EgressUsed) -> None:
        if isinstance(event, JobEnded):
            assert event.ok, event.error
            out.extend(event.result)

    try:
        executor.run(batch, env={}, report=report, should_stop=lambda: False)
    finally:
        executor.close()
    return out[n // 10:]  # the first requests warm up the guest's imports


def run(*, n: int = 500, setups: int = 200) -> dict[str, Any]:
    import bench.egress_app  # noqa: F401  (registers egressbench.gets)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Small)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    hub = EgressHub(AddressGuard(["127.0.0.1/32"]))
    tmp = Path(tempfile.mkdtemp(prefix="tenantq-bench-egress-"))
    policy = EgressPolicy("bench", parse_rules(f"127.0.0.1:{port}"))
    try:
        proxy = hub.open(tmp / "p.sock", policy, lambda: (None, None))
        direct: list[float] = []
        proxied: list[float] = []
        for _ in range(n):  # interleaved: load drift hits both alike
            direct.append(_direct(port))
            proxied.append(_proxied(str(proxy.path), port))
        hub.close(proxy)
        setup: list[float] = []
        for i in range(setups):
            t0 = time.perf_counter()
            hub.close(hub.open(tmp / f"s{i}.sock", policy, lambda: (None, None)))
            setup.append(time.perf_counter() - t0)
        sandboxed: dict[str, list[float]] = {}
        data_dir = tmp / "data"
        if runsc_works():
            sandboxed["gvisor"] = in_sandbox(GVisorDriver(data_dir), port, max(20, n // 5))
        if bwrap_works():
            sandboxed["process"] = in_sandbox(ProcessDriver(data_dir), port, max(20, n // 5))
    finally:
        hub.shutdown()
        server.shutdown()
        server.server_close()
        shutil.rmtree(tmp, ignore_errors=True)
    table = Table(title=f"egress: one GET per new connection to a local server, ms (host n={n})")
    for col in ("path", "p50", "p99", "added p50", "added p99"):
        table.add_column(col, justify="left" if col == "path" else "right")
    d50, d99 = statistics.median(direct), _pct(direct, 0.99)
    table.add_row("host: direct", f"{d50 * 1000:.2f}", f"{d99 * 1000:.2f}", "", "")
    rows = {"host: through the batch proxy": proxied,
            **{f"inside {name}: forwarder + proxy": s for name, s in sandboxed.items()}}
    for label, samples in rows.items():
        p50, p99 = statistics.median(samples), _pct(samples, 0.99)
        table.add_row(label, f"{p50 * 1000:.2f}", f"{p99 * 1000:.2f}", f"+{(p50 - d50) * 1000:.2f}",
                      f"+{(p99 - d99) * 1000:.2f}")
    console.print(table)
    console.print(f"per-batch proxy set-up + tear-down: p50 {statistics.median(setup) * 1000:.2f} ms, "
                  f"p99 {_pct(setup, 0.99) * 1000:.2f} ms (n={setups})")
    with scratch_schema("info") as db:
        info = machine_info(db)
    payload = {"benchmark": "egress", "machine": info, "settings": {"n": n, "setups": setups},
               "direct_ms": [s * 1000 for s in direct], "proxied_ms": [s * 1000 for s in proxied],
               "sandboxed_ms": {k: [s * 1000 for s in v] for k, v in sandboxed.items()},
               "setup_ms": [s * 1000 for s in setup], "tenantq": tenantq.__version__}
    console.print(f"wrote {save('egress', payload)}")
    return payload
