"""The web dashboard: server-rendered pages over the read API of `Queue`.

    create_app(queue, token=None, metrics_app=None) -> Starlette
    serve(queue, host="127.0.0.1", port=8080, token=None, metrics_app=None)

Routes: GET / (overview, auto-refreshing), GET /jobs (finding jobs: filters,
pages newest first; /jobs?id=N opens job N), GET /jobs/{id}, POST /jobs/cancel
and POST /jobs/retry-dead (bulk actions on a filtered set), POST
/jobs/{id}/cancel (one pending or running job), POST /tenants/pause and
/tenants/resume, POST /dead/{id}/retry, POST /dead/retry-all, GET|POST /login
and POST /logout (with a token), GET /healthz (always open), GET /metrics
(when a metrics app is given).

Queue is synchronous (psycopg), so every database call runs in the thread
pool; the event loop only renders and routes.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import signal
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit
from zoneinfo import ZoneInfo

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Receive, Scope, Send

from tenantq.domain import validation
from tenantq.errors import DatabaseUnavailable, InvalidInput, JobNotFound, TenantqError
from tenantq.queue import Queue
from tenantq.store import search
from tenantq.store.queries import sql
from tenantq.web.format import environment
from tenantq.web.security import (
    AUTH_COOKIE,
    CSRF_FIELD,
    SESSION_COOKIE,
    GuardMiddleware,
    Keys,
    safe_next,
)

log = logging.getLogger("tenantq.web")

T = TypeVar("T")

REFRESH_SECONDS = 5
RECENT_FAILURES = 20
DEAD_LIMIT = 100
MAX_FORM_BYTES = 64 * 1024
MAX_ID = 2**63 - 1
# query parameters that only carry a notice about the last action
NOTICES = ("replayed", "not_dead", "cancelled", "paused", "resumed", "job_cancel")
# who `cancel(..., by=)` records for a cancel from the dashboard
CANCELLED_BY = "dashboard"
JOB_CANCEL_NOTICES = ("cancelled", "stopping", "ended")


def parse_id(raw: str) -> int:
    """A job id from the URL: a positive bigint, or 400 with one clear line."""
    if not raw.isascii() or not raw.isdigit() or not 0 < int(raw) <= MAX_ID:
        shown = raw if len(raw) <= 40 else raw[:40] + "…"
        raise HTTPException(400, f"bad job id {shown!r}: expected a positive whole number")
    return int(raw)


def _with_query(path: str, **params: int | str) -> str:
    """`path` with the notice parameters replaced by `params`."""
    parts = urlsplit(path)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k not in NOTICES]
    query += [(k, str(v)) for k, v in params.items()]
    return urlunsplit(("", "", parts.path, urlencode(query), ""))


def _int_param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name, "")
    return int(raw) if raw.isdigit() and len(raw) < 20 else None


def local_time(value: datetime | None, zone: str) -> str:
    """A fire time in its schedule's time zone: '2026-12-02 09:00 CET'."""
    if value is None:
        return "—"
    try:
        return value.astimezone(ZoneInfo(zone)).strftime("%Y-%m-%d %H:%M %Z")
    except (ValueError, KeyError, OSError):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _tenant_param(request: Request, name: str) -> str | None:
    """A tenant id carried by a notice parameter, if it is one."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        return validation.tenant_id(raw)
    except InvalidInput:
        return None


def _filter_kwargs(filters: search.JobFilter) -> dict[str, Any]:
    """A validated filter (less its status) as keyword arguments of the
    Queue's search operations."""
    return {"tenant": filters.tenant, "kind": filters.kind, "actor": filters.actor, "meta": filters.meta,
            "since": filters.since_seconds}


