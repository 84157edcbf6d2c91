"""Fuzz target: the host's reader of the guest's control channel and the
records it validates (sandbox/channel.py FrameReader, dispatch/executors/records.py).

Any byte stream a guest writes must end in frames, FrameError or
ProtocolViolation, and nothing else: never another exception, never more
buffered than one frame."""

from __future__ import annotations

import contextlib
import sys

import atheris

with atheris.instrument_imports():
    from tenantq.dispatch.executors import records
    from tenantq.guest.protocol import HEADER_BYTES, MAX_FRAME_BYTES, FrameError
    from tenantq.sandbox.channel import FrameReader


def check_record(frame: dict[str, object], seq: int) -> None:
    for validate in (records.boot, records.batch_ready, lambda r: records.job_end(r, seq),
                     lambda r: records.batch_end(r, 30.0)):
        with contextlib.suppress(records.ProtocolViolation):
            validate(frame)


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    seq = fdp.ConsumeIntInRange(0, 3)
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    reader = FrameReader()
    offset = 0
    while offset < len(stream):
        step = min(reader.wanted(), 1 + (stream[offset] % 64))
        chunk = stream[offset:offset + step]
        offset += len(chunk)
        try:
            frame = reader.feed(chunk)
        except FrameError:
            return
        assert len(reader._buffer) <= HEADER_BYTES + MAX_FRAME_BYTES
        if frame is not None:
            check_record(frame, seq)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
