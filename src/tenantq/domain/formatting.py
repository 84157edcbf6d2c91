"""Lengths of time as people read them, the one spelling the CLI and the
dashboard share."""

from __future__ import annotations

from typing import Any


def duration(seconds: Any, *, missing: str = "—") -> str:
    """`45s`, `4m 05s`, `2h 10m`, `3d 4h`; `missing` for None."""
    if seconds is None:
        return missing
    total = max(0, int(float(seconds)))
    if total < 60:
        return f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h"
