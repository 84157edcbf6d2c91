from __future__ import annotations

import math

import pytest

from tenantq.domain import validation
from tenantq.errors import InvalidInput


@pytest.mark.parametrize("tenant", ["acme", "a", "org:42", "team.eu-1", "x@y", "A" * 128])
def test_good_tenant_ids(tenant: str) -> None:
    assert validation.tenant_id(tenant) == tenant


@pytest.mark.parametrize(
    ("tenant", "message"),
    [
        ("", "non-empty"),
        (None, "non-empty"),
        ("A" * 129, "129 characters; the limit is 128"),
        ("has space", "invalid"),
        ("-leading", "invalid"),
        ("tab\t", "invalid"),
    ],
)
def test_bad_tenant_ids(tenant: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        validation.tenant_id(tenant)


def test_kind_rules() -> None:
    assert validation.kind("reports.render") == "reports.render"
    assert validation.kind("_private:x-1") == "_private:x-1"
    for bad in ["", "1abc", "has space", "x" * 201, None]:
        with pytest.raises(InvalidInput, match="kind"):
            validation.kind(bad)


def test_priority() -> None:
    for p in ("interactive", "default", "bulk"):
        assert validation.priority(p) == p
    with pytest.raises(InvalidInput, match="unknown priority 'urgent'"):
        validation.priority("urgent")


def test_payload_must_be_json_and_bounded() -> None:
    assert validation.payload_json({"a": [1, 2]}) == '{"a": [1, 2]}'
    with pytest.raises(InvalidInput, match="not JSON-serialisable"):
        validation.payload_json({1, 2})
    with pytest.raises(InvalidInput, match="not JSON-serialisable"):
        validation.payload_json({"x": math.nan})
    big = "x" * validation.MAX_PAYLOAD_BYTES
    with pytest.raises(InvalidInput, match="the limit is 262144"):
        validation.payload_json(big)


def test_parse_payload() -> None:
    assert validation.parse_payload('{"a": 1}') == {"a": 1}
    with pytest.raises(InvalidInput, match="not valid JSON"):
        validation.parse_payload("{bad")


def test_attempts_delay_key() -> None:
    assert validation.max_attempts(1) == 1
    for bad in [0, -1, 1001, True, 2.5]:
        with pytest.raises(InvalidInput, match="max_attempts"):
            validation.max_attempts(bad)
    assert validation.delay(0) == 0.0
    for bad_delay in [-1, math.inf, math.nan, "5", 10**9]:
        with pytest.raises(InvalidInput, match="delay"):
            validation.delay(bad_delay)
    assert validation.idempotency_key(None) is None
    with pytest.raises(InvalidInput, match="idempotency key"):
        validation.idempotency_key("")
    with pytest.raises(InvalidInput, match="idempotency key"):
        validation.idempotency_key("k" * 256)
