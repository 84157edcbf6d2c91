"""The host's parsers of guest traffic (rules H3, H4 of docs/security.md):
frames are reassembled from any split, never buffer more than one frame,
and refuse bad headers, oversize bodies, non-objects and NaN; records are
accepted only as the record expected now, for the job in flight."""

from __future__ import annotations

import json
import math
import os
import time

import pytest

from tenantq.dispatch.executors import records
from tenantq.dispatch.executors.records import ProtocolViolation
from tenantq.guest.protocol import HEADER_BYTES, MAX_FRAME_BYTES, FrameError, encode
from tenantq.sandbox.channel import FrameReader


def _feed_all(data: bytes, step: int) -> list[dict[str, object]]:
    reader = FrameReader()
    frames = []
    offset = 0
    while offset < len(data):
        chunk = data[offset:offset + min(step, reader.wanted())]
        offset += len(chunk)
        frame = reader.feed(chunk)
        if frame is not None:
            frames.append(frame)
    return frames


@pytest.mark.parametrize("step", [1, 3, 11, 4096])
def test_frames_are_reassembled_from_any_split(step: int) -> None:
    values = [{"status": "ready"}, {"status": "job_end", "seq": 0, "ok": True, "result": "x" * 10_000}]
    assert _feed_all(b"".join(encode(v) for v in values), step) == values


@pytest.mark.parametrize("header", [b"abcdefghij\n", b"00000000-1\n", b"0000000001 ", b"\xb2" * 10 + b"\n",
                                    b"%010d\n" % (MAX_FRAME_BYTES + 1)])
def test_bad_headers_are_refused_before_any_body_is_read(header: bytes) -> None:
    reader = FrameReader()
    with pytest.raises(FrameError):
        reader.feed(header)


def test_the_reader_asks_for_no_more_than_one_frame() -> None:
    reader = FrameReader()
    assert reader.wanted() == HEADER_BYTES
    reader.feed(b"%010d\n" % MAX_FRAME_BYTES)
    assert reader.wanted() == MAX_FRAME_BYTES
    with pytest.raises(FrameError):
        reader.feed(b"x" * (MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"not json", b'{"a": NaN}', b'{"a": Infinity}',
                                  b"[" * 100_000])
def test_bodies_that_are_not_a_json_object_are_refused(body: bytes) -> None:
    with pytest.raises(FrameError):
        _feed_all(b"%010d\n" % len(body) + body, 4096)


def test_a_job_end_is_accepted_only_for_the_job_in_flight() -> None:
    good = {"status": "job_end", "seq": 2, "ok": True, "result": {"n": 1}}
    assert records.job_end(good, 2).result == {"n": 1}
    for seq in (1, 3, "2", 2.0, True, None):
        with pytest.raises(ProtocolViolation):
            records.job_end({**good, "seq": seq}, 2)
    with pytest.raises(ProtocolViolation):
        records.batch_ready(good)


def test_failure_records_are_bounded_and_their_reason_known() -> None:
    record = {"status": "job_end", "seq": 0, "ok": False, "reason": "exception",
              "error": "x\x00" * 10_000 + "\ud800"}
    outcome = records.job_end(record, 0)
    assert len(outcome.error) <= 4000 and "\x00" not in outcome.error
    outcome.error.encode("utf-8")  # no lone surrogate left
    with pytest.raises(ProtocolViolation):
        records.job_end({**record, "reason": "refund-me"}, 0)
    with pytest.raises(ProtocolViolation):
        records.job_end({**record, "ok": "false"}, 0)


def test_results_nested_too_deep_are_a_violation() -> None:
    deep: object = 1
    for _ in range(70):
        deep = [deep]
    with pytest.raises(ProtocolViolation):
        records.job_end({"status": "job_end", "seq": 0, "ok": True, "result": deep}, 0)


@pytest.mark.parametrize("end", [{"signal": 0}, {"signal": 99}, {"signal": "9"}, {"exit": -1}, {"exit": 256},
                                 {"exit": 1.5}, {}])
def test_batch_end_numbers_are_checked(end: dict[str, object]) -> None:
    with pytest.raises(ProtocolViolation):
        records.batch_end({"status": "batch_end", **end}, 30.0)
    assert records.batch_end({"status": "batch_end", "signal": 9}, 30.0).signal == 9


def test_encode_refuses_what_the_reader_would() -> None:
    with pytest.raises(ValueError, match="JSON"):
        encode({"x": math.nan})
    with pytest.raises(FrameError):
        encode({"x": "y" * MAX_FRAME_BYTES})
    assert json.loads(encode({"a": 1})[HEADER_BYTES:]) == {"a": 1}


def test_a_frame_written_just_before_the_guest_exited_is_read_before_it_is_gone() -> None:
    """The guest's last frame (a warm parent's batch_end) may arrive after the
    host's read found nothing and before it saw the process gone: it is read,
    not lost behind GuestGone."""
    from tenantq.sandbox.channel import Channel, GuestGone

    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    checks: list[bool] = []

    def alive() -> bool:
        # the process exits right after writing its last frame, which lands
        # between the empty read and this check
        if not checks:
            os.write(out_w, encode({"status": "batch_end", "exit": 0}))
        checks.append(False)
        return False

    channel = Channel(in_w, out_r, alive)
    try:
        assert channel.receive(time.monotonic() + 5) == {"status": "batch_end", "exit": 0}
        with pytest.raises(GuestGone):
            channel.receive(time.monotonic() + 5)
    finally:
        for fd in (in_r, in_w, out_r, out_w):
            os.close(fd)
