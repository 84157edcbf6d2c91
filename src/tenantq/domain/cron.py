"""Cron expressions and time zones (croniter, zoneinfo), kept apart from
the store so that `@tenantq.periodic` can check them anywhere, a sandbox
included, without importing the database driver."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
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
    """The last fire time at or before `at`, in UTC."""
    from croniter import croniter

    local = at.astimezone(ZoneInfo(zone))
    upcoming: datetime = croniter(cron, local - timedelta(microseconds=1)).get_next(datetime)
    if upcoming <= local:  # `at` is a fire time itself
        return upcoming.astimezone(UTC)
    fire: datetime = croniter(cron, local).get_prev(datetime)
    return fire.astimezone(UTC)


def wall_clock(fire: datetime, zone: str) -> str:
    """A fire time as the schedule's local wall-clock time (no offset): the
    key of its job, so a local time that happens twice (the night clocks go
    back) fires once, as in cron."""
    return fire.astimezone(ZoneInfo(zone)).replace(tzinfo=None).isoformat()
