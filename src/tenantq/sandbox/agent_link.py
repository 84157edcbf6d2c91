"""The host's end of a Sandbox API sandbox's agent (guest/agent.py).

One reader thread per sandbox takes the agent's frames off the channel
(sandbox/channel.py: at most one frame of memory, whatever the guest
writes) and hands them to the request or command they name. Everything in
them is hostile input (docs/security.md, rules H3 and H4): an unknown
event, an id the host never gave out, data that is not base64 or longer
than asked for breaks the link (the sandbox is then unusable, and says
why); a command's output is kept up to its cap and only counted past it,
so a flood costs the host nothing but the reading. What the agent reports
is the guest's own claim (an exit status, output); what the host decides
by itself (a timeout, an OOM, the TTL) it measures itself (sandbox/api.py).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tenantq.guest.protocol import FrameError
from tenantq.sandbox.channel import Channel, ChannelTimeout, GuestGone

SEND_SECONDS = 30.0
# how often the reader looks up from the channel (to park for a fork)
READ_SLICE_SECONDS = 0.2


class SandboxGone(Exception):
    """The sandbox's agent is gone (the sandbox ended, was killed, or broke its protocol)."""


@dataclass
class CommandState:
    """What the host knows about one exec: filled in by the reader thread."""

    cap: int
    on_output: dict[int, Callable[[str], None] | None]
    pid: int | None = None
    status: int | None = None
    error: str | None = None
    output: dict[int, bytearray] = field(default_factory=lambda: {1: bytearray(), 2: bytearray()})
    dropped: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})
    started: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)


HANDED_OVER = "the sandbox's init was handed over to the queue's guest runner"


