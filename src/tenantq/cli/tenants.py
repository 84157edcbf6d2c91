"""`tenantq tenant ...`, `tenantq kind ...`, `tenantq rates`: per-tenant
settings (weight, cap, egress, retention, pause) and rate limits."""

from __future__ import annotations

import click

from tenantq.cli._common import queue
from tenantq.errors import InvalidInput


def _rate_value(text: str) -> str | None:
    """A rate as given (checked now, one line if bad), or None for `none`."""
    from tenantq.store.rates import parse_rate

    if text.strip().lower() in ("none", "off", "0"):
        return None
    parse_rate(text)
    return text


@click.group()
def tenant() -> None:
    """Tenant settings."""


@tenant.command("set")
@click.argument("tenant_id")
@click.option("--weight", type=int, default=None, help="Plan-tier weight (default 1).")
@click.option("--max-sandboxes", type=int, default=None, help="Cap on running batches; 0 = no cap.")
@click.option("--egress", default=None,
              help='Hosts its sandboxed jobs may reach: "api.stripe.com,*.salesforce.com:443"; "" = none.')
@click.option("--retain-done", default=None, metavar="DURATION",
              help="Keep its done jobs this long (30d, 12h...); default: TENANTQ_RETAIN_DONE again.")
@click.option("--retain-cancelled", default=None, metavar="DURATION",
              help="Keep its cancelled jobs this long; default: TENANTQ_RETAIN_CANCELLED again.")
@click.option("--retain-dead", default=None, metavar="DURATION",
              help="Keep its dead jobs this long; default: TENANTQ_RETAIN_DEAD again.")
@click.option("--rate", default=None, metavar="RATE",
              help="Start at most this many of its jobs: 10/s, 100/m, 5000/h; none = no limit.")
@click.option("--burst", type=float, default=None,
              help="With --rate: jobs that may start at once (default 1 s).")
@click.option("--rate-kind", "rate_kinds", multiple=True, metavar="KIND=RATE",
              help="Limit one of its kinds: reports.render=2/s (repeatable; KIND=none lifts it).")
@click.option("--host-functions", default=None, metavar="NAMES",
              help='Host functions its handlers may call: "orders.for_month,crm.lookup"; "" = none; '
                   '"*" = every one they declare (the default).')
def tenant_set(tenant_id: str, weight: int | None, max_sandboxes: int | None, egress: str | None,
               retain_done: str | None, retain_cancelled: str | None, retain_dead: str | None,
               rate: str | None, burst: float | None, rate_kinds: tuple[str, ...],
               host_functions: str | None) -> None:
    """Set a tenant's weight, concurrency cap, egress rules, retention
    (how long its finished jobs are kept, per status; the word `default`
    removes the tenant's own window), rate limits (docs/rate-limits.md) and
    the host functions its handlers may call (docs/tenant-data.md)."""
    limits: list[tuple[str | None, str, float | None]] = [(None, rate, burst)] if rate is not None else []
    for item in rate_kinds:
        kind_name, sep, kind_rate = item.partition("=")
        if not sep or not kind_name or not kind_rate:
            raise InvalidInput(f"--rate-kind takes KIND=RATE such as reports.render=2/s, got {item!r}")
        limits.append((kind_name, kind_rate, None))
    if burst is not None and rate is None:
        raise InvalidInput("--burst goes with --rate")
    with queue() as q:
        for _, kind_rate, _ in limits:  # validated before anything is written
            _rate_value(kind_rate)
        row = q.set_tenant(tenant_id, weight=weight, max_sandboxes=max_sandboxes, egress=egress,
                           retain_done=retain_done, retain_cancelled=retain_cancelled,
                           retain_dead=retain_dead, host_functions=host_functions)
        for limited, kind_rate, kind_burst in limits:
            q.set_rate_limit(tenant_id, limited, rate=_rate_value(kind_rate), burst=kind_burst)
    from tenantq.render import seconds_text

    cap = row["max_sandboxes"] if row["max_sandboxes"] is not None else "none"
    windows = [row.get(f"retain_{status}_seconds") for status in ("done", "cancelled", "dead")]
    retention = ""
    if any(w is not None for w in windows) or (retain_done, retain_cancelled, retain_dead) != (None,) * 3:
        retention = (f"retain done {seconds_text(windows[0])}, cancelled {seconds_text(windows[1])}, "
                     f"dead {seconds_text(windows[2])}, ")
    functions = ""
    if row.get("host_functions") is not None or host_functions is not None:
        allowed = row.get("host_functions")
        functions = (", host functions: every declared one" if allowed is None
                     else f", host functions: {', '.join(allowed) or 'none'}")
    click.echo(f"tenant {row['tenant_id']}: weight {row['weight']}, max sandboxes {cap}, {retention}"
               f"egress {', '.join(row['egress']) or 'none'}{functions}")
    for limited, kind_rate, _ in limits:
        scope = f"kind {limited}" if limited else "all its kinds"
        click.echo(f"  rate limit ({scope}): {kind_rate}" if _rate_value(kind_rate) is not None
                   else f"  rate limit ({scope}): none")


@tenant.command("pause")
@click.argument("tenant_id")
def tenant_pause(tenant_id: str) -> None:
    """Pause a tenant: no new batch of its jobs starts (running ones
    finish); enqueueing goes on; `tenantq job` says why its jobs wait."""
    with queue() as q:
        q.pause_tenant(tenant_id, paused=True)
    click.echo(f"paused tenant {tenant_id}: no new batch of its jobs starts; running ones finish")


@tenant.command("resume")
@click.argument("tenant_id")
def tenant_resume(tenant_id: str) -> None:
    """Resume a paused tenant: its jobs are picked again."""
    with queue() as q:
        q.pause_tenant(tenant_id, paused=False)
    click.echo(f"resumed tenant {tenant_id}")


@click.group()
def kind() -> None:
    """Settings of a kind across every tenant."""


@kind.command("set")
@click.argument("kind_name", metavar="KIND")
@click.option("--rate", required=True, metavar="RATE",
              help="Start at most this many jobs of this kind over all tenants: 50/s; none = no limit.")
@click.option("--burst", type=float, default=None, help="Jobs that may start at once (default 1 s).")
def kind_set(kind_name: str, rate: str, burst: float | None) -> None:
    """Limit a kind across every tenant (a shared downstream API); the
    tenants share the limit by taking turns."""
    value = _rate_value(rate)
    with queue() as q:
        q.set_rate_limit(kind=kind_name, rate=value, burst=burst)
    click.echo(f"kind {kind_name}: rate limit {value or 'none'} across every tenant")


@click.command()
@click.option("--tenant", default=None, help="Only the limits that cover this tenant.")
@click.option("--json", "as_json", is_flag=True)
def rates(tenant: str | None, as_json: bool) -> None:
    """Every rate limit, with the tokens each bucket holds now."""
    import json

    from tenantq.store.rates import rate_text

    with queue() as q:
        rows = q.rate_limits(tenant)
    if as_json:
        click.echo(json.dumps(rows, default=str, indent=2))
        return
    if not rows:
        click.echo("no rate limits")
    for row in rows:
        if row["tenant_id"] and row["kind"]:
            scope = f"tenant {row['tenant_id']}, kind {row['kind']}"
        elif row["tenant_id"]:
            scope = f"tenant {row['tenant_id']}"
        else:
            scope = f"kind {row['kind']} (all tenants)"
        click.echo(f"{scope}: {rate_text(float(row['per_second']))}, burst {float(row['burst']):g}, "
                   f"tokens now {float(row['tokens']):.1f}")
