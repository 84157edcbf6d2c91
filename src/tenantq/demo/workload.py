"""The demo's tenants and their jobs (the handlers are in handlers.py), and
the stand-in CRM that acme's egress rules allow."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tenantq import JobSpec

WHALE = "whale"
SMALL_TENANTS = ("acme", "globex", "initech", "umbrella", "hooli")
HOSTILE = "mallory"
POISON = ("demo.resize_image", "demo.native_codec", "demo.sync_forever", "demo.parse_invoice")
# what each poison job's last error says (the test checks these)
POISON_REASONS = {"demo.resize_image": "oom", "demo.native_codec": "sigsegv",
                  "demo.sync_forever": "timeout", "demo.parse_invoice": "cannot parse invoice"}
TRANSFORM = "def transform(rows):\n    return {'total': sum(r['amount'] for r in rows), 'rows': len(rows)}\n"
# scene 2: the small tenants whose interactive reports arrive during the bulk import
INTERACTIVE_ARRIVALS = ("acme", "globex", "hooli")


def whale_rows(n: int, *, priority: str = "default", start: int = 0) -> list[JobSpec]:
    """A bulk import: one job per CSV row."""
    return [JobSpec(WHALE, "demo.import_row", {"Email": f"user{i}@whale.example", "Plan": "pro"},
                    priority=priority)
            for i in range(start, start + n)]


def small_work(reports: int, poison: tuple[str, ...], crm: str | None) -> list[JobSpec]:
    """The small tenants' everyday work, all in class default: reports, a
    webhook that fails once, an inline audit log; initech's own transform;
    mallory's poison jobs and network calls (when sandboxed: `crm` set)."""
    specs: list[JobSpec] = []
    for tenant in SMALL_TENANTS:
        specs += [JobSpec(tenant, "demo.render_report", {"month": m % 12 + 1}) for m in range(reports)]
        specs.append(JobSpec(tenant, "demo.flaky_webhook", {"event": "invoice.paid"}))
        specs.append(JobSpec(tenant, "demo.audit_log", {"event": "report.viewed"}))
    specs.append(JobSpec("initech", "tenantq.python", {"source": TRANSFORM,
                                                       "input": [{"amount": 120}, {"amount": 80}]}))
    specs += [JobSpec(HOSTILE, kind, {"invoice": "INV-7"}, max_attempts=2) for kind in poison]
    if crm is not None:
        specs.append(JobSpec("acme", "demo.push_crm", {"crm": crm}))
        specs.append(JobSpec(HOSTILE, "demo.exfiltrate",
                             {"targets": [crm, "http://pastebin.com/raw/upload"]}, max_attempts=1))
    return specs


def interactive_report(tenant: str) -> JobSpec:
    return JobSpec(tenant, "demo.render_report", {"month": 12}, priority="interactive")


def secrets_for(tenant: str) -> dict[str, str]:
    """Each tenant's one secret; a report says whether it saw only its own."""
    return {"API_KEY": f"{tenant}-key"}


class _CRM(BaseHTTPRequestHandler):
    """Stands in for a tenant's external CRM API (on 127.0.0.1, which the
    demo's egress proxy is told to allow)."""

    def do_GET(self) -> None:
        body = b"record stored"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class CRMServer:
    def __init__(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _CRM)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/records"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
