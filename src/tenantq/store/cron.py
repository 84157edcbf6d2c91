"""Cron expressions and time zones (croniter, zoneinfo), kept apart from
the store so that `@tenantq.periodic` can check them anywhere, a sandbox
included, without importing the database driver."""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from tenantq.errors import InvalidInput

MAX_CRON_LENGTH = 200


def cron_expression(value: object) -> str:
    """A cron expression croniter reads (5 fields, or @hourly ...), or one line."""
    from croniter import croniter

    if not isinstance(value, str) or not 1 <= len(value.strip()) <= MAX_CRON_LENGTH:
        raise InvalidInput(f"cron expression must be 1-{MAX_CRON_LENGTH} characters, got {value!r}")
    text = " ".join(value.split())
    if len(text.split()) not in (1, 5) or not croniter.is_valid(text):
        raise InvalidInput(f"invalid cron expression {value!r}: use 5 fields (minute hour day month weekday, "
                           "e.g. '*/5 * * * *') or @hourly, @daily, @weekly, @monthly, @yearly")
    return text


def time_zone(value: object) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= 64:
        raise InvalidInput(f"time zone must be an IANA name such as UTC or Europe/Paris, got {value!r}")
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidInput(f"unknown time zone {value!r}: use an IANA name such as UTC or Europe/Paris"
                           ) from None
    return value


def next_fire(cron: str, zone: str, after: datetime) -> datetime:
    """The first fire time strictly after `after`, in UTC."""
    from croniter import croniter

    fire: datetime = croniter(cron, after.astimezone(ZoneInfo(zone))).get_next(datetime)
    return fire.astimezone(UTC)


def latest_fire(cron: str, zone: str, at: datetime) -> datetime:
    """The last fire time before `at`, in UTC (callers take the later of
    it and the stored next fire, which covers `at` being a fire time)."""
    from croniter import croniter

    fire: datetime = croniter(cron, at.astimezone(ZoneInfo(zone))).get_prev(datetime)
    return fire.astimezone(UTC)
