"""Finding jobs: the filters of `tenantq jobs` and the dashboard's search,
validated into a `JobFilter`, and the keyset cursor of its pages.

Every filter is checked here, before a statement runs: bad input is one
line (`InvalidInput`) and changes nothing. The statements are in
sql/search.sql; each one's `{filters}` is the `filters` block there, so the
listing, the counts and the bulk actions select exactly the same jobs.

Pages are newest first and keyset-paginated: a cursor names the last job
shown (its created_at and id) and the next page starts just below it, never
with OFFSET, so a page costs the same however deep it is.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any, LiteralString

from psycopg.types.json import Jsonb

from tenantq.domain import validation
from tenantq.errors import InvalidInput
from tenantq.store.queries import composed

STATUSES = ("pending", "running", "done", "dead", "cancelled")
DEFAULT_LIMIT = 50
MAX_LIMIT = 1000
# the bulk actions change at most this many jobs per statement (one
# transaction each, so no statement holds many row locks for long)
CHUNK = 1000
# --since: a number and a unit (30s, 15m, 1h, 7d, 2w), up to ten years back
SINCE = re.compile(r"^\s*(\d{1,9})\s*([smhdw])\s*$")
SINCE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_SINCE_SECONDS = 3650 * 86400
# a cursor: the last job's created_at (microseconds since the epoch) and id
CURSOR = re.compile(r"^(-?\d{1,18})\.(\d{1,19})$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MAX_ID = 2**63 - 1


@dataclass(frozen=True)
class Cursor:
    """Where a page ends: the next page holds the jobs strictly older."""

    created_at: datetime
    id: int

    @property
    def token(self) -> str:
        micros = (self.created_at - _EPOCH) // timedelta(microseconds=1)
        return f"{micros}.{self.id}"


@dataclass(frozen=True)
class JobFilter:
    """A validated set of filters; None (or empty) means "any"."""

    tenant: str | None = None
    kind: str | None = None
    status: str | None = None
    actor: str | None = None
    meta: dict[str, Any] | None = None
    since_seconds: float | None = None
    priority: str | None = None

    @property
    def empty(self) -> bool:
        return all(v is None for v in (self.tenant, self.kind, self.status, self.actor, self.meta,
                                       self.since_seconds, self.priority))

    def params(self, now: datetime | None = None) -> dict[str, Any]:
        """The statement parameters of the `filters` block."""
        return {
            "tenant_id": self.tenant, "kind": self.kind, "status": self.status, "actor": self.actor,
            "meta": None if self.meta is None else Jsonb(self.meta),
            "since_seconds": self.since_seconds, "priority": self.priority, "now": now,
        }

    def query_items(self) -> list[tuple[str, str]]:
        """The filters as URL query items (the dashboard's links and forms)."""
        items = [(name, value) for name, value in (("tenant", self.tenant), ("kind", self.kind),
                                                   ("status", self.status), ("actor", self.actor),
                                                   ("priority", self.priority))
                 if value is not None]
        if self.meta is not None:
            items += [("meta", item) for item in meta_items(self.meta)]
        if self.since_seconds is not None:
            items.append(("since", since_text(self.since_seconds)))
        return items


@dataclass
class JobPage:
    """One page of `Queue.find_jobs`: the jobs, newest first, and the cursor
    of the next (older) page, None on the last page."""

    jobs: list[dict[str, Any]] = field(default_factory=list)
    next_before: str | None = None


def job_filter(
    *,
    tenant: object = None,
    kind: object = None,
    status: object = None,
    actor: object = None,
    meta: object = None,
    since: object = None,
    priority: object = None,
) -> JobFilter:
    """Validate every filter (see the module docstring); "" counts as unset."""
    return JobFilter(
        tenant=None if _unset(tenant) else validation.tenant_id(tenant),
        kind=None if _unset(kind) else validation.kind(kind),
        status=None if _unset(status) else parse_status(status),
        actor=None if _unset(actor) else validation.actor(actor),
        meta=parse_meta(meta),
        since_seconds=parse_since(since),
        priority=None if _unset(priority) else validation.priority(priority),
    )


def _unset(value: object) -> bool:
    return value is None or value == ""


def parse_status(value: object) -> str:
    if isinstance(value, str) and value in STATUSES:
        return value
    raise InvalidInput(f"unknown status {validation._shown(value)}: use one of {', '.join(STATUSES)}")


def parse_meta(value: object) -> dict[str, Any] | None:
    """The meta filter: a dict (matched by containment, `meta @> filter`),
    or KEY=VALUE items (the values are strings, as `enqueue --meta` stores
    them), or one JSON object as text (for values that are not strings)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        meta = dict(value)
    elif isinstance(value, str):
        meta = _meta_from_items([value])
    elif isinstance(value, Iterable):
        items = [v for v in value if v != ""]
        if not all(isinstance(v, str) for v in items):
            raise InvalidInput("meta filters are KEY=VALUE strings")
        meta = _meta_from_items(items)
    else:
        raise InvalidInput(f"meta filter must be KEY=VALUE items or a JSON object, got "
                           f"{validation._shown(value)}")
    if not meta:
        return None
    for key in meta:
        if not isinstance(key, str) or not key:
            raise InvalidInput(f"meta filter keys must be non-empty strings, got {validation._shown(key)}")
    validation.meta_json(meta)  # what enqueue would accept: size, depth, JSON-ness
    return meta


def _meta_from_items(items: list[str]) -> dict[str, Any]:
    if len(items) == 1 and items[0].lstrip().startswith("{"):
        try:
            parsed = json.loads(items[0])
        except (ValueError, RecursionError) as exc:
            raise InvalidInput(f"meta filter is not a JSON object: {str(exc)[:80]}") from None
        if not isinstance(parsed, dict):
            raise InvalidInput("meta filter must be a JSON object")
        return parsed
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise InvalidInput(f"meta filter takes KEY=VALUE, got {validation._shown(item)}")
        if name in out and out[name] != value:
            raise InvalidInput(f"meta filter gives {name!r} twice with different values")
        out[name] = value
    return out


def meta_items(meta: Mapping[str, Any]) -> list[str]:
    """A meta filter as KEY=VALUE items, or one JSON object when a value is
    not a string (the inverse of parse_meta)."""
    if all(isinstance(v, str) and "=" not in k for k, v in meta.items()):
        return [f"{k}={v}" for k, v in meta.items()]
    return [json.dumps(dict(meta), ensure_ascii=False, separators=(",", ":"))]


def parse_since(value: object) -> float | None:
    """`since`: 30s, 15m, 1h, 7d, 2w; or seconds as a number; or a timedelta."""
    if _unset(value):
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := SINCE.fullmatch(value)):
        seconds = float(int(match[1]) * SINCE_UNITS[match[2]])
    else:
        raise InvalidInput(f"since must be a number and a unit such as 30s, 15m, 1h or 7d, got "
                           f"{validation._shown(value)}")
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_SINCE_SECONDS:
        raise InvalidInput(f"since must be more than 0 and at most {MAX_SINCE_SECONDS // 86400} days")
    return seconds


def since_text(seconds: float) -> str:
    """Seconds as the shortest exact `since` text (3600 -> 1h)."""
    whole = int(seconds)
    if whole != seconds:
        return f"{seconds:g}s"
    for unit in ("w", "d", "h", "m"):
        if whole % SINCE_UNITS[unit] == 0:
            return f"{whole // SINCE_UNITS[unit]}{unit}"
    return f"{whole}s"


def parse_limit(value: object) -> int:
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 9:
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise InvalidInput(f"limit must be a whole number from 1 to {MAX_LIMIT}, "
                           f"got {validation._shown(value)}")
    return value


def parse_cursor(value: object) -> Cursor | None:
    """A page cursor (`before`) as handed out with the previous page."""
    if _unset(value):
        return None
    match = CURSOR.fullmatch(value) if isinstance(value, str) else None
    if match is None or not 0 < int(match[2]) <= MAX_ID:
        raise InvalidInput(f"before must be a cursor as printed with the previous page, got "
                           f"{validation._shown(value)}")
    try:
        created_at = _EPOCH + timedelta(microseconds=int(match[1]))
    except OverflowError:
        raise InvalidInput(f"before: cursor {validation._shown(value)} is out of range") from None
    return Cursor(created_at=created_at, id=int(match[2]))


def cursor_of(row: Mapping[str, Any]) -> str:
    created_at = row["created_at"]
    assert isinstance(created_at, datetime)
    return Cursor(created_at=created_at, id=int(row["id"])).token


@cache
def statement(name: str) -> LiteralString:
    """The block `name` of search.sql, its `{filters}` filled in."""
    return composed("search", name, filters="filters")
