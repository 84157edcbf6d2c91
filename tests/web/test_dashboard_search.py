"""The dashboard's search (GET /jobs): filters, pages newest first, the
bulk actions on a filtered set (POST /jobs/cancel, /jobs/retry-dead, behind
the CSRF check), and the job page's security envelope (actor, meta)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from starlette.types import ASGIApp

from tenantq import Queue
from tenantq.store.db import Database
from tenantq.web.app import create_app
from tests.web.browser import chromium_page, needs_chromium
from tests.web.conftest import Seeded, csrf_of, seed

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Found:
    seeded: Seeded
    url: str
    reports: list[int]  # acme's pending reports.render jobs for user-7, oldest first
    other: list[int]  # acme's pending jobs of other actors
    hostile: int  # a job whose actor and meta hold markup


@pytest.fixture
def found(queue: Queue, db: Database, serve_app: Callable[[ASGIApp], str]) -> Found:
    seeded = seed(queue, db)
    reports = [queue.enqueue("acme", "reports.render", {"n": n}, delay=3600, actor="user-7",
                             meta={"request_id": f"r-{n}", "plan": "pro"}) for n in range(5)]
    other = [queue.enqueue("acme", "reports.render", {"n": n}, delay=3600, actor="user-8",
                           meta={"plan": "free"}) for n in range(2)]
    hostile = queue.enqueue("acme", "demo.noop", None, delay=3600, actor="<b>mallory</b>",
                            meta={"note": "<script>alert(1)</script>"})
    return Found(seeded=seeded, url=serve_app(create_app(queue)), reports=reports, other=other,
                 hostile=hostile)


def _ids(html: str) -> list[int]:
    """The job ids of the results table, in page order."""
    body = html.split('id="results"', 1)[1].split("</table>", 1)[0] if 'id="results"' in html else ""
    return [int(part.split('"', 1)[0]) for part in body.split('data-job="')[1:]]


@needs_chromium
def test_browser_search_pages_job_envelope_and_bulk_cancel(queue: Queue, found: Found) -> None:
    from playwright.sync_api import expect

    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    with chromium_page() as page:
        page.goto(f"{found.url}/")
        page.click("header >> text=jobs")
        expect(page.locator("h1")).to_have_text("Jobs")
        # every tenant's jobs, newest first
        expect(page.locator("#results tbody tr").first).to_have_attribute("data-job", str(found.hostile))

        form = page.locator("#search")
        form.locator('input[name="tenant"]').fill("acme")
        form.locator('input[name="actor"]').fill("user-7")
        form.locator('input[name="meta"]').last.fill("plan=pro")
        form.locator('input[name="limit"]').fill("2")
        form.locator('button[type="submit"]').click()
        rows = page.locator("#results tbody tr")
        expect(rows).to_have_count(2)
        newest = list(reversed(found.reports))
        expect(rows.nth(0)).to_have_attribute("data-job", str(newest[0]))
        expect(rows.nth(1)).to_have_attribute("data-job", str(newest[1]))
        expect(page.locator("#results")).to_contain_text("user-7")
        expect(page.locator('[data-testid="bulk-cancel"]')).to_have_text("cancel 5 pending jobs")

        # keyset pages: older, older, then back to the newest
        page.click("#older")
        expect(rows.nth(0)).to_have_attribute("data-job", str(newest[2]))
        expect(rows.nth(1)).to_have_attribute("data-job", str(newest[3]))
        page.click("#older")
        expect(rows).to_have_count(1)
        expect(rows.nth(0)).to_have_attribute("data-job", str(newest[4]))
        expect(page.locator("#older")).to_have_count(0)
        page.screenshot(path=str(artifacts / "dashboard-search.png"), full_page=True)
        page.click("#newest")
        expect(rows.nth(0)).to_have_attribute("data-job", str(newest[0]))

        # the job page shows the envelope, and its actor leads back to a search
        page.click(f'#results tr[data-job="{newest[0]}"] a >> nth=0')
        expect(page.locator("#actor")).to_have_text("user-7")
        expect(page.locator("#meta")).to_contain_text('"request_id": "r-4"')
        page.screenshot(path=str(artifacts / "dashboard-job-envelope.png"), full_page=True)
        page.click("#actor a")
        expect(page.locator("#results tbody tr")).to_have_count(5)

        # cancel the filtered set (all five, not just the page shown)
        page.click('[data-testid="bulk-cancel"]')
        expect(page.locator("#notice")).to_contain_text("Cancelled 5 pending jobs")
        expect(page.locator('#results .badge.s-cancelled')).to_have_count(5)
        expect(page.locator('[data-testid="bulk-cancel"]')).to_have_count(0)
        assert {queue.job(i).status for i in found.reports} == {"cancelled"}
        assert {queue.job(i).status for i in found.other} == {"pending"}
        page.screenshot(path=str(artifacts / "dashboard-search-cancelled.png"), full_page=True)


def test_filters_select_and_pages_do_not_overlap(found: Found) -> None:
    with httpx.Client(base_url=found.url) as client:
        acme = _ids(client.get("/jobs", params={"tenant": "acme", "limit": 1000}).text)
        assert found.hostile in acme and found.seeded.dead[0] not in acme
        assert acme == sorted(acme, reverse=True)
        by_meta = _ids(client.get("/jobs", params=[("tenant", "acme"), ("meta", "plan=pro"),
                                                   ("meta", "request_id=r-2")]).text)
        assert by_meta == [found.reports[2]]
        by_kind = _ids(client.get("/jobs", params={"kind": "reports.render", "actor": "user-8"}).text)
        assert by_kind == list(reversed(found.other))
        dead = _ids(client.get("/jobs", params={"status": "dead"}).text)
        assert sorted(dead) == sorted(found.seeded.dead)
        none = client.get("/jobs", params={"tenant": "acme", "since": "1h", "kind": "demo.fail"}).text
        assert _ids(none) == [] and 'id="no-results"' in none

        # walk every page of acme's jobs, three at a time: the same jobs, once each
        seen: list[int] = []
        url: str | None = "/jobs?tenant=acme&limit=3"
        while url is not None:
            html = client.get(url).text
            seen += _ids(html)
            older = html.split('id="older"', 1)[0].rsplit('href="', 1)[1].split('"', 1)[0] \
                if 'id="older"' in html else None
            url = None if older is None else older.replace("&amp;", "&")
            if url is not None:
                query = parse_qs(urlsplit(url).query)
                assert query["tenant"] == ["acme"] and query["limit"] == ["3"] and query["before"]
        assert seen == acme


def test_bad_filters_are_one_message_and_a_400(found: Found) -> None:
    for params, message in (({"status": "zombie"}, "unknown status"), ({"since": "yesterday"}, "since must"),
                            ({"tenant": "no/such"}, "tenant id"), ({"limit": "5000"}, "limit must"),
                            ({"meta": "novalue"}, "KEY=VALUE"), ({"before": "x"}, "cursor"),
                            ({"kind": "bad kind"}, "kind")):
        response = httpx.get(f"{found.url}/jobs", params=params)
        assert response.status_code == 400, params
        assert 'id="search-error"' in response.text and message in response.text, (params, response.text)
        assert 'id="search"' in response.text  # the form, to correct it


def test_markup_in_actor_and_meta_is_escaped(found: Found) -> None:
    for path in ("/jobs?tenant=acme", f"/jobs/{found.hostile}"):
        html = httpx.get(f"{found.url}{path}").text
        assert "<b>mallory</b>" not in html and "&lt;b&gt;mallory&lt;/b&gt;" in html
        assert "<script>alert(1)</script>" not in html
    job = httpx.get(f"{found.url}/jobs/{found.hostile}").text
    assert 'id="meta"' in job and "&lt;script&gt;" in job
    # a job without an envelope shows neither field
    plain = httpx.get(f"{found.url}/jobs/{found.seeded.done[0]}").text
    assert 'id="actor"' not in plain and 'id="meta"' not in plain


def test_bulk_actions_need_csrf_a_filter_and_the_right_status(queue: Queue, found: Found) -> None:
    dead = found.seeded.dead
    with httpx.Client(base_url=found.url) as client:
        token = csrf_of(client.get("/jobs").text)
        assert client.post("/jobs/cancel", data={"tenant": "acme"}).status_code == 403
        assert client.post("/jobs/retry-dead", data={"csrf_token": "0" * 64}).status_code == 403
        # no filter: never every tenant's pending jobs at once
        assert client.post("/jobs/cancel", data={"csrf_token": token}).status_code == 400
        assert client.post("/jobs/cancel", data={"csrf_token": token, "tenant": "acme",
                                                 "status": "dead"}).status_code == 400
        assert client.post("/jobs/cancel", data={"csrf_token": token, "since": "1 day"}).status_code == 400
        assert {queue.job(i).status for i in [*found.reports, *found.other]} == {"pending"}
        assert {queue.job(i).status for i in dead} == {"dead"}

        cancelled = client.post("/jobs/cancel", data={
            "csrf_token": token, "tenant": "acme", "actor": "user-8", "meta": "plan=free",
            "next": "/jobs?tenant=acme&actor=user-8&replayed=9"})
        assert cancelled.status_code == 303
        assert cancelled.headers["location"] == "/jobs?tenant=acme&actor=user-8&cancelled=2"
        assert {queue.job(i).status for i in found.other} == {"cancelled"}
        assert {queue.job(i).status for i in found.reports} == {"pending"}

        replayed = client.post("/jobs/retry-dead", data={"csrf_token": token, "tenant": "globex",
                                                         "kind": "demo.fail", "next": "//evil.example"})
        assert replayed.status_code == 303 and replayed.headers["location"] == "/jobs?replayed=2"
        assert {queue.job(i).status for i in dead} == {"pending"}
        assert {queue.job(i).replays for i in dead} == {1}
        page = client.get(replayed.headers["location"]).text
        assert "Replayed 2 dead jobs" in page


def test_search_and_bulk_actions_need_the_token(queue: Queue, serve_app: Callable[[ASGIApp], str]) -> None:
    job_id = queue.enqueue("acme", "demo.noop", None, delay=3600, actor="user-7")
    url = serve_app(create_app(queue, token="s3cret-search-token"))
    assert httpx.get(f"{url}/jobs", params={"tenant": "acme"}).status_code == 401
    assert httpx.post(f"{url}/jobs/cancel", data={"tenant": "acme"}).status_code == 401
    assert httpx.post(f"{url}/jobs/retry-dead", data={"tenant": "acme"}).status_code == 401
    assert queue.job(job_id).status == "pending"
    authed = httpx.get(f"{url}/jobs", params={"tenant": "acme"},
                       headers={"Authorization": "Bearer s3cret-search-token"})
    assert authed.status_code == 200 and _ids(authed.text) == [job_id]
