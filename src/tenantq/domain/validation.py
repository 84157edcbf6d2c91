"""Input checks for everything a user can send. Each failure is one line
that names the field and the rule, raised before anything is written
(docs/security.md, rule I1: what a worker will claim must not crash it)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from typing import Any

from tenantq.domain.records import PRIORITIES, NewJob, Priority
from tenantq.errors import InvalidInput

TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
KIND = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,199}$")
MAX_PAYLOAD_BYTES = 256 * 1024
MAX_KEY_LENGTH = 255
MAX_ATTEMPTS_LIMIT = 1000
MAX_DELAY_SECONDS = 366 * 24 * 3600
# Nesting levels of arrays/objects a payload may have ([] is 1, [[]] is 2).
# Handlers and the guest's JSON code recurse; this keeps them far from
# Python's recursion limit.
MAX_PAYLOAD_DEPTH = 64
# the job's security envelope (migration 0006 mirrors both limits)
MAX_ACTOR_LENGTH = 200
MAX_META_BYTES = 4096
MAX_META_DEPTH = 8
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
SHOWN_CHARS = 80  # how much of a rejected value an error message repeats
# `\u0000` as json.dumps escapes a NUL: preceded by an even number of
# backslashes (an odd run would make it the text "\\u0000", which is fine)
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
_STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def _shown(value: object) -> str:
    """repr() of a rejected value, cut short: a message stays one short line."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _utf8(text: str, what: str) -> bytes:
    """`text` as UTF-8; a lone surrogate (which Python strings may hold and
    UTF-8 cannot) is bad input, named as \\uXXXX."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        surrogate = f"\\u{ord(exc.object[exc.start]):04x}"
        raise InvalidInput(
            f"{what} contains a lone surrogate ({surrogate}), which is not valid Unicode"
        ) from None


# Tenant ids and kinds already found valid by this process: a bulk enqueue
# names a few of each thousands of times. Exact str only (a subclass could
# hash or compare differently); cleared when it grows past MEMO_SIZE.
MEMO_SIZE = 10_000
_valid_tenants: set[str] = set()
_valid_kinds: set[str] = set()


def _remember(memo: set[str], value: str) -> None:
    if len(memo) >= MEMO_SIZE:
        memo.clear()
    memo.add(value)


def tenant_id(value: object) -> str:
    if type(value) is str and value in _valid_tenants:
        return value
    if not isinstance(value, str) or not value:
        raise InvalidInput("tenant id must be a non-empty string")
    if len(value) > 128:
        raise InvalidInput(f"tenant id is {len(value)} characters; the limit is 128")
    # fullmatch: `$` alone also matches before a trailing newline
    if not TENANT_ID.fullmatch(value):
        raise InvalidInput(
            f"tenant id {_shown(value)} is invalid: use letters, digits and . _ : @ - "
            "(starting with a letter or digit)"
        )
    if type(value) is str:
        _remember(_valid_tenants, value)
    return value


def kind(value: object, what: str = "kind") -> str:
    if type(value) is str and value in _valid_kinds:
        return value
    if not isinstance(value, str) or not KIND.fullmatch(value):
        raise InvalidInput(
            f"{what} {_shown(value)} is invalid: 1-200 characters of letters, digits and _ . : - "
            "(starting with a letter or _)"
        )
    if type(value) is str:
        _remember(_valid_kinds, value)
    return value


def priority(value: object) -> Priority:
    for known in PRIORITIES:
        if value == known:
            return known
    raise InvalidInput(f"unknown priority {_shown(value)}: use one of {', '.join(PRIORITIES)}")


def payload_json(value: Any) -> str:
    """Serialise a payload, enforcing JSON-ness, the depth limit, what
    Postgres can store, and the size limit."""
    return _stored_json(value, "payload", MAX_PAYLOAD_BYTES, MAX_PAYLOAD_DEPTH)


# one encoder for every call (json.dumps with options builds one per call)
_POSTGRES_RENDERING = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(", ", ": "))


def _stored_json(value: Any, what: str, max_bytes: int, max_depth: int) -> str:
    """`value` as the JSON text a jsonb column will hold, or InvalidInput.

    The limit is measured the way Postgres renders jsonb as text (", " and
    ": " separators, UTF-8), which is what the size CHECKs measure.
    """
    depth = nesting_depth(value, what)  # first: json.dumps itself recurses
    if depth > max_depth:
        raise InvalidInput(f"{what} is nested {depth} levels deep; the limit is {max_depth}")
    try:
        # serialised once, in Postgres' own rendering, and sent as is
        text = _POSTGRES_RENDERING.encode(value)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what} is not JSON-serialisable: {exc}") from None
    size = len(_utf8(text, what)) + _exponent_growth(text)
    # json.dumps writes a NUL (in any value or key) as the escape \\u0000,
    # which jsonb cannot store
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        raise InvalidInput(f"{what} contains a NUL character (\\u0000), which Postgres cannot store")
    if size > max_bytes:
        raise InvalidInput(f"{what} is {size} bytes of JSON; the limit is {max_bytes}")
    return text


_EXPONENT_NUMBER = re.compile(r"-?\d+(?:\.\d+)?[eE][+-]?\d+")
_DIGIT_EXPONENT = re.compile(r"\d[eE]")


def _exponent_growth(text: str) -> int:
    """How much longer Postgres renders the numbers written with an exponent
    (1e+300 becomes 1 and 300 zeros: jsonb keeps numerics and prints them
    in full), so the size checked here is the size its CHECK will see and
    an enqueue never fails on it inside a caller's transaction."""
    if not _DIGIT_EXPONENT.search(text):  # no number with an exponent, in or out of strings
        return 0
    growth = 0
    for number in _EXPONENT_NUMBER.finditer(_STRING_LITERAL.sub('""', text)):
        token = number.group()
        try:
            value = Decimal(token)
        except InvalidOperation:
            continue
        if abs(value.adjusted()) > MAX_PAYLOAD_BYTES:  # never from a float; too long to render anyway
            return MAX_PAYLOAD_BYTES + 1
        growth += len(format(value, "f")) - len(token)
    return max(0, growth)


