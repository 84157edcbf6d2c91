"""Commands in a Sandbox API sandbox: `ExecResult` and the handle of a
running command (`sbx.exec(..., background=True)`).

The reason a command ended is classified from what the host measured
itself where it can (docs/security.md, rule H4): a timeout is the host's
own clock running out (it then kills the command's process group), an OOM
is the sandbox's memory cgroup saying it killed something; only the exit
status itself is the guest's report.
"""

from __future__ import annotations

import base64
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tenantq.sandbox.agent_link import CommandState, SandboxGone

if TYPE_CHECKING:
    from tenantq.sandbox.core import SandboxCore

# how long a killed command has to report its end before the host gives up on it
KILL_WAIT_SECONDS = 5.0


@dataclass(frozen=True)
class ExecResult:
    """How a command ended: `reason` is "ok", "timeout after N s", "oom",
    "killed by signal N (NAME)", "exit code N", or why the sandbox ended."""

    exit_code: int | None
    stdout: str
    stderr: str
    reason: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class CommandHandle:
    """A command started in a sandbox. `wait()` returns its ExecResult;
    `kill()` ends it and everything it started (its process group)."""

    def __init__(self, sandbox: SandboxCore, command_id: int, state: CommandState,
                 timeout: float | None) -> None:
        self.sandbox = sandbox
        self.id = command_id
        self._state = state
        self._started_at = time.monotonic()
        self._deadline = None if timeout is None else self._started_at + timeout
        self._timeout = timeout
        self._timed_out = False
        self._oom_before = sandbox.oom_count()
        self._result: ExecResult | None = None

    @property
    def pid(self) -> int | None:
        """The command's pid inside the sandbox (None until it started)."""
        self._state.started.wait(10)
        return self._state.pid

    def send_stdin(self, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        self.sandbox.link().send({"op": "stdin", "id": self.id, "data": base64.b64encode(raw).decode()})

    def close_stdin(self) -> None:
        self.sandbox.link().send({"op": "stdin", "id": self.id, "data": "", "eof": True})

    def kill(self) -> bool:
        """SIGKILL the command's process group; False when it already ended."""
        if self._state.ended.is_set():
            return False
        try:
            self.sandbox.link().send({"op": "kill", "id": self.id, "signal": int(signal.SIGKILL)})
        except SandboxGone:
            return False
        return True

    def wait(self, timeout: float | None = None) -> ExecResult:
        """Wait for the end (at most `timeout` s more: TimeoutError past it,
        the command keeps running). The command's own timeout, if it was
        given one, kills it when it runs out."""
        if self._result is not None:
            return self._result
        wait_until = None if timeout is None else time.monotonic() + timeout
        while not self._state.ended.is_set():
            now = time.monotonic()
            if self._deadline is not None and now >= self._deadline and not self._timed_out:
                self._timed_out = True
                self.kill()
                self._deadline = now + KILL_WAIT_SECONDS  # for the kill to land
                continue
            if self._timed_out and self._deadline is not None and now >= self._deadline:
                self.sandbox.link().fail("a killed command did not end: the agent no longer answers")
                break
            limits = [t for t in (self._deadline, wait_until) if t is not None]
            if wait_until is not None and now >= wait_until:
                raise TimeoutError(f"command {self.id} still runs after {timeout:g} s")
            self._state.ended.wait(min([1.0, *(t - now for t in limits)]) if limits else 1.0)
        self._result = self._classify()
        self.sandbox.link().forget_command(self.id)
        return self._result

    def _classify(self) -> ExecResult:
        state = self._state
        seconds = time.monotonic() - self._started_at
        out = state.output[1].decode("utf-8", errors="replace")
        err = state.output[2].decode("utf-8", errors="replace")
        truncated = {stream: state.dropped[stream] > 0 for stream in (1, 2)}
        if self._timed_out:
            reason = f"timeout after {self._timeout:g} s"
        elif self.sandbox.oom_count() > self._oom_before:
            reason = f"oom: exceeded {self.sandbox.spec.memory_mb} MiB"
        elif state.status is None:
            reason = self.sandbox.end_reason(state.error or "the sandbox ended")
        elif state.status == 0:
            reason = "ok"
        elif state.status < 0:
            reason = f"killed by signal {-state.status} ({_signal_name(-state.status)})"
        else:
            reason = f"exit code {state.status}"
        return ExecResult(exit_code=state.status, stdout=out, stderr=err, reason=reason,
                          stdout_truncated=truncated[1], stderr_truncated=truncated[2], seconds=seconds)
