"""What the host accepts from a guest's control channel: every record is
hostile input, validated before use (docs/security.md, rule H4).

A record the host did not ask for, with a sequence number that is not the
job in flight, a reason outside the known set, a result nested too deep, or
a string too long is a protocol violation: the sandbox is killed and the
job the host handed out is charged with the violation. Numbers the guest
sends are never used for accounting: run times are measured by the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tenantq.guest.protocol import JOB_REASONS, MAX_ERROR_CHARS, MAX_JSON_DEPTH, json_depth
from tenantq.sandbox.spec import End

MAX_FATAL_CHARS = 3000


class ProtocolViolation(Exception):
    """The guest broke the channel's protocol."""


@dataclass(frozen=True)
class JobOutcome:
    ok: bool
    result: Any = None
    error: str = ""
    reason: str = ""


def _status(record: dict[str, Any], *expected: str) -> str:
    status = record.get("status")
    if not isinstance(status, str) or status not in expected:
        raise ProtocolViolation(f"expected {' or '.join(expected)}, got status {str(status)[:40]!r}")
    return status


def boot(record: dict[str, Any]) -> str | None:
    """None when the runner is ready; the (bounded) reason when it could not boot."""
    if _status(record, "ready", "fatal") == "ready":
        return None
    return _text(record.get("error"), MAX_FATAL_CHARS) or "the guest runner could not boot"


def batch_ready(record: dict[str, Any]) -> None:
    _status(record, "batch_ready")


def job_end(record: dict[str, Any], seq: int) -> JobOutcome:
    """The outcome of job number `seq` (the one in flight)."""
    _status(record, "job_end")
    got = record.get("seq")
    if type(got) is not int or got != seq:
        raise ProtocolViolation(f"a job_end for job #{str(got)[:20]} while job #{seq} runs")
    ok = record.get("ok")
    if ok is True:
        result = record.get("result")
        if json_depth(result) > MAX_JSON_DEPTH:
            raise ProtocolViolation(f"the result is nested more than {MAX_JSON_DEPTH} levels deep")
        return JobOutcome(ok=True, result=result)
    if ok is not False:
        raise ProtocolViolation("job_end without a boolean ok")
    reason = record.get("reason")
    if reason not in JOB_REASONS:
        raise ProtocolViolation(f"unknown failure reason {str(reason)[:40]!r}")
    return JobOutcome(ok=False, error=_text(record.get("error"), MAX_ERROR_CHARS) or "failed",
                      reason=str(reason))


def batch_end(record: dict[str, Any], ttl: float) -> End:
    """How the batch supervisor ended, as the warm parent saw it."""
    _status(record, "batch_end")
    if "timeout" in record:
        return End("timeout", detail=f"after {ttl:g} s (batch TTL)")
    signal = record.get("signal")
    if signal is not None:
        if type(signal) is not int or not 0 < signal < 65:
            raise ProtocolViolation("batch_end with a bad signal number")
        return End("signal", exit_code=128 + signal, signal=signal)
    code = record.get("exit")
    if type(code) is not int or not 0 <= code < 256:
        raise ProtocolViolation("batch_end with a bad exit code")
    return End("ok", exit_code=0) if code == 0 else End("exit", exit_code=code)


def _text(value: object, limit: int) -> str:
    text = value if isinstance(value, str) else ""
    text = text.replace("\x00", "\\0")
    text = text.encode("utf-8", "replace").decode("utf-8")  # no lone surrogates
    return text if len(text) <= limit else text[: limit - 15] + "... (truncated)"
