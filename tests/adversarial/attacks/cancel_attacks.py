"""Rule H2 (cancelling a running job is the host's decision) and C1/C2/H3
around it: what a hostile job that has read guest/supervisor.py does about
cancels. Stdlib only (it runs in the guest).

The batch supervisor stops the job in flight when the host sends it
`{"op": "cancel", "seq": N}` on its stdin, and it relays whatever reason the
job's own result frame (fd 3) states, "cancelled" included. So a job can:

- forge cancel-shaped content (`{"op": "cancel", "seq": ...}` frames and
  lines, `job_end` records with reason "cancelled", for every sequence
  number it can guess) to every descriptor it holds and every
  /proc/PID/fd/* it can open (`cancel.forge`), in floods (`cancel.flood`);
- hand the supervisor the exact outcome a real cancel produces, on its own
  result pipe (`cancel.forge` with `result_fd: "cancelled"`);
- resist a real cancel: ignore and block every catchable signal, fork,
  setsid, double-fork, respawn, exec (`cancel.resist`, mode "stubborn");
- race it: pre-write all but the last byte of a success frame and complete
  it from signal handlers and from leftovers that watch the supervisor wake
  up (the cancel frame is what wakes it), then keep writing success frames
  (`cancel.resist`, mode "racer"); and try to swallow the host's frames by
  reopening the supervisor's stdin.

`cancel.sibling` is the hostile tenant's honest job (the fields of
`adv.echo`, which the harness checks, plus what it saw of earlier jobs over
a short watch window); `cancel.nap` a short job the tests cancel around its
end; `cancel.victim` a job that must never run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

import tenantq
from tests.adversarial.attacks.tools import (
    RESULT_FD,
    SCRATCH_DIRS,
    STATE,
    billing,
    describe_pid,
    errname,
    is_open,
    libc,
    others,
    pids,
    walk,
    write_nonblocking,
)

# the exact outcome the supervisor reports for a job it stopped (guest/supervisor.py)
CANCELLED_OUTCOME = {"ok": False, "reason": "cancelled", "error": "cancelled while running"}
RACED = "RESULT-WRITTEN-AFTER-CANCEL"
CATCHABLE = sorted(set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
QUIET = {signal.SIGCHLD, signal.SIGWINCH, signal.SIGURG, signal.SIGPIPE}
# a racer's watchers arm once the supervisor has been idle this long (the
# tests cancel well after: tests/adversarial/test_cancel.py, SETUP_SECONDS)
STILL_SECONDS = 0.3


# -- what a forged cancel looks like ---------------------------------------------------


def seq_guesses(job_id: int) -> list[Any]:
    """Every sequence number a job could guess for itself or a sibling:
    small ones, around its job id, huge, negative, and values that are not
    integers at all."""
    ints = [*range(-3, 65), *(job_id + d for d in range(-4, 5)), 2**31 - 1, 2**31, 2**32, 2**53 + 1,
            2**63 - 1, 2**63, 2**64, 10**30, -(2**31), -(2**63)]
    odd: list[Any] = [0.0, 1.0, 1.5, -1.0, 1e308, "0", "1", str(job_id), "seq", True, False, None, [], [0],
                      [1], {}, {"seq": 1}]
    return [*ints, *odd]


def cancel_records(job_id: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [{"op": "cancel"}, {"op": "cancel", "seq": "*"},
                                     {"op": "cancel", "all": True}]
    for seq in seq_guesses(job_id):
        records.append({"op": "cancel", "seq": seq})
        records.append({"op": "cancel", "seq": seq, "job_id": job_id + 1, "by": "mallory"})
        records.append({"status": "job_end", "seq": seq, **CANCELLED_OUTCOME})
        records.append({"seq": seq, **CANCELLED_OUTCOME})
    return records


def cancel_blob(job_id: int) -> bytes:
    """The records as control-channel frames, then as JSON lines, then as
    the workers' notification payloads (`cancel:<batch>:<job>`)."""
    from tenantq.guest.protocol import encode

    records = cancel_records(job_id)
    frames = b"".join(encode(r) for r in records)
    lines = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    notes = b"".join(b"cancel:%d:%d\n" % (batch, job_id + d) for batch in range(0, 40) for d in (-1, 0, 1))
    return frames + lines + notes + frames


