"""The job page lists a job's host-function calls per attempt (function,
outcome, milliseconds), in headless Chromium and at the HTTP level."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from starlette.types import ASGIApp

import tenantq
import tests.apps.hostfn  # noqa: F401  (registers the hostfn.* handlers and host functions)
from tenantq import Queue
from tenantq.host_functions import MAX_RECORDED_CALLS
from tenantq.store.db import Database
from tenantq.testing import drain
from tenantq.web.app import create_app
from tests.web.browser import chromium_page, needs_chromium


@pytest.fixture
def jobs_and_url(queue: Queue, db: Database, serve_app: Callable[[ASGIApp], str]) -> tuple[int, int, str]:
    mixed = queue.enqueue("acme", "hostfn.mixed")
    flood = queue.enqueue("acme", "hostfn.flood", {"calls": MAX_RECORDED_CALLS + 5})
    drain(db, tenantq.REGISTRY)
    return mixed, flood, serve_app(create_app(queue))


@needs_chromium
def test_browser_job_page_lists_its_host_function_calls(jobs_and_url: tuple[int, int, str]) -> None:
    from playwright.sync_api import expect

    mixed, flood, url = jobs_and_url
    artifacts = Path(__file__).resolve().parents[2] / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    with chromium_page() as page:
        page.goto(f"{url}/jobs/{mixed}")
        rows = page.locator("#host-calls tbody tr")
        expect(rows).to_have_count(3)
        for i, (name, outcome) in enumerate([("noop", "ok"), ("boom", "error"),
                                             ("orders.everyone", "refused")]):
            expect(rows.nth(i)).to_have_attribute("data-outcome", outcome)
            expect(rows.nth(i).locator("td.mono")).to_have_text(name)
        page.screenshot(path=str(artifacts / "dashboard-host-calls.png"), full_page=True)
        page.goto(f"{url}/jobs/{flood}")
        expect(page.locator("#host-calls tbody tr[data-outcome]")).to_have_count(MAX_RECORDED_CALLS)
        expect(page.locator("#host-calls tbody tr.muted")).to_contain_text(
            f"and 5 more (the first {MAX_RECORDED_CALLS} are listed)")


def test_job_page_host_calls_over_http(jobs_and_url: tuple[int, int, str], queue: Queue) -> None:
    mixed, _, url = jobs_and_url
    html = httpx.get(f"{url}/jobs/{mixed}").text
    assert 'id="host-calls"' in html and 'data-outcome="refused"' in html and "orders.everyone" in html
    plain = queue.enqueue("acme", "hostfn.flood", {"calls": 0})
    assert 'id="host-calls"' not in httpx.get(f"{url}/jobs/{plain}").text  # no calls, no section
