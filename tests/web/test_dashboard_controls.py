"""The dashboard's controls: the overview's Schedules table, pausing and
resuming a tenant (its row and its jobs' pages say "paused"), cancelling a
pending or a running job from its page (which then shows who cancelled it);
in headless Chromium, and at the HTTP level (CSRF, bad input, escaping)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tenantq import Queue
from tests.web.browser import chromium_page, needs_chromium
from tests.web.conftest import Seeded, csrf_of

ROOT = Path(__file__).resolve().parents[2]


@needs_chromium
def test_browser_schedules_pause_resume_and_cancel(queue: Queue, seeded: Seeded, dashboard: str) -> None:
    from playwright.sync_api import expect

    daily = queue.add_schedule("acme", "demo.hello", "0 9 * * *", timezone="Europe/Paris")
    hourly = queue.add_schedule("globex", "demo.noop", "@hourly")
    queue.pause_schedule(int(hourly["schedule_id"]))
    pending = seeded.pending[0]  # acme's
    running = seeded.running[0]  # initech's, its batch leased by a worker that is not there

    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    with chromium_page() as page:
        page.goto(f"{dashboard}/")
        schedules = page.locator("#schedules")
        row = schedules.locator(f'tr[data-schedule="{daily["schedule_id"]}"]')
        for cell in ("acme", "demo.hello", "0 9 * * *", "Europe/Paris"):
            expect(row).to_contain_text(cell)
        expect(row.locator("td.next-fire")).to_contain_text("09:00 CET")
        expect(row.locator("td.next-fire")).to_contain_text("(in ")
        expect(row.locator("td.paused")).to_have_text("no")
        other = schedules.locator(f'tr[data-schedule="{hourly["schedule_id"]}"]')
        expect(other.locator("td.paused .badge")).to_have_text("paused")

        # pause acme: its row says so, and so does its job's page
        tenants = page.locator("#tenants")
        page.click('[data-testid="pause-acme"]')
        expect(page.locator("#notice")).to_contain_text("Paused tenant acme")
        expect(tenants.locator('tr[data-tenant="acme"] .badge.s-paused')).to_have_text("paused")
        expect(tenants.locator('tr[data-tenant="globex"] .badge.s-paused')).to_have_count(0)
        expect(page.locator('[data-testid="resume-acme"]')).to_be_visible()
        assert queue.tenants("acme")[0]["paused_at"] is not None
        page.screenshot(path=str(artifacts / "dashboard-controls.png"), full_page=True)
        page.goto(f"{dashboard}/jobs/{pending}")
        expect(page.locator("#tenant-paused")).to_contain_text("tenant acme is paused")
        expect(page.locator("#why")).to_contain_text("tenant acme is paused")

        page.goto(f"{dashboard}/")
        page.click('[data-testid="resume-acme"]')
        expect(page.locator("#notice")).to_contain_text("Resumed tenant acme")
        expect(tenants.locator('tr[data-tenant="acme"] .badge.s-paused')).to_have_count(0)
        assert queue.tenants("acme")[0]["paused_at"] is None

        # cancel the running job: its worker is asked to stop it
        page.goto(f"{dashboard}/jobs/{running}")
        page.click(f'[data-testid="cancel-{running}"]')
        expect(page.locator("#notice")).to_contain_text(f"Asked job {running} to stop")
        expect(page.locator("#cancelled-by")).to_have_text("dashboard")
        expect(page.locator("#cancel-requested")).to_contain_text("UTC")
        expect(page.locator("#cancel-state")).to_contain_text("its worker is stopping it")
        expect(page.locator(f'[data-testid="cancel-{running}"]')).to_have_count(0)
        info = queue.job(running)
        assert (info.status, info.cancelled_by) == ("running", "dashboard")
        assert info.cancel_requested_at is not None
        page.screenshot(path=str(artifacts / "dashboard-job-cancelling.png"), full_page=True)

        # cancel a pending job: it ends cancelled at once
        page.goto(f"{dashboard}/jobs/{pending}")
        page.click(f'[data-testid="cancel-{pending}"]')
        expect(page.locator("#notice")).to_contain_text(f"Cancelled job {pending}")
        expect(page.locator("h1 .badge")).to_have_text("cancelled")
        expect(page.locator("#cancelled-by")).to_have_text("dashboard")
        expect(page.locator(f'[data-testid="cancel-{pending}"]')).to_have_count(0)
        assert queue.job(pending).status == "cancelled"


def test_pause_and_cancel_need_csrf_and_valid_input(queue: Queue, seeded: Seeded, dashboard: str) -> None:
    pending, done = seeded.pending[1], seeded.done[0]
    with httpx.Client(base_url=dashboard) as client:
        token = csrf_of(client.get("/").text)
        assert client.post("/tenants/pause", data={"tenant": "acme"}).status_code == 403
        forged = {"tenant": "acme", "csrf_token": "0" * 64}
        assert client.post("/tenants/pause", data=forged).status_code == 403
        assert client.post(f"/jobs/{pending}/cancel", data={"next": "/"}).status_code == 403
        assert queue.tenants("acme")[0]["paused_at"] is None and queue.job(pending).status == "pending"

        bad = client.post("/tenants/pause", data={"csrf_token": token, "tenant": "no such/tenant"})
        assert bad.status_code == 400 and "tenant id" in bad.text
        assert client.post("/tenants/resume", data={"csrf_token": token}).status_code == 400
        assert client.post("/jobs/999999/cancel", data={"csrf_token": token}).status_code == 404
        assert client.post("/jobs/abc/cancel", data={"csrf_token": token}).status_code == 400
        assert client.get(f"/jobs/{pending}/cancel").status_code == 405

        paused = client.post("/tenants/pause", data={"csrf_token": token, "tenant": "globex",
                                                     "next": "/?tenant=globex&resumed=acme"})
        assert paused.status_code == 303
        assert paused.headers["location"] == "/?tenant=globex&paused=globex"
        assert queue.tenants("globex")[0]["paused_at"] is not None
        page = client.get(paused.headers["location"]).text
        assert "Paused tenant globex" in page and "Resumed tenant" not in page
        resumed = client.post("/tenants/resume", data={"csrf_token": token, "tenant": "globex",
                                                       "next": "//evil.example"})
        assert resumed.headers["location"] == "/?resumed=globex"
        assert queue.tenants("globex")[0]["paused_at"] is None

        # a job that already ended: nothing changes, and the page says so
        ended = client.post(f"/jobs/{done}/cancel", data={"csrf_token": token})
        assert ended.status_code == 303 and ended.headers["location"] == f"/jobs/{done}?job_cancel=ended"
        assert "had already ended; nothing changed" in client.get(ended.headers["location"]).text
        assert queue.job(done).status == "done" and queue.job(done).cancelled_by is None
        # an unknown notice value shows nothing
        assert 'id="notice"' not in client.get(f"/jobs/{done}?job_cancel=<b>x</b>").text


def test_cancelled_by_and_schedules_are_escaped(queue: Queue, seeded: Seeded, dashboard: str) -> None:
    job_id = queue.enqueue("acme", "demo.noop", None, delay=3600)
    assert queue.cancel(job_id, by="<b>mallory</b>")
    html = httpx.get(f"{dashboard}/jobs/{job_id}").text
    assert "<b>mallory</b>" not in html and "&lt;b&gt;mallory&lt;/b&gt;" in html
    # no schedule yet: the overview says how to add one
    assert "No schedules" in httpx.get(f"{dashboard}/").text
    queue.add_schedule("acme", "demo.noop", "*/5 * * * *", payload={"note": "<script>alert(1)</script>"})
    overview = httpx.get(f"{dashboard}/").text
    assert 'id="schedules"' in overview and "<script>alert(1)</script>" not in overview
