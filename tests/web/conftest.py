"""A live dashboard for the web tests: uvicorn in a background thread on a
socket bound to a free port, started and stopped with the test, over a
seeded queue in the test's own schema."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from starlette.types import ASGIApp

import tenantq
import tests.apps.basic  # noqa: F401  (registers the demo.* handlers)
from tenantq import Queue
from tenantq.store import jobs
from tenantq.store.db import Database
from tenantq.testing import drain, wait_until
from tenantq.web.app import create_app

CSRF = re.compile(r'name="csrf_token" value="([0-9a-f]{64})"')


def csrf_of(html: str) -> str:
    match = CSRF.search(html)
    assert match, "page has no CSRF token"
    return match[1]


@dataclass(frozen=True)
class Seeded:
    done: list[int]
    dead: list[int]  # globex's dead jobs (demo.fail, max_attempts=1)
    pending: list[int]
    running: list[int]
    xss: int  # a pending job whose payload holds markup


def seed(queue: Queue, db: Database) -> Seeded:
    queue.set_tenant("acme", weight=3, max_sandboxes=2, egress="api.stripe.com,*.salesforce.com:443")
    queue.set_tenant("globex", weight=1)
    done = [queue.enqueue("acme", "demo.hello", {"n": n}) for n in range(3)]
    dead = [queue.enqueue("globex", "demo.fail", {"n": n}, max_attempts=1) for n in range(2)]
    drain(db, tenantq.REGISTRY)
    # what a sandboxed run records when its egress proxy refuses a request
    with db.connect() as conn:
        conn.execute("INSERT INTO egress_blocks (tenant_id, batch_id, job_id, host, reason, blocked_at) "
                     "SELECT j.tenant_id, b.batch_id, %(job)s, 'pastebin.com:443', "
                     "'pastebin.com:443 is not allowed for tenant globex', now() FROM jobs j "
                     "JOIN batches b ON b.tenant_id = j.tenant_id WHERE j.id = %(job)s LIMIT 1",
                     {"job": dead[0]})
    # one live batch (a lease held by a worker that is "still running" it)
    running = [queue.enqueue("initech", "demo.sleep", {"seconds": 1}, priority="bulk")]
    with db.connect() as conn:
        batch = jobs.claim(conn, tenant_id="initech", priority="bulk", limit=10, worker_id="web-test-worker",
                           driver="gvisor", lease_seconds=600)
    assert batch is not None
    pending = [queue.enqueue("acme", "demo.noop", None, priority="interactive", delay=3600),
               queue.enqueue("globex", "demo.noop", {"n": 1}, priority="bulk")]
    xss = queue.enqueue("acme", "demo.noop", {"note": "<script>alert('xss')</script>"})
    return Seeded(done=done, dead=dead, pending=pending, running=running, xss=xss)


@pytest.fixture
def seeded(queue: Queue, db: Database) -> Seeded:
    return seed(queue, db)


class LiveServer:
    def __init__(self, app: ASGIApp) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, ws="none", lifespan="off",
                                http="h11")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="dashboard-test-server", daemon=True)

    def start(self) -> None:
        self.thread.start()

        def healthy() -> bool:
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1).text == "ok"
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout=15, interval=0.05, message="the dashboard to answer /healthz")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()
        assert not self.thread.is_alive(), "dashboard server did not stop"


@pytest.fixture
def serve_app() -> Iterator[Callable[[ASGIApp], str]]:
    """Start an app on a free port; returns its base URL. Stopped at teardown."""
    started: list[LiveServer] = []

    def start(app: ASGIApp) -> str:
        live = LiveServer(app)
        started.append(live)
        live.start()
        return live.url

    yield start
    for live in started:
        live.stop()


@pytest.fixture
def dashboard(queue: Queue, seeded: Seeded, serve_app: Callable[[ASGIApp], str]) -> str:
    """Base URL of a dashboard without a token over the seeded queue."""
    return serve_app(create_app(queue))