def write_everywhere(blob: bytes, skip: set[int]) -> tuple[dict[str, str], dict[str, str]]:
    """`blob` to every descriptor this process holds (but `skip`), and to
    every /proc/PID/fd/* (and task fds) of every other process that opens
    for writing. Never reads (a read of a reopened stdin would be another
    attack: see `_swallow`)."""
    own: dict[str, str] = {}
    for fd in range(1024):
        if fd not in skip and is_open(fd):
            own[str(fd)] = write_nonblocking(fd, blob)
    reopened: dict[str, str] = {}
    me = os.getpid()
    for pid in pids():
        if pid == me:
            continue
        bases = [f"/proc/{pid}/fd"]
        with contextlib.suppress(OSError):
            bases += [f"/proc/{pid}/task/{t}/fd" for t in os.listdir(f"/proc/{pid}/task")]
        for base in bases:
            try:
                names = os.listdir(base)
            except OSError as exc:
                reopened[base] = errname(exc.errno or 0)
                names = [str(n) for n in range(10)]  # blind
            for name in names:
                path = f"{base}/{name}"
                for label, flags in (("w", os.O_WRONLY), ("rw", os.O_RDWR)):
                    try:
                        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY)
                    except OSError as exc:
                        if exc.errno != 2:  # ENOENT: nothing there
                            reopened[f"{path}:{label}"] = errname(exc.errno or 0)
                        continue
                    try:
                        wrote = write_nonblocking(fd, blob)
                        usable = wrote.startswith("wrote") and not wrote.startswith("wrote 0 ")
                        reopened[f"{path}:{label}"] = f"{'USABLE' if usable else 'inert'}: {wrote}"
                    finally:
                        os.close(fd)
    return own, reopened