class _Asgi:
    """Wraps an ASGI callable so Route treats it as an app, not as a
    request -> response function (a plain function would be mistaken for one)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class Dashboard:
    """The handlers, bound to one Queue and one set of keys."""

    def __init__(self, queue: Queue, keys: Keys) -> None:
        self.queue = queue
        self.keys = keys
        env = environment()
        env.filters["local_time"] = local_time
        self.templates = Jinja2Templates(env=env)

    # -- helpers ---------------------------------------------------------
    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await run_in_threadpool(fn, *args, **kwargs)

    def rows(self, block: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        # The dashboard's own read queries (web.sql) share the Queue's pool.
        with self.queue._pool_connection() as conn:
            rows: list[dict[str, Any]] = conn.execute(sql("web", block), params).fetchall()
            return rows

    def render(self, request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
        """Render a page; hands out the session nonce its CSRF token is bound to."""
        nonce = request.cookies.get(SESSION_COOKIE)
        fresh = not nonce or len(nonce) > 64
        if fresh:
            nonce = Keys.new_nonce()
        assert nonce is not None
        full = {
            "csrf_field": CSRF_FIELD,
            "csrf_token": self.keys.csrf_token(nonce),
            "auth_enabled": self.keys.token is not None,
            "path": request.url.path + (f"?{request.url.query}" if request.url.query else ""),
            "refresh": None,
            **context,
        }
        response = self.templates.TemplateResponse(request, name, full, status_code=status)
        if fresh:
            response.set_cookie(SESSION_COOKIE, nonce, httponly=True, samesite="strict", path="/")
        return response

    async def checked_form(self, request: Request) -> FormData:
        """The POSTed form, after the CSRF check (403 and no change on failure)."""
        # Forms are tiny; a body without a length (chunked) or a big one is
        # refused before it is read.
        length = request.headers.get("content-length", "")
        if not length.isdigit():
            raise HTTPException(411, "a form POST needs a Content-Length")
        if int(length) > MAX_FORM_BYTES:
            raise HTTPException(413, "form too large")
        form = await request.form(max_files=0, max_fields=20)
        submitted = form.get(CSRF_FIELD)
        if not self.keys.csrf_ok(request.cookies.get(SESSION_COOKIE),
                                 submitted if isinstance(submitted, str) else None):
            raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")
        return form

    @staticmethod
    def field(form: FormData, name: str) -> str | None:
        value = form.get(name)
        return value if isinstance(value, str) and value else None

    # -- pages -----------------------------------------------------------
    async def overview(self, request: Request) -> Response:
        raw_tenant = request.query_params.get("tenant") or None
        tenant = validation.tenant_id(raw_tenant) if raw_tenant is not None else None
        data = await self.db(self._overview_data, tenant)
        refresh_url = "/" + (f"?{urlencode({'tenant': tenant})}" if tenant else "")
        return self.render(request, "overview.html", {
            **data,
            "tenant": tenant,
            "refresh": REFRESH_SECONDS,
            "refresh_url": refresh_url,
            "replayed": _int_param(request, "replayed"),
            "not_dead": _int_param(request, "not_dead"),
            "paused_notice": _tenant_param(request, "paused"),
            "resumed_notice": _tenant_param(request, "resumed"),
        })

    def _overview_data(self, tenant: str | None) -> dict[str, Any]:
        queues = self.queue.status(tenant)
        tenants = self.queue.tenants(tenant)
        totals: dict[str, dict[str, int]] = {}
        for row in queues:
            into = totals.setdefault(str(row["tenant_id"]), {})
            for key in ("pending", "running", "done", "dead"):
                into[key] = into.get(key, 0) + int(row[key])
        batches = [b for b in self.queue.running_batches() if tenant is None or b["tenant_id"] == tenant]
        params = {"tenant_id": tenant, "limit": RECENT_FAILURES}
        dead_total = self.rows("dead_count", {"tenant_id": tenant})[0]["n"]
        return {
            "queues": queues,
            "tenants": tenants,
            "totals": totals,
            "batches": batches,
            "workers": self.queue.workers(),
            "failures": self.rows("recent_failures", params),
            "dead": self.queue.dead_jobs(tenant, limit=DEAD_LIMIT),
            "dead_total": int(dead_total),
            "schedules": self.queue.schedules(tenant),
        }

    async def job(self, request: Request) -> Response:
        job_id = parse_id(request.path_params["job_id"])
        info, tenant = await self.db(self._job_data, job_id)
        notice = request.query_params.get("job_cancel")
        return self.render(request, "job.html", {
            "job": info,
            "tenant_paused_at": None if tenant is None else tenant.get("paused_at"),
            "replayed": _int_param(request, "replayed"),
            "not_dead": _int_param(request, "not_dead"),
            "job_cancel": notice if notice in JOB_CANCEL_NOTICES else None,
        })

    def _job_data(self, job_id: int) -> tuple[Any, dict[str, Any] | None]:
        info = self.queue.job(job_id)
        tenants = self.queue.tenants(info.tenant_id)
        return info, (tenants[0] if tenants else None)

    async def find_job(self, request: Request) -> Response:
        """The header's "job id" box: GET /jobs?id=N -> /jobs/N."""
        job_id = parse_id(request.query_params.get("id", "").strip())
        return RedirectResponse(f"/jobs/{job_id}", status_code=303)

    async def jobs_page(self, request: Request) -> Response:
        """GET /jobs: the search form and one page of matching jobs, newest
        first; the "job id" box (GET /jobs?id=N) opens job N."""
        if "id" in request.query_params:
            return await self.find_job(request)
        query = request.query_params
        text = {name: query.get(name, "") for name in ("tenant", "kind", "status", "actor", "since", "limit")}
        meta = [item for item in query.getlist("meta") if item]
        form: dict[str, Any] = {**text, "meta": meta}
        try:
            filters = search.job_filter(
                tenant=text["tenant"].strip(), kind=text["kind"].strip(), status=text["status"].strip(),
                actor=text["actor"], meta=meta, since=text["since"].strip())
            limit = search.parse_limit(text["limit"].strip() or search.DEFAULT_LIMIT)
            before = query.get("before") or None
            search.parse_cursor(before)
        except InvalidInput as exc:
            return self.render(request, "search.html", {
                **self._search_context(request, form, None, search.DEFAULT_LIMIT),
                "error": str(exc)}, status=400)
        page, counts = await self.db(self._search_data, filters, limit, before)
        context = self._search_context(request, form, filters, limit)
        items = context["filter_items"]
        return self.render(request, "search.html", {
            **context,
            "page": page,
            "counts": counts,
            "paged": before is not None,
            "older_url": None if page.next_before is None else
                "/jobs?" + urlencode([*items, ("before", page.next_before)]),
        })

    def _search_context(self, request: Request, form: dict[str, Any], filters: search.JobFilter | None,
                        limit: int) -> dict[str, Any]:
        items = [] if filters is None else filters.query_items()
        if limit != search.DEFAULT_LIMIT:
            items.append(("limit", str(limit)))
        return {
            "form": form, "filters": filters, "statuses": search.STATUSES, "error": None,
            "page": None, "counts": None, "paged": False, "older_url": None,
            "filter_items": items,
            "newest_url": "/jobs" + (f"?{urlencode(items)}" if items else ""),
            "replayed": _int_param(request, "replayed"),
            "cancelled": _int_param(request, "cancelled"),
        }

    def _search_data(self, filters: search.JobFilter, limit: int,
                     before: str | None) -> tuple[search.JobPage, dict[str, int]]:
        kwargs = _filter_kwargs(filters)
        page = self.queue.find_jobs(**kwargs, status=filters.status, limit=limit, before=before)
        counts = self.queue.actionable_counts(**kwargs, status=filters.status)
        return page, counts

    def form_filters(self, form: FormData, *, status: str) -> search.JobFilter:
        """The filters a bulk action's form carries (its search's), validated;
        a status other than the one the action acts on is refused."""
        filters = search.job_filter(
            tenant=self.field(form, "tenant"), kind=self.field(form, "kind"),
            status=self.field(form, "status"), actor=self.field(form, "actor"),
            meta=[item for item in form.getlist("meta") if isinstance(item, str) and item],
            since=self.field(form, "since"))
        if filters.status not in (None, status):
            raise InvalidInput(f"this action acts on {status} jobs only, not on {filters.status} ones")
        return filters

    # -- actions ---------------------------------------------------------
    async def bulk_cancel(self, request: Request) -> Response:
        """POST /jobs/cancel: cancel every pending job of the search's
        filters (at least one filter: never every tenant's by accident)."""
        form = await self.checked_form(request)
        filters = self.form_filters(form, status="pending")
        cancelled = await self.db(self.queue.cancel_jobs, **_filter_kwargs(filters))
        back = safe_next(self.field(form, "next"), default="/jobs")
        return RedirectResponse(_with_query(back, cancelled=cancelled), status_code=303)

    async def bulk_retry_dead(self, request: Request) -> Response:
        """POST /jobs/retry-dead: replay every dead job of the search's
        filters (none: every dead job, as the overview's "retry all")."""
        form = await self.checked_form(request)
        filters = self.form_filters(form, status="dead")
        replayed = await self.db(self.queue.retry_dead_jobs, **_filter_kwargs(filters), everything=True)
        back = safe_next(self.field(form, "next"), default="/jobs")
        return RedirectResponse(_with_query(back, replayed=replayed), status_code=303)

    async def cancel_one(self, request: Request) -> Response:
        """POST /jobs/{id}/cancel: a pending job ends cancelled now; a
        running one is asked to stop (its worker stops it)."""
        form = await self.checked_form(request)
        job_id = parse_id(request.path_params["job_id"])
        back = safe_next(self.field(form, "next"), default=f"/jobs/{job_id}")
        outcome = await self.db(self._cancel, job_id)
        return RedirectResponse(_with_query(back, job_cancel=outcome), status_code=303)

    def _cancel(self, job_id: int) -> str:
        if not self.queue.cancel(job_id, by=CANCELLED_BY):  # JobNotFound -> 404
            return "ended"
        return "cancelled" if self.queue.job(job_id).status == "cancelled" else "stopping"

    async def pause_tenant(self, request: Request) -> Response:
        return await self._set_paused(request, paused=True)

    async def resume_tenant(self, request: Request) -> Response:
        return await self._set_paused(request, paused=False)

    async def _set_paused(self, request: Request, *, paused: bool) -> Response:
        """POST /tenants/pause|resume (form field `tenant`)."""
        form = await self.checked_form(request)
        tenant = validation.tenant_id(self.field(form, "tenant"))
        await self.db(self.queue.pause_tenant, tenant, paused=paused)
        back = safe_next(self.field(form, "next"))
        if paused:
            return RedirectResponse(_with_query(back, paused=tenant), status_code=303)
        return RedirectResponse(_with_query(back, resumed=tenant), status_code=303)

    async def retry_one(self, request: Request) -> Response:
        form = await self.checked_form(request)
        job_id = parse_id(request.path_params["job_id"])
        back = safe_next(self.field(form, "next"))
        replayed = await self.db(self.queue.retry_dead, [job_id])
        if replayed:
            return RedirectResponse(_with_query(back, replayed=len(replayed)), status_code=303)
        await self.db(self.queue.job, job_id)  # JobNotFound -> 404 for an unknown id
        return RedirectResponse(_with_query(back, not_dead=job_id), status_code=303)

    async def retry_all(self, request: Request) -> Response:
        form = await self.checked_form(request)
        raw_tenant = self.field(form, "tenant")
        tenant = validation.tenant_id(raw_tenant) if raw_tenant is not None else None
        replayed = await self.db(self.queue.retry_dead, None, tenant=tenant)
        back = safe_next(self.field(form, "next"))
        return RedirectResponse(_with_query(back, replayed=len(replayed)), status_code=303)

    # -- login -----------------------------------------------------------
    async def login_page(self, request: Request) -> Response:
        back = safe_next(request.query_params.get("next"))
        if self.keys.token is None or self.keys.authenticated(request):
            return RedirectResponse(back, status_code=303)
        return self.render(request, "login.html", {"next": back, "error": None})

    async def login(self, request: Request) -> Response:
        if self.keys.token is None:
            return RedirectResponse("/", status_code=303)
        form = await self.checked_form(request)
        back = safe_next(self.field(form, "next"))
        if not self.keys.token_ok(self.field(form, "token")):
            return self.render(request, "login.html", {"next": back, "error": "Wrong token."}, status=401)
        response = RedirectResponse(back, status_code=303)
        response.set_cookie(AUTH_COOKIE, self.keys.auth_cookie_value(), httponly=True,
                            samesite="strict", path="/")
        return response

    async def logout(self, request: Request) -> Response:
        await self.checked_form(request)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(AUTH_COOKIE, path="/", httponly=True, samesite="strict")
        return response

    async def healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    # -- errors ----------------------------------------------------------
    def error_page(self, request: Request, status: int, message: str) -> Response:
        titles = {400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found",
                  405: "Method not allowed", 411: "Length required", 413: "Too large",
                  500: "Server error", 503: "Database unavailable"}
        return self.render(request, "error.html", {
            "status": status, "title": titles.get(status, "Error"), "message": message,
        }, status=status)

    async def on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return self.error_page(request, exc.status_code, str(exc.detail))

    async def on_tenantq_error(self, request: Request, exc: Exception) -> Response:
        if isinstance(exc, JobNotFound):
            status = 404
        elif isinstance(exc, InvalidInput):
            status = 400
        elif isinstance(exc, DatabaseUnavailable):
            status = 503
        else:
            status = 500
        return self.error_page(request, status, str(exc))


