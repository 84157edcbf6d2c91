"""The web dashboard: in headless Chromium (load, see tenants, open a job,
retry a dead job) and at the HTTP level (CSRF, auth, errors, escaping)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Counter, make_asgi_app
from starlette.types import ASGIApp

from tenantq import Queue
from tenantq.web.app import create_app
from tests.web.browser import chromium_page, needs_chromium
from tests.web.conftest import Seeded, csrf_of

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-dashboard-token"


@needs_chromium
def test_browser_overview_job_page_and_retry(queue: Queue, seeded: Seeded, dashboard: str) -> None:
    from playwright.sync_api import expect

    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    dead_id = seeded.dead[0]
    with chromium_page() as page:
        page.goto(f"{dashboard}/")
        tenants = page.locator("#tenants")
        for tenant in ("acme", "globex", "initech"):
            expect(tenants.locator(f'tr[data-tenant="{tenant}"]')).to_be_visible()
        expect(tenants.locator('tr[data-tenant="acme"]')).to_contain_text("3")  # weight
        expect(tenants.locator('tr[data-tenant="acme"] td.egress')).to_have_text(
            "api.stripe.com, *.salesforce.com:443")
        expect(tenants.locator('tr[data-tenant="globex"] td.egress')).to_have_text("none")
        expect(page.locator("#batches")).to_contain_text("gvisor")
        expect(page.locator("#failures")).to_contain_text("boom on attempt 1")

        # a job page: payload, attempts, result
        page.click(f'#dead tr[data-job="{dead_id}"] a')
        expect(page.locator("h1")).to_contain_text(f"Job {dead_id}")
        expect(page.locator("#last-error")).to_contain_text("boom on attempt 1")
        expect(page.locator("#egress-blocked")).to_contain_text("pastebin.com:443 is not allowed")
        page.goto(f"{dashboard}/jobs/{seeded.done[0]}")
        expect(page.locator("#result")).to_contain_text('"hello": "acme"')

        # retry a dead job from the overview; it comes back pending
        page.goto(f"{dashboard}/")
        page.click(f'[data-testid="retry-{dead_id}"]')
        expect(page.locator(".notice.ok")).to_contain_text("pending again")
        expect(page.locator(f'#dead tr[data-job="{dead_id}"]')).to_have_count(0)
        assert queue.job(dead_id).status == "pending"
        page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)

        page.goto(f"{dashboard}/jobs/{dead_id}")
        expect(page.locator("h1 .badge")).to_have_text("pending")
        expect(page.locator("#why")).to_be_visible()
        page.goto(f"{dashboard}/jobs/{seeded.pending[0]}")
        expect(page.locator("#why")).to_contain_text("in the future")
        page.screenshot(path=str(artifacts / "dashboard-job.png"), full_page=True)


def test_overview_lists_everything(seeded: Seeded, dashboard: str) -> None:
    html = httpx.get(f"{dashboard}/").text
    assert 'http-equiv="refresh"' in html
    for text in ("acme", "globex", "initech", "gvisor", "web-test-worker", "boom on attempt 1",
                 f'data-job="{seeded.dead[0]}"', f'data-job="{seeded.dead[1]}"'):
        assert text in html
    filtered = httpx.get(f"{dashboard}/", params={"tenant": "globex"}).text
    assert 'data-tenant="globex"' in filtered and 'data-tenant="acme"' not in filtered
    assert httpx.get(f"{dashboard}/", params={"tenant": "<bad>"}).status_code == 400


def test_retry_needs_a_valid_csrf_token(queue: Queue, seeded: Seeded, dashboard: str) -> None:
    dead_id = seeded.dead[0]
    with httpx.Client(base_url=dashboard) as client:
        token = csrf_of(client.get("/").text)
        assert client.post(f"/dead/{dead_id}/retry", data={}).status_code == 403
        assert client.post(f"/dead/{dead_id}/retry", data={"csrf_token": "0" * 64}).status_code == 403
        assert queue.job(dead_id).status == "dead"
    # the right token without the session cookie it belongs to is refused too
    with httpx.Client(base_url=dashboard) as stranger:
        assert stranger.post(f"/dead/{dead_id}/retry", data={"csrf_token": token}).status_code == 403
    assert queue.job(dead_id).status == "dead"

    with httpx.Client(base_url=dashboard) as client:
        token = csrf_of(client.get("/").text)
        response = client.post(f"/dead/{dead_id}/retry", data={"csrf_token": token, "next": "/"})
        assert response.status_code == 303
        assert response.headers["location"] == "/?replayed=1"
        assert queue.job(dead_id).status == "pending"
        # again: not dead any more, nothing changes
        again = client.post(f"/dead/{dead_id}/retry", data={"csrf_token": token, "next": "//evil.example"})
        assert again.status_code == 303 and again.headers["location"] == f"/?not_dead={dead_id}"
        assert client.post("/dead/999999/retry", data={"csrf_token": token}).status_code == 404


def test_retry_all_of_one_tenant(queue: Queue, seeded: Seeded, dashboard: str) -> None:
    with httpx.Client(base_url=dashboard) as client:
        token = csrf_of(client.get("/").text)
        bad = client.post("/dead/retry-all", data={"csrf_token": token, "tenant": "no such/tenant"})
        assert bad.status_code == 400
        assert all(queue.job(i).status == "dead" for i in seeded.dead)
        response = client.post("/dead/retry-all", data={"csrf_token": token, "tenant": "globex"})
        assert response.status_code == 303 and "replayed=2" in response.headers["location"]
    assert all(queue.job(i).status == "pending" for i in seeded.dead)


def test_job_pages_errors_and_escaping(seeded: Seeded, dashboard: str) -> None:
    missing = httpx.get(f"{dashboard}/jobs/999999")
    assert missing.status_code == 404 and "no job with id 999999" in missing.text
    for bad in ("abc", "0", "-1", "99999999999999999999999"):
        response = httpx.get(f"{dashboard}/jobs/{bad}")
        assert response.status_code == 400 and "expected a positive whole number" in response.text
    assert httpx.get(f"{dashboard}/no-such-page").status_code == 404
    found = httpx.get(f"{dashboard}/jobs", params={"id": f" {seeded.xss} "})
    assert found.status_code == 303 and found.headers["location"] == f"/jobs/{seeded.xss}"
    assert httpx.get(f"{dashboard}/jobs", params={"id": "x"}).status_code == 400

    page = httpx.get(f"{dashboard}/jobs/{seeded.xss}")
    assert page.status_code == 200
    assert "<script>alert" not in page.text
    assert "&lt;script&gt;alert(&#39;xss&#39;)&lt;/script&gt;" in page.text
    assert "script-src" not in page.headers["content-security-policy"]  # default-src 'none' covers it
    assert page.headers["x-frame-options"] == "DENY"
    assert httpx.get(f"{dashboard}/healthz").text == "ok"


def _metrics_app() -> ASGIApp:
    registry = CollectorRegistry()
    Counter("tenantq_web_test", "a test counter", registry=registry).inc()
    app: ASGIApp = make_asgi_app(registry=registry)
    return app


def test_token_guards_every_page_and_action(
    queue: Queue, seeded: Seeded, serve_app: Callable[[ASGIApp], str]
) -> None:
    url = serve_app(create_app(queue, token=TOKEN, metrics_app=_metrics_app()))
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/", f"/jobs/{seeded.dead[0]}", "/metrics", "/jobs/999999"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
        assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(f"{url}/dead/{seeded.dead[0]}/retry").status_code == 401
    assert httpx.get(f"{url}/healthz").text == "ok"
    assert httpx.get(f"{url}/", headers=bearer).status_code == 200
    assert "tenantq_web_test_total 1.0" in httpx.get(f"{url}/metrics", headers=bearer).text
    browser = httpx.get(f"{url}/jobs/1?x=1", headers={"Accept": "text/html"})
    assert browser.status_code == 303 and browser.headers["location"] == "/login?next=%2Fjobs%2F1%3Fx%3D1"

    with httpx.Client(base_url=url) as client:
        login = client.get("/login", params={"next": "/jobs/1"})
        assert login.status_code == 200
        token = csrf_of(login.text)
        wrong = client.post("/login", data={"csrf_token": token, "token": "nope", "next": "/"})
        assert wrong.status_code == 401 and "Wrong token" in wrong.text
        assert client.post("/login", data={"token": TOKEN}).status_code == 403  # no CSRF token
        ok = client.post("/login", data={"csrf_token": token, "token": TOKEN, "next": "/jobs/1"})
        assert ok.status_code == 303 and ok.headers["location"] == "/jobs/1"
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and TOKEN not in cookie
        assert client.get("/").status_code == 200
        # the cookie can act, with CSRF
        retried = client.post(f"/dead/{seeded.dead[0]}/retry", data={"csrf_token": token})
        assert retried.status_code == 303
        assert queue.job(seeded.dead[0]).status == "pending"
        assert client.post("/logout", data={"csrf_token": token}).status_code == 303
        assert client.get("/").status_code == 401


def test_metrics_open_without_token(queue: Queue, serve_app: Callable[[ASGIApp], str]) -> None:
    url = serve_app(create_app(queue, metrics_app=_metrics_app()))
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200 and "tenantq_web_test_total" in response.text
    empty = httpx.get(f"{url}/").text
    assert "No tenants yet" in empty