@tenantq.handler("cancel.forge", timeout=30, memory_mb=256)
def forge(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Forged cancels for itself and every guessable sibling, by every
    channel; then either its own ordinary result, or (result_fd
    "cancelled") the outcome a real cancel produces, on its result pipe."""
    from tenantq.guest.protocol import encode, write_all

    blob = cancel_blob(ctx.job_id)
    if payload.get("result_fd") == "cancelled":
        # what comes first on the result pipe is this job's outcome: the
        # supervisor relays reason "cancelled" as it would for a real cancel
        write_all(RESULT_FD, encode(CANCELLED_OUTCOME))
        write_nonblocking(RESULT_FD, encode(CANCELLED_OUTCOME) * 64 + blob)
        write_everywhere(blob, skip={RESULT_FD})
        os._exit(0)
    own, reopened = write_everywhere(blob, skip={RESULT_FD})
    print(json.dumps({"status": "job_end", "seq": 0, **CANCELLED_OUTCOME}), flush=True)
    return {"forged": ctx.job_id, "own": own, "proc": reopened, "pid": os.getpid(), "ppid": os.getppid(),
            "blob_bytes": len(blob)}


@tenantq.handler("cancel.flood", timeout=60, memory_mb=256)
def flood(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Thousands of cancel-shaped lines and frames as fast as it can, on
    stdout and stderr (and, with `fd3`, on its result pipe, where the first
    frame is its own outcome), plus a child that keeps spewing until it is
    killed; then it returns normally."""
    from tenantq.guest.protocol import encode, write_all

    count = int(payload.get("count", 50_000))
    records = cancel_records(ctx.job_id)
    line_bytes = b"".join(json.dumps(records[i % len(records)]).encode() + b"\n" for i in range(count))
    frame_bytes = b"".join(encode(records[i % len(records)]) for i in range(count))
    if payload.get("fd3"):
        outcome = encode(CANCELLED_OUTCOME)
        frames = 0
        deadline = time.monotonic() + 1.0
        while frames < count and time.monotonic() < deadline:
            if write_nonblocking(RESULT_FD, outcome * 256).endswith("(full)"):
                break
            frames += 256
    if payload.get("child") and os.fork() == 0:
        # blocking writes: O_NONBLOCK would flip the pipe shared with the parent
        with contextlib.suppress(BaseException):
            end = time.monotonic() + 60
            chunk = frame_bytes[: 1 << 15] + line_bytes[: 1 << 15]
            while time.monotonic() < end:
                for fd in (1, 2):
                    with contextlib.suppress(OSError):
                        write_all(fd, chunk)
        os._exit(0)
    written: dict[str, int] = {}
    started = time.monotonic()
    for fd in (1, 2):
        for name, data in (("lines", line_bytes), ("frames", frame_bytes)):
            for at in range(0, len(data), 1 << 16):
                write_all(fd, data[at: at + (1 << 16)])
            written[f"{fd} {name}"] = len(data)
    return {"flooded": ctx.job_id, "written": written, "seconds": round(time.monotonic() - started, 3)}


@tenantq.handler("cancel.shared", timeout=10, memory_mb=128, process="batch")
def shared(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """A handler with process="batch" (docs/security.md, rule C2: it may
    affect the later jobs of its kind in its batch, never the accounting of
    rule H2): with `forge_next` it writes its own result, then the outcome of
    a real cancel for whichever job of its kind reads this result pipe next."""
    from tenantq.guest.protocol import encode, write_all

    mine = {"shared": ctx.job_id}
    if payload.get("forge_next"):
        write_all(RESULT_FD, encode({"ok": True, "result": mine}) + encode(CANCELLED_OUTCOME) * 4)
    return mine


# -- resisting a real cancel -----------------------------------------------------------


def _deaf() -> None:
    """Ignore and block every signal this uid may ignore or block."""
    for signum in CATCHABLE:
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            signal.signal(signum, signal.SIG_IGN)
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_BLOCK, CATCHABLE)


def _name(name: bytes) -> None:
    with contextlib.suppress(Exception):
        libc().prctl(15, name, 0, 0, 0)  # PR_SET_NAME


def _heartbeat(tag: str, seconds: float = 120.0) -> None:
    """A leftover's life: files a later job would find (in every scratch
    dir, rewritten all the time), until killed."""
    _name(b"tqcancel-left")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for directory in SCRATCH_DIRS[:2]:
            with contextlib.suppress(OSError):
                with open(os.path.join(directory, f"{tag}-hb-{os.getpid()}"), "w") as fh:
                    fh.write(str(time.time()))
        time.sleep(0.02)
    os._exit(0)


def _fingerprint(pid: int) -> str:
    """What changes when the supervisor is scheduled: its CPU times, context
    switches and schedstat (all readable for a process this uid cannot
    ptrace)."""
    parts = []
    for name in ("stat", "schedstat", "status"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as fh:
                text = fh.read().decode(errors="replace")
        except OSError:
            continue
        if name == "stat":
            fields = text.rsplit(")", 1)[-1].split()
            text = " ".join(fields[11:13])  # utime, stime
        elif name == "status":
            text = " ".join(line for line in text.splitlines() if "ctxt_switches" in line)
        parts.append(text)
    return "|".join(parts)


class Racer:
    """All but the last byte of a success frame already on the result pipe;
    `fire()` (from a signal handler, a watcher thread or a leftover that
    still holds fd 3) completes it and keeps writing whole success frames."""

    def __init__(self, job_id: int) -> None:
        from tenantq.guest.protocol import encode

        self.frame = encode({"ok": True, "result": {"racer": job_id, "raced": RACED}})
        self.fired = False

    def arm(self) -> None:
        from tenantq.guest.protocol import write_all

        write_all(RESULT_FD, self.frame[:-1])

    def fire(self, seconds: float = 30.0) -> None:
        self.fired = True
        end = time.monotonic() + seconds
        tail = self.frame[-1:]
        while time.monotonic() < end:
            if tail:
                with contextlib.suppress(OSError):
                    if os.write(RESULT_FD, tail):
                        tail = b""
                continue
            with contextlib.suppress(OSError):
                write_nonblocking(RESULT_FD, self.frame)
            time.sleep(0.0005)

    def watch(self, supervisor: int, seconds: float = 60.0) -> None:
        """Fire on the supervisor's first wake-up (the host's cancel frame
        is the only thing that wakes it while the job is silent). Silent
        itself: a traceback on stderr would wake the supervisor."""
        with contextlib.suppress(BaseException):
            # armed once the supervisor has been still for a while (it woke
            # to read the frame's first bytes, and for the job's setup)
            base, still_since = _fingerprint(supervisor), time.monotonic()
            while time.monotonic() - still_since < STILL_SECONDS:
                now = _fingerprint(supervisor)
                if now != base:
                    base, still_since = now, time.monotonic()
                time.sleep(0.001)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if _fingerprint(supervisor) != base:
                    self.fire()
                    return
                time.sleep(0.001)


def _swallow(seconds: float = 30.0) -> dict[str, str]:
    """Try to read the host's frames (its cancel among them) off the
    supervisor's and the runner's stdin before they do, for as long as the
    job lives."""
    seen: dict[str, str] = {}
    opened: list[int] = []
    for pid in (os.getppid(), 1):  # OSError only: nothing reaches stderr
        path = f"/proc/{pid}/fd/0"
        try:
            opened.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
            seen[path] = "opened"
        except OSError as exc:
            seen[path] = errname(exc.errno or 0)
    end = time.monotonic() + seconds
    while opened and time.monotonic() < end:
        for fd in list(opened):
            try:
                os.read(fd, 1 << 16)
            except BlockingIOError:
                pass
            except OSError:
                opened.remove(fd)
        time.sleep(0.0005)
    return seen


def _spawn(tag: str, racer: Racer | None, supervisor: int) -> None:
    """Leftovers in every shape, each deaf to signals; a racer's leftovers
    also watch the supervisor and race the cancel with result frames."""

    def life() -> None:
        _deaf()
        if racer is not None:
            threading.Thread(target=racer.watch, args=(supervisor,), daemon=True).start()
        _heartbeat(tag)

    # a plain child (same process group)
    if os.fork() == 0:
        life()
    # a session of its own
    if os.fork() == 0:
        os.setsid()
        life()
    # double fork + setsid: a daemon the supervisor inherits
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            life()
        os._exit(0)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    # a respawner in a process group of its own: always forking
    if os.fork() == 0:
        os.setpgid(0, 0)
        _deaf()
        _name(b"tqcancel-spawn")
        live: list[int] = []
        end = time.monotonic() + 120
        while time.monotonic() < end:
            with contextlib.suppress(ChildProcessError, OSError):
                while True:
                    gone, _ = os.waitpid(-1, os.WNOHANG)
                    if gone == 0:
                        break
                    live.remove(gone)
            if len(live) < 8:
                with contextlib.suppress(OSError):
                    child = os.fork()
                    if child == 0:
                        os.setsid()
                        _heartbeat(tag)
                    live.append(child)
            time.sleep(0.01)
        os._exit(0)
    # an exec'd binary in a session of its own (no fd 3: it cannot race)
    for binary in ("/usr/bin/sleep", "/bin/sleep"):
        if os.path.exists(binary):
            with contextlib.suppress(OSError):
                subprocess.Popen([binary, "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
            break


@tenantq.handler("cancel.resist", timeout=20, memory_mb=256)
def resist(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Runs until the handler's timeout unless stopped. "stubborn": deaf to
    every signal, with leftovers in every shape. "racer": the same
    leftovers, and a result frame one byte short, completed by whoever
    notices the cancel first (signal handlers, watchers). A stubborn one
    with `report_after` returns after that long: what it left running."""
    tag = str(payload["tag"])
    supervisor = os.getppid()
    racer: Racer | None = None
    if payload.get("mode") == "racer":
        racer = Racer(ctx.job_id)
        racer.arm()
        for signum in CATCHABLE:
            # SIGCHLD (its own double fork) and the ignored-by-default ones
            # would fire it before any cancel; SIGPIPE would recurse
            action: Any = signal.SIG_IGN if signum in QUIET else (lambda s, f, r=racer: r.fire(5.0))
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                signal.signal(signum, action)
    else:
        _deaf()
    _spawn(tag, racer, supervisor)
    if racer is not None:
        threading.Thread(target=racer.watch, args=(supervisor,), daemon=True).start()
        threading.Thread(target=_swallow, daemon=True).start()
    threading.Thread(target=_heartbeat, args=(tag,), daemon=True).start()
    if "report_after" in payload and racer is None:
        # the control: what a cancel of this job would have to stop, and
        # whether the racer's watchers can see the supervisor at all
        first = _fingerprint(supervisor)
        time.sleep(float(payload["report_after"]))
        return {"resisted": ctx.job_id, "alive": [describe_pid(p) for p in others()],
                "fingerprint": [first, _fingerprint(supervisor)], "swallow": _swallow(0.0)}
    end = time.monotonic() + 30
    while time.monotonic() < end:
        with contextlib.suppress(BaseException):
            time.sleep(0.05)
    return {"resisted": ctx.job_id, "not_stopped": True}


# -- the honest jobs -----------------------------------------------------------------


def _starttime(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[-1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@tenantq.handler("cancel.sibling", timeout=20, memory_mb=128)
def sibling(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """The hostile tenant's honest job: adv.echo's fields (which the harness
    checks), and every process and scratch entry it saw from its start to
    its end (`watch` seconds, long enough for a surviving leftover of the
    job before it to show itself), with what tells its batch apart (its
    supervisor's pid and start time)."""
    n = int(payload["n"])
    started = time.time()
    seen = {describe_pid(p) for p in others()}
    scratch = {d: set(walk(d, 50)) for d in SCRATCH_DIRS if os.path.isdir(d)}
    end = time.monotonic() + float(payload.get("watch", 0.0))
    while True:
        seen.update(describe_pid(p) for p in others())
        for directory in scratch:
            scratch[directory].update(walk(directory, 50))
        if time.monotonic() >= end:
            break
        time.sleep(0.02)
    time.sleep(float(payload.get("sleep", 0.0)))
    return {"tenant": ctx.tenant, "n": n, "billing": billing(n), "attempt": ctx.attempt, "uid": os.getuid(),
            "scratch": {d: sorted(e) for d, e in scratch.items()}, "others": sorted(seen),
            "pristine": STATE.get("pristine"), "job_id": ctx.job_id, "pid": os.getpid(),
            "ppid": os.getppid(), "supervisor_started": _starttime(os.getppid()), "started": started}


@tenantq.handler("cancel.nap", timeout=20, memory_mb=128)
def nap(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    time.sleep(float(payload["sleep"]))
    return {"napped": ctx.job_id}


@tenantq.handler("cancel.victim", timeout=20, memory_mb=128)
def victim(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """Cancelled before its turn: it must never run."""
    return {"ran": ctx.job_id}