def create_app(queue: Queue, *, token: str | None = None, metrics_app: ASGIApp | None = None) -> Starlette:
    """The dashboard as an ASGI app. With `token`, every page and action
    (and /metrics) needs `Authorization: Bearer <token>` or a login."""
    if token is not None and not token:
        raise InvalidInput("the dashboard token must not be empty")
    keys = Keys(token)
    dash = Dashboard(queue, keys)
    routes: list[BaseRoute] = [
        Route("/", dash.overview),
        Route("/jobs", dash.jobs_page),
        Route("/jobs/cancel", dash.bulk_cancel, methods=["POST"]),
        Route("/jobs/retry-dead", dash.bulk_retry_dead, methods=["POST"]),
        Route("/jobs/{job_id}", dash.job),
        Route("/jobs/{job_id}/cancel", dash.cancel_one, methods=["POST"]),
        Route("/tenants/pause", dash.pause_tenant, methods=["POST"]),
        Route("/tenants/resume", dash.resume_tenant, methods=["POST"]),
        Route("/dead/retry-all", dash.retry_all, methods=["POST"]),
        Route("/dead/{job_id}/retry", dash.retry_one, methods=["POST"]),
        Route("/login", dash.login_page, methods=["GET"]),
        Route("/login", dash.login, methods=["POST"]),
        Route("/logout", dash.logout, methods=["POST"]),
        Route("/healthz", dash.healthz),
    ]
    if metrics_app is not None:
        routes.append(Route("/metrics", _Asgi(metrics_app), methods=["GET"]))
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: dash.on_http_error, TenantqError: dash.on_tenantq_error},
    )
    app.add_middleware(GuardMiddleware, keys=keys)
    return app


def _log_config() -> dict[str, Any]:
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["tenantq.web"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def serve(
    queue: Queue,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    metrics_app: ASGIApp | None = None,
) -> None:
    """Run the dashboard under uvicorn until SIGINT/SIGTERM (blocking)."""
    app = create_app(queue, token=token, metrics_app=metrics_app)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            log_config=_log_config(), ws="none", lifespan="off", server_header=False)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM/SIGINT itself (graceful shutdown) and then
    # re-raises the signal through the handler it found installed; a quiet
    # handler here makes that a normal return, so the command exits 0.
    previous = {sig: signal.signal(sig, lambda signum, frame: None)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        asyncio.run(_serve(server, host, token is not None))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _serve(server: uvicorn.Server, host: str, has_token: bool) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname() if server.servers else (host, 0)
        shown = f"[{bound[0]}]" if ":" in str(bound[0]) else str(bound[0])
        log.info("tenantq dashboard on http://%s:%s/", shown, bound[1])
        if not has_token and not _is_loopback(host):
            log.warning("listening on %s without --token: anyone who can reach it can replay jobs", host)
    await task


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return all(info[4][0] in ("127.0.0.1", "::1") or str(info[4][0]).startswith("127.") for info in infos)
