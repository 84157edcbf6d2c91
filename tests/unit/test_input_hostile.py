"""Hostile enqueue input, checked without a database: NUL characters and
lone surrogates (which Postgres cannot store), payloads nested past
MAX_PAYLOAD_DEPTH at any depth (never a RecursionError), and names with a
newline that `$` alone would let through. Each is one InvalidInput line."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tenantq.domain import validation
from tenantq.domain.validation import MAX_PAYLOAD_DEPTH
from tenantq.errors import InvalidInput

NUL_MESSAGE = "payload contains a NUL character (\\u0000), which Postgres cannot store"


def nested(depth: int, *, kind: str = "list") -> Any:
    """`depth` levels of arrays (or objects, or both in turn), built without recursion."""
    value: Any = 1
    for level in range(depth):
        use_list = kind == "list" or (kind == "mixed" and level % 2)
        value = [value] if use_list else {"k": value}
    return value


def rejected(value: Any) -> str:
    with pytest.raises(InvalidInput) as info:
        validation.payload_json(value)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("payload", [
    "\x00",
    "a\x00b",
    {"a": "x\x00"},
    {"a\x00": 1},
    {"\x00": None},
    [1, [2, [3, {"deep": ["ok", "no\x00"]}]]],
    {"outer": {"inner\x00key": []}},
    ("tuple", "\x00"),
    "\\\x00",  # a backslash, then a NUL: the escape is \\ then \u0000
])
def test_a_nul_anywhere_is_rejected(payload: Any) -> None:
    assert rejected(payload) == NUL_MESSAGE


@pytest.mark.parametrize("payload", ["\\u0000", {"\\u0000": "\\\\u0000"}, "\\\\u0000", "u0000", "\x01\x1f"])
def test_text_that_only_looks_like_a_nul_is_fine(payload: Any) -> None:
    text = validation.payload_json(payload)
    assert json.loads(text) == payload


@pytest.mark.parametrize(("payload", "shown"), [
    ("\ud800", "\\ud800"),
    ("ok\udfff", "\\udfff"),
    ({"\udcff": 1}, "\\udcff"),
    ([{"a": ["\ud83d\ude00"]}], "\\ud83d"),  # a pair spelled as two code points is still two lone halves
])
def test_a_lone_surrogate_is_rejected(payload: Any, shown: str) -> None:
    assert rejected(payload) == f"payload contains a lone surrogate ({shown}), which is not valid Unicode"


def test_real_astral_characters_are_fine() -> None:
    assert validation.payload_json({"emoji": "😀", "é": "ü"}) == '{"emoji": "😀", "é": "ü"}'


@pytest.mark.parametrize("kind", ["list", "dict", "mixed"])
def test_the_depth_limit_is_inclusive(kind: str) -> None:
    at_limit = nested(MAX_PAYLOAD_DEPTH, kind=kind)
    assert validation.nesting_depth(at_limit) == MAX_PAYLOAD_DEPTH
    assert json.loads(validation.payload_json(at_limit)) == at_limit
    assert rejected(nested(MAX_PAYLOAD_DEPTH + 1, kind=kind)) == (
        f"payload is nested {MAX_PAYLOAD_DEPTH + 1} levels deep; the limit is {MAX_PAYLOAD_DEPTH}")


@pytest.mark.parametrize("depth", [990, 5_000, 100_000])
def test_very_deep_payloads_get_one_line_not_recursion_error(depth: int) -> None:
    assert rejected(nested(depth, kind="mixed")) == f"payload is nested {depth} levels deep; the limit is 64"


def test_depth_is_the_deepest_branch() -> None:
    assert validation.nesting_depth(None) == 0
    assert validation.nesting_depth("[[[") == 0
    assert validation.nesting_depth([]) == 1
    assert validation.nesting_depth({"a": [], "b": {"c": [[]]}, "d": 1}) == 4
    wide = [nested(3)] * 1000 + [nested(70)] + [[]] * 1000
    assert rejected(wide) == "payload is nested 71 levels deep; the limit is 64"


def test_shared_sub_objects_are_measured_once() -> None:
    shared: Any = []
    for _ in range(200):  # 2**200 paths, 201 distinct lists
        shared = [shared, shared]
    started = time.monotonic()
    assert rejected(shared) == "payload is nested 201 levels deep; the limit is 64"
    assert time.monotonic() - started < 5


def test_a_payload_that_contains_itself_is_rejected() -> None:
    loop: list[Any] = [1]
    loop.append({"again": loop})
    assert "contains itself" in rejected(loop)


@pytest.mark.parametrize("depth", [990, 100_000])
def test_deep_json_text_is_one_line(depth: int) -> None:
    text = "[" * depth + "]" * depth
    with pytest.raises(InvalidInput, match=f"^payload is nested {depth} levels deep; the limit is 64$"):
        validation.payload_json(validation.parse_payload(text))


def test_deep_text_depth_ignores_brackets_in_strings() -> None:
    text = '{"a": "[[[{{{\\"]]]"}' + "[" * 100_000 + "]" * 100_000
    assert validation.text_depth('[{"a": "]]]\\"[[["}, [[]]]') == 3
    assert validation.text_depth(text) == 100_000


def test_unparseable_numbers_are_invalid_json_not_a_crash() -> None:
    with pytest.raises(InvalidInput, match="payload is not valid JSON"):
        validation.parse_payload("1" * 5000)


@pytest.mark.parametrize("bad", ["acme\n", "ac\nme", "\nacme", "acme\r\n", "acme\x00", "acme\u2028"])
def test_a_tenant_id_with_a_newline_or_nul_is_rejected(bad: str) -> None:
    with pytest.raises(InvalidInput, match=r"^tenant id .* is invalid") as info:
        validation.tenant_id(bad)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bad", ["demo.hello\n", "demo\n.hello", "demo.hello\x00"])
def test_a_kind_with_a_newline_or_nul_is_rejected(bad: str) -> None:
    with pytest.raises(InvalidInput, match=r"^kind .* is invalid") as info:
        validation.kind(bad)
    assert "\n" not in str(info.value)


def test_a_long_bad_name_is_shown_cut_short() -> None:
    with pytest.raises(InvalidInput) as info:
        validation.kind("x" * 10_000 + "\n")
    assert len(str(info.value)) < 200


def test_an_idempotency_key_without_nul_or_lone_surrogates() -> None:
    assert validation.idempotency_key("order-42") == "order-42"
    with pytest.raises(InvalidInput, match=r"^idempotency key contains a NUL character \(\\u0000\)"):
        validation.idempotency_key("order\x0042")
    with pytest.raises(InvalidInput, match=r"^idempotency key contains a lone surrogate \(\\udcff\)"):
        validation.idempotency_key("order\udcff")


def test_new_job_runs_every_check() -> None:
    for args, message in [
        (("acme\n", "demo.hello", None), "tenant id"),
        (("acme", "demo.hello\n", None), "kind"),
        (("acme", "demo.hello", {"a": "\x00"}), "NUL"),
        (("acme", "demo.hello", nested(100_000)), "nested 100000 levels deep"),
    ]:
        with pytest.raises(InvalidInput, match=message):
            validation.new_job(*args)
    with pytest.raises(InvalidInput, match="idempotency key"):
        validation.new_job("acme", "demo.hello", None, key="k\x00")


def test_serialisation_is_unchanged_for_good_payloads() -> None:
    payload = {"a": [1, 2.5, None, True], "b": {"c": "ü\n\t\\"}}
    text = validation.payload_json(payload)
    assert text == '{"a": [1, 2.5, null, true], "b": {"c": "ü\\n\\t\\\\"}}'
    assert json.loads(text) == payload