class AgentLink:
    def __init__(self, channel: Channel, *, owns_fds: bool = False, read: bool = True) -> None:
        """`owns_fds`: the channel's fds are this link's to close (a
        connected socket); a started process's pipes are its HostProcess's.
        `read=False`: a sandbox restored from a handed-over image, whose
        channel is its runner's (no agent is there to read)."""
        self.channel = channel
        self._owns_fds = owns_fds
        self.broken: str | None = None
        self.ready = threading.Event()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._replies: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self.commands: dict[int, CommandState] = {}
        # a fork swaps the channel (checkpoint, then restore): sends wait,
        # and the reader takes the old channel's end as the switch
        self._may_send = threading.Event()
        self._may_send.set()
        self._switching = False
        self._rebound = threading.Event()
        self._parked = threading.Event()
        # the rid of a hand_over request: the reader stops at its reply
        self._last_rid: int | None = None
        self._thread = threading.Thread(target=self._read, name="tenantq-sandbox-link", daemon=True)
        if read:
            self._thread.start()
        else:
            self.broken = HANDED_OVER

    def hand_over(self, argv: list[str], env: dict[str, str], timeout: float) -> None:
        """Have the agent exec `argv` as the sandbox's init on this channel,
        which is then the caller's: the reader thread reads the reply and
        nothing after it (one frame at a time: the runner's first frame stays
        in the pipe), and the link is closed for every other use."""
        rid = next(self._ids)
        self._last_rid = rid
        event, box = threading.Event(), list[dict[str, Any]]()
        with self._lock:
            self._replies[rid] = (event, box)
        try:
            self.send({"op": "hand_over", "rid": rid, "argv": argv, "env": env})
            if not event.wait(timeout):
                raise SandboxGone(f"the sandbox's agent did not hand over within {timeout:g} s")
        finally:
            with self._lock:
                self._replies.pop(rid, None)
        if not box or box[0].get("ok") is not True:
            why = str(box[0].get("error"))[:200] if box else "no reply"
            raise SandboxGone(self.broken or f"the agent refused the hand-over: {why}")
        self._thread.join(SEND_SECONDS)
        if self._thread.is_alive():
            raise SandboxGone("the sandbox's link did not stop reading for the hand-over")

    def wait_ready(self, seconds: float) -> None:
        if not self.ready.wait(seconds) and self.broken is None:
            self.fail("the sandbox's agent did not start in time")
        if self.broken is not None:
            raise SandboxGone(self.broken)

    # -- sending ---------------------------------------------------------------

    def send(self, frame: dict[str, Any]) -> None:
        if self.broken is not None:
            raise SandboxGone(self.broken)
        if not self._may_send.wait(SEND_SECONDS * 4):
            raise SandboxGone("the sandbox is still being forked")
        try:
            self.channel.send(frame, time.monotonic() + SEND_SECONDS)
        except (GuestGone, ChannelTimeout) as exc:
            self.fail(f"the sandbox's agent is gone ({exc})")
            raise SandboxGone(self.broken or str(exc)) from None

    def request(self, frame: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request and wait for its reply."""
        rid = next(self._ids)
        event, box = threading.Event(), list[dict[str, Any]]()
        with self._lock:
            self._replies[rid] = (event, box)
        try:
            self.send({**frame, "rid": rid})
            if not event.wait(timeout):
                raise TimeoutError(f"the sandbox did not answer {frame.get('fs', frame.get('op'))!r} "
                                   f"within {timeout:g} s")
        finally:
            with self._lock:
                self._replies.pop(rid, None)
        if not box:
            raise SandboxGone(self.broken or "the sandbox's agent is gone")
        reply: dict[str, Any] = box[0]
        return reply

    def start_command(self, frame: dict[str, Any], cap: int,
                      on_output: dict[int, Callable[[str], None] | None]) -> tuple[int, CommandState]:
        command_id = next(self._ids)
        state = CommandState(cap=cap, on_output=on_output)
        with self._lock:
            self.commands[command_id] = state
        self.send({**frame, "op": "exec", "id": command_id, "cap": cap})
        return command_id, state

    def forget_command(self, command_id: int) -> None:
        """An ended command's state goes once its result is taken (a
        long-lived sandbox runs any number of commands; the host keeps none
        of their output). A later event for it breaks the link."""
        with self._lock:
            self.commands.pop(command_id, None)

    # -- receiving -------------------------------------------------------------

    def _read(self) -> None:
        while self.broken is None:
            if self._switching:
                # parked off the old channel until the new one is there
                self._parked.set()
                if not self._rebound.wait(SEND_SECONDS * 4):
                    self.fail("the sandbox did not come back from its checkpoint")
                    return
                self._rebound.clear()
                self._parked.clear()
                self._switching = False
                continue
            try:
                frame = self.channel.receive(time.monotonic() + READ_SLICE_SECONDS, poll=READ_SLICE_SECONDS)
            except ChannelTimeout:
                continue
            except (GuestGone, FrameError) as exc:
                if self._switching:
                    continue
                self.fail(f"the sandbox's agent is gone ({exc})")
                return
            try:
                self._handle(frame)
            except (KeyError, TypeError, ValueError, binascii.Error) as exc:
                self.fail(f"the sandbox broke the agent protocol ({type(exc).__name__}: {str(exc)[:120]})")
                return
            if self._last_rid is not None and frame.get("rid") == self._last_rid and frame.get("ok") is True:
                # the hand-over's reply: what follows on the channel is the runner's
                self.fail(HANDED_OVER)
                return

    def _handle(self, frame: dict[str, Any]) -> None:
        event = frame["event"]
        if event == "ready":
            self.ready.set()
        elif event == "reply":
            with self._lock:
                waiting = self._replies.get(_int(frame["rid"]))
            if waiting is not None:  # a late reply to a request that timed out is dropped
                waiting[1].append(frame)
                waiting[0].set()
        elif event in ("started", "out", "exit"):
            with self._lock:
                state = self.commands.get(_int(frame["id"]))
            if state is None:
                raise ValueError(f"event for a command the host never started: {frame['id']!r}")
            self._command_event(state, event, frame)
        elif event == "protocol_error":
            raise ValueError(f"the agent refused a frame: {str(frame.get('error'))[:120]}")
        else:
            raise ValueError(f"unknown event {str(event)[:40]!r}")

    @staticmethod
    def _command_event(state: CommandState, event: str, frame: dict[str, Any]) -> None:
        if event == "started":
            state.pid = _int(frame["pid"])
            state.started.set()
        elif event == "out":
            stream = _int(frame["fd"])
            if stream not in (1, 2):
                raise ValueError(f"output on stream {stream}")
            data = base64.b64decode(str(frame["data"]), validate=True)
            room = max(0, state.cap - len(state.output[stream]))
            state.output[stream] += data[:room]
            state.dropped[stream] += len(data) - min(room, len(data))
            callback = state.on_output.get(stream)
            if callback is not None and room:
                with contextlib.suppress(Exception):  # a user callback's error is theirs
                    callback(data[:room].decode("utf-8", errors="replace"))
        else:
            if "error" in frame:
                state.error = str(frame["error"])[:1000]
            else:
                state.status = _int(frame["status"])
                dropped = frame.get("dropped") or [0, 0]
                for stream, count in zip((1, 2), dropped[:2], strict=False):
                    state.dropped[stream] += max(0, _int(count))
            state.started.set()
            state.ended.set()

    def hold(self, seconds: float) -> None:
        """Before a checkpoint: the agent flushes what it has and goes quiet
        (the channel then stops at a frame boundary); sends wait."""
        self.request({"op": "quiesce"}, seconds)
        self._may_send.clear()
        self._switching = True
        if not self._parked.wait(seconds):
            raise SandboxGone("the sandbox's link did not stop reading for the checkpoint")

    def rebind(self, channel: Channel, *, forget: bool) -> None:
        """After the restore: the new channel, and the agent speaks again."""
        self.channel = channel
        self._rebound.set()
        self._may_send.set()
        self.send({"op": "resume", "forget": forget})

    def release(self) -> None:
        """A fork that failed before any restore: back to the old channel."""
        self._rebound.set()
        self.send({"op": "resume", "forget": False})
        self._may_send.set()

    def close(self, why: str = "the sandbox was let go of (close())") -> None:
        self.fail(why)
        if self._owns_fds:
            self._owns_fds = False
            with contextlib.suppress(OSError):
                os.close(self.channel.stdin_fd)

    def fail(self, why: str) -> None:
        """Break the link: every waiter wakes up and sees `why`."""
        with self._lock:
            if self.broken is None:
                self.broken = why
            waiting = list(self._replies.values())
            states = list(self.commands.values())
        for event, _ in waiting:
            event.set()
        for state in states:
            if state.error is None and state.status is None:
                state.error = why
            state.started.set()
            state.ended.set()


def _int(value: Any) -> int:
    """An integer from the guest: a real int (not a bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {type(value).__name__}")
    if abs(value) > 1 << 62:
        raise ValueError("integer out of range")
    return value
