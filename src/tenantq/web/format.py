"""Jinja filters: ages, timestamps and JSON previews, kept out of templates."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import jinja2

from tenantq.domain.formatting import duration

PREVIEW_CHARS = 4000


def ago(value: datetime | None) -> str:
    if value is None:
        return "—"
    seconds = (datetime.now(UTC) - value).total_seconds()
    if seconds < 0:
        return f"in {duration(-seconds)}"
    return f"{duration(seconds)} ago"


def timestamp(value: datetime | None) -> str:
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def pretty_json(value: Any) -> str:
    """Indented JSON, cut at PREVIEW_CHARS with a note saying how much more there is."""
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)
    if len(text) <= PREVIEW_CHARS:
        return text
    return text[:PREVIEW_CHARS] + f"\n… ({len(text) - PREVIEW_CHARS} more characters not shown)"


def number(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.1f}"
    return f"{int(value):,}"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("tenantq.web", "templates"),
        autoescape=True,  # every template, whatever its name: payloads are tenant-controlled
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(duration=duration, ago=ago, timestamp=timestamp, pretty_json=pretty_json,
                       number=number)
    return env
