"""The dashboard shows the live workers (the kinds each serves, its last
executor error), recent failures as failed attempts at the time they failed,
and a job's attempt history: in headless Chromium and at the HTTP level."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

import httpx
import pytest
from starlette.types import ASGIApp

import tenantq
from tenantq import Queue
from tenantq.store import workers
from tenantq.store.db import Database
from tenantq.store.workers import WorkerRecord
from tenantq.testing import drain
from tenantq.web.app import create_app
from tests.integration.helpers import fetch_one
from tests.web.browser import chromium_page, needs_chromium

ROOT = Path(__file__).resolve().parents[2]
WARMUP_ERROR = "WarmupFailed: warmup 'app:load_model' failed: RuntimeError: the model file is missing"


@dataclass(frozen=True)
class History:
    flaky: int  # failed once, then done
    orphan: int  # pending, of a kind no live worker serves
    url: str


@pytest.fixture
def history(queue: Queue, db: Database, serve_app: Callable[[ASGIApp], str]) -> History:
    import tests.apps.basic  # noqa: F401  (registers the demo.* handlers)

    flaky = queue.enqueue("acme", "demo.flaky", {"succeed_on": 2})
    drain(db, tenantq.REGISTRY)
    orphan = queue.enqueue("globex", "reports.render", {"month": 9})
    with db.connect() as conn:
        workers.beat(conn, WorkerRecord.of("svc-a:1", "gvisor", 30.0, ["demo.hello", "demo.noop"]))
        workers.beat(conn, WorkerRecord.of("svc-b:2", "inline", 30.0, ["mail.send"]))
        workers.executor_failed(conn, "svc-b:2", WARMUP_ERROR + "\nTraceback (most recent call last): ...")
    return History(flaky=flaky, orphan=orphan, url=serve_app(create_app(queue)))


@needs_chromium
def test_browser_workers_failures_and_attempts(history: History, db: Database) -> None:
    from playwright.sync_api import expect

    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    failed_at = fetch_one(db, "SELECT finished_at FROM attempts WHERE outcome = 'failed'")["finished_at"]
    done_at = fetch_one(db, "SELECT finished_at FROM jobs WHERE id = %(id)s", {"id": history.flaky})
    assert failed_at < done_at["finished_at"]
    with chromium_page() as page:
        page.goto(f"{history.url}/")
        svc_a = page.locator('#workers tr[data-worker="svc-a:1"]')
        expect(svc_a.locator("td.kinds")).to_have_text("demo.hello, demo.noop")
        expect(svc_a).to_contain_text("gvisor")
        expect(svc_a.locator("td.executor-error")).to_have_text("—")
        svc_b = page.locator('#workers tr[data-worker="svc-b:2"]')
        expect(svc_b.locator("td.kinds")).to_have_text("mail.send")
        expect(svc_b.locator("td.executor-error")).to_contain_text(
            f"failing (1 in a row): {WARMUP_ERROR}")

        # the failure of a job that later succeeded, stamped when it failed
        failure = page.locator(f'#failures tr[data-job="{history.flaky}"][data-attempt="1"]')
        expect(failure).to_contain_text("flaky failure on attempt 1")
        expect(failure.locator(".badge")).to_have_text("done")
        expect(failure.locator("td").last).to_have_attribute(
            "title", failed_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))

        page.click(f'#failures tr[data-job="{history.flaky}"] a')
        expect(page.locator("h1")).to_contain_text(f"Job {history.flaky}")
        expect(page.locator("#outcome")).to_have_text(
            "succeeded on attempt 2 after: RuntimeError: flaky failure on attempt 1")
        rows = page.locator("#attempts tbody tr")
        expect(rows).to_have_count(2)
        expect(rows.nth(0)).to_contain_text("failed")
        expect(rows.nth(0)).to_contain_text("RuntimeError: flaky failure on attempt 1")
        expect(rows.nth(1)).to_contain_text("done")
        expect(page.locator("#last-error")).to_have_count(0)  # no stale error on a done job
        page.screenshot(path=str(artifacts / "dashboard-attempts.png"), full_page=True)

        page.goto(f"{history.url}/jobs/{history.orphan}")
        expect(page.locator("#why")).to_contain_text(
            "no running worker has a handler for kind reports.render (2 running worker(s) serve: "
            "demo.hello, demo.noop, mail.send)")
        page.goto(f"{history.url}/")
        page.screenshot(path=str(artifacts / "dashboard-workers.png"), full_page=True)


def test_overview_and_job_page_over_http(history: History, queue: Queue) -> None:
    html = httpx.get(f"{history.url}/").text
    for text in ('data-worker="svc-a:1"', 'data-worker="svc-b:2"', "mail.send",
                 "failed: RuntimeError: the model file is missing",
                 f'data-job="{history.flaky}" data-attempt="1"', "flaky failure on attempt 1"):
        assert text in html, text
    job = httpx.get(f"{history.url}/jobs/{history.flaky}").text
    assert 'id="attempts"' in job and 'data-outcome="failed"' in job and 'data-outcome="done"' in job
    assert 'id="last-error"' not in job
    filtered = httpx.get(f"{history.url}/", params={"tenant": "globex"}).text
    assert f'data-job="{history.flaky}"' not in filtered, "recent failures follow the tenant filter"


def test_no_worker_running_is_said_plainly(queue: Queue, serve_app: Callable[[ASGIApp], str]) -> None:
    job_id = queue.enqueue("acme", "demo.hello")
    url = serve_app(create_app(queue))
    assert "No worker is running" in httpx.get(f"{url}/").text
    assert "no worker is running" in httpx.get(f"{url}/jobs/{job_id}").text
