"""Input checks for everything a user can send. Each failure is one line
that names the field and the rule, raised before anything is written."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from tenantq.errors import InvalidInput
from tenantq.store.model import PRIORITIES, NewJob, Priority

TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
KIND = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,199}$")
MAX_PAYLOAD_BYTES = 256 * 1024
MAX_KEY_LENGTH = 255
MAX_ATTEMPTS_LIMIT = 1000
MAX_DELAY_SECONDS = 366 * 24 * 3600


def tenant_id(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInput("tenant id must be a non-empty string")
    if len(value) > 128:
        raise InvalidInput(f"tenant id is {len(value)} characters; the limit is 128")
    if not TENANT_ID.match(value):
        raise InvalidInput(
            f"tenant id {value!r} is invalid: use letters, digits and . _ : @ - "
            "(starting with a letter or digit)"
        )
    return value


def kind(value: object) -> str:
    if not isinstance(value, str) or not KIND.match(value):
        raise InvalidInput(
            f"kind {value!r} is invalid: 1-200 characters of letters, digits and _ . : - "
            "(starting with a letter or _)"
        )
    return value


def priority(value: object) -> Priority:
    for known in PRIORITIES:
        if value == known:
            return known
    raise InvalidInput(f"unknown priority {value!r}: use one of {', '.join(PRIORITIES)}")


def payload_json(value: Any) -> str:
    """Serialise a payload, enforcing JSON-ness and the size limit.

    The limit is measured the way Postgres renders jsonb as text (", " and
    ": " separators, UTF-8), which is what the payload_size CHECK measures.
    """
    try:
        # serialised once, in Postgres' own rendering, and sent as is
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(", ", ": "))
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"payload is not JSON-serialisable: {exc}") from None
    size = len(text.encode())
    if size > MAX_PAYLOAD_BYTES:
        raise InvalidInput(f"payload is {size} bytes of JSON; the limit is {MAX_PAYLOAD_BYTES}")
    return text


def parse_payload(text: str) -> Any:
    """Parse a payload given as JSON text (the CLI's --payload)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"payload is not valid JSON: {exc}") from None


def max_attempts(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"max_attempts must be an integer, got {value!r}")
    if not 1 <= value <= MAX_ATTEMPTS_LIMIT:
        raise InvalidInput(f"max_attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}, got {value}")
    return value


def delay(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"delay must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or seconds > MAX_DELAY_SECONDS:
        raise InvalidInput(f"delay must be between 0 and {MAX_DELAY_SECONDS} seconds, got {value}")
    return seconds


def idempotency_key(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_KEY_LENGTH:
        raise InvalidInput(f"idempotency key must be 1-{MAX_KEY_LENGTH} characters")
    return value


def new_job(
    tenant: object,
    kind_: object,
    payload: Any,
    *,
    priority_: object = "default",
    max_attempts_: object = 5,
    delay_: object = 0,
    key: object = None,
) -> tuple[NewJob, str]:
    """Validate one job; returns it with its payload already serialised."""
    job = NewJob(
        tenant_id=tenant_id(tenant),
        kind=kind(kind_),
        payload=payload,
        priority=priority(priority_),
        max_attempts=max_attempts(max_attempts_),
        delay=delay(delay_),
        key=idempotency_key(key),
    )
    return job, payload_json(payload)