def _too_deep(depth: int) -> InvalidInput:
    return InvalidInput(f"payload is nested {depth} levels deep; the limit is {MAX_PAYLOAD_DEPTH}")


def _children(container: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> Iterator[Any]:
    return iter(container.values() if isinstance(container, dict) else container)


def nesting_depth(value: Any, what: str = "payload") -> int:
    """Levels of arrays/objects (what json.dumps treats as such) in `value`:
    0 for a scalar, 1 for [] or {}. Walks an explicit stack, never recursing,
    so any depth gets an answer; each container is measured once, so shared
    sub-objects cost nothing extra. A container inside itself is rejected."""
    if not isinstance(value, dict | list | tuple):
        return 0
    if not any(isinstance(child, dict | list | tuple) for child in _children(value)):
        return 1  # the common payload: one object of scalars
    known: dict[int, int] = {}  # id -> depth of a container measured already
    # one frame per container on the current path: [container, its children, deepest child]
    path: list[list[Any]] = [[value, _children(value), 0]]
    on_path = {id(value)}
    while True:
        frame = path[-1]
        for child in frame[1]:
            if not isinstance(child, dict | list | tuple):
                continue
            if id(child) in known:
                frame[2] = max(frame[2], known[id(child)])
            elif id(child) in on_path:
                raise InvalidInput(f"{what} is not JSON-serialisable: it contains itself")
            else:
                path.append([child, _children(child), 0])
                on_path.add(id(child))
                break
        else:
            path.pop()
            on_path.discard(id(frame[0]))
            depth: int = frame[2] + 1
            known[id(frame[0])] = depth
            if path:
                path[-1][2] = max(path[-1][2], depth)
            else:
                return depth


def text_depth(text: str) -> int:
    """Deepest bracket nesting of JSON text, outside string literals (for
    text too deep for json.loads to parse at all)."""
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_STRING_LITERAL.sub("", text)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def payload_object(value: Any) -> dict[str, Any]:
    """A payload is a JSON object (the handler's keyword-like arguments, as
    in Oban and River); a missing one is {}."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        kind_name = {list: "an array", tuple: "an array", str: "a string", bool: "a boolean",
                     int: "a number", float: "a number"}.get(type(value), type(value).__name__)
        raise InvalidInput(f'payload must be a JSON object such as {{"month": 9}}, got {kind_name}')
    return value


def parse_payload(text: str) -> Any:
    """Parse a payload given as JSON text (the CLI's --payload)."""
    try:
        return json.loads(text)
    except RecursionError:
        # json.loads recurses per level: far too deep text never parses
        raise _too_deep(text_depth(text)) from None
    except ValueError as exc:  # JSONDecodeError, and integers over Python's digit limit
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
    if "\x00" in value:
        raise InvalidInput("idempotency key contains a NUL character (\\u0000), which Postgres cannot store")
    _utf8(value, "idempotency key")
    return value


def actor(value: object) -> str | None:
    """Who the job is for: one printable line of 1-200 characters, or None."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ACTOR_LENGTH:
        raise InvalidInput(f"actor must be a string of 1-{MAX_ACTOR_LENGTH} characters, got {_shown(value)}")
    if _CONTROL.search(value):
        raise InvalidInput(f"actor {_shown(value)} contains a control character (a newline, NUL, ...)")
    _utf8(value, "actor")
    return value


def meta_json(value: object) -> str | None:
    """The request context: a small JSON object (at most MAX_META_BYTES as
    Postgres renders it, MAX_META_DEPTH levels), serialised; None for none."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidInput(f'meta must be a JSON object such as {{"request_id": "r-1"}}, got {_shown(value)}')
    return _stored_json(value, "meta", MAX_META_BYTES, MAX_META_DEPTH)


def new_job(
    tenant: object,
    kind_: object,
    payload: Any,
    *,
    priority_: object = "default",
    max_attempts_: object = 5,
    delay_: object = 0,
    key: object = None,
    actor_: object = None,
    meta: object = None,
) -> tuple[NewJob, str]:
    """Validate one job; returns it with its payload already serialised."""
    text, meta_text = job_body(payload, meta)  # what could not be stored at all, first
    job = job_envelope(tenant, kind_, priority_=priority_, max_attempts_=max_attempts_, delay_=delay_,
                       key=key, actor_=actor_, meta_json=meta_text)
    return job, text


def job_envelope(
    tenant: object,
    kind_: object,
    *,
    priority_: object = "default",
    max_attempts_: object = 5,
    delay_: object = 0,
    key: object = None,
    actor_: object = None,
    meta_json: str | None = None,
) -> NewJob:
    """Every field of a job but its body (payload and meta, `job_body`),
    validated. A bulk enqueue checks these for every job before it writes
    anything, and the bodies as it writes them (store/enqueue.py)."""
    return NewJob(
        tenant_id=tenant_id(tenant),
        kind=kind(kind_),
        priority=priority(priority_),
        max_attempts=max_attempts(max_attempts_),
        delay=delay(delay_),
        key=idempotency_key(key),
        actor=actor(actor_),
        meta_json=meta_json,
    )


def job_body(payload: Any, meta: object) -> tuple[str, str | None]:
    """A job's payload (a JSON object; None is {}) and meta as the JSON text
    Postgres will store, or InvalidInput."""
    if payload is None:  # no payload: {}, as the worker hands it to the handler
        text = "{}"
    else:
        text = payload_json(payload)
        payload_object(payload)
    return text, meta_json(meta)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_DURATION_SECONDS = 100 * 365 * 86400.0


def duration(value: object, what: str) -> float:
    """Seconds from `30`, `30s`, `15m`, `1h`, `7d` or `2w` (or a number)."""
    if isinstance(value, bool):
        raise InvalidInput(f"{what} must be a duration such as 30s, 15m, 1h or 7d, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.fullmatch(str(value))
        if match is None:
            raise InvalidInput(f"{what} must be a duration such as 30s, 15m, 1h or 7d, got {_shown(value)}")
        seconds = float(match[1]) * _UNIT_SECONDS[match[2]]
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_DURATION_SECONDS:
        raise InvalidInput(f"{what} must be between 0 s and 100 years, got {_shown(value)}")
    return seconds
