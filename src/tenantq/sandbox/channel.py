"""The host's end of the control channel to a sandbox's guest runner.

Host to guest: frames written to the runner's stdin pipe, never blocking
past a deadline (a stopped guest cannot hang a slot). Guest to host: frames
read from the runner's stdout pipe by `FrameReader`, which never holds more
than one frame (header + at most MAX_FRAME_BYTES) however much the guest
writes, and refuses anything that is not a well-formed frame of a JSON
object. The channel is a pipe the host made, not a file in a directory the
guest can change, so there is no path to follow (docs/security.md, rules
H1 and H3). Frames are hostile input: see `dispatch/executors/records.py`.
"""

from __future__ import annotations

import errno
import os
import select
import threading
import time
from typing import Any

from tenantq.guest.protocol import HEADER_BYTES, FrameError, decode_body, encode, parse_header


class GuestGone(Exception):
    """The sandbox's process exited (or closed the channel)."""


class ChannelTimeout(Exception):
    """Nothing (or not all of a frame) arrived before the deadline."""


class FrameReader:
    """Incremental frames from untrusted bytes, one frame of memory at most."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._need: int | None = None  # body length, once the header is in

    def wanted(self) -> int:
        """How many more bytes complete the current header or body: the most
        the caller should read, so the buffer never exceeds one frame."""
        if self._need is None:
            return HEADER_BYTES - len(self._buffer)
        return self._need - len(self._buffer)

    def feed(self, data: bytes) -> dict[str, Any] | None:
        """Add at most wanted() bytes; the frame they complete, if any."""
        if len(data) > self.wanted():
            raise FrameError("more bytes than one frame")  # a caller bug, not the guest's
        self._buffer += data
        if self._need is None:
            if len(self._buffer) < HEADER_BYTES:
                return None
            self._need = parse_header(bytes(self._buffer))
            self._buffer.clear()
        if len(self._buffer) < self._need:
            return None
        body = bytes(self._buffer)
        self._buffer.clear()
        self._need = None
        return decode_body(body)


class Channel:
    """Frames over the pipes of one started process (see hostside.HostProcess)."""

    def __init__(self, stdin_fd: int, stdout_fd: int, alive: Any) -> None:
        self.stdin_fd = stdin_fd
        self.stdout_fd = stdout_fd
        self.alive = alive  # () -> bool: is the process still there?
        self.reader = FrameReader()
        # a cancel (BatchSession.cancel, another thread) may be sent while
        # the session sends: frames must not interleave
        self._send_lock = threading.Lock()
        os.set_blocking(stdin_fd, False)
        os.set_blocking(stdout_fd, False)

    def send(self, value: object, deadline: float) -> None:
        with self._send_lock:
            self._send(value, deadline)

    def _send(self, value: object, deadline: float) -> None:
        data = memoryview(encode(value))
        while data:
            try:
                written = os.write(self.stdin_fd, data)
            except BlockingIOError:
                written = 0
            except OSError as exc:
                raise GuestGone(f"the guest stopped reading its channel ({exc.strerror})") from None
            data = data[written:]
            if not data:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelTimeout("the guest did not take its input in time")
            wait_fd(self.stdin_fd, select.POLLOUT, min(remaining, 0.1))
            if not self.alive():
                raise GuestGone("the guest exited")

    def receive(self, deadline: float, *, poll: float = 0.1) -> dict[str, Any]:
        """The next frame; ChannelTimeout past the deadline, GuestGone when
        the process ends or closes its end, FrameError on a bad frame."""
        exited = False
        while True:
            try:
                chunk = os.read(self.stdout_fd, self.reader.wanted())
            except BlockingIOError:
                chunk = None
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise GuestGone(f"the channel failed ({exc.strerror})") from None
            if chunk == b"":
                raise GuestGone("the guest closed its channel")
            if chunk:
                frame = self.reader.feed(chunk)
                if frame is not None:
                    return frame
                continue
            if exited:
                raise GuestGone("the guest exited")
            if not self.alive():
                # it may have written its last frame (a warm parent's
                # batch_end) just before it exited, after the read above:
                # read once more before saying it is gone
                exited = True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelTimeout("no frame from the guest in time")
            wait_fd(self.stdout_fd, select.POLLIN, min(remaining, poll))


def wait_fd(fd: int, events: int, seconds: float) -> None:
    """Wait until `fd` is ready for `events` (or `seconds` pass). poll, not
    select: select cannot take a descriptor numbered 1024 or more, and a host
    process holding many sandboxes (or a guest holding many of its proxy's
    connections) gets there (rule H6)."""
    poller = select.poll()
    poller.register(fd, events)
    poller.poll(max(0, int(seconds * 1000)))
