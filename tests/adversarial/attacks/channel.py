"""Rules C1, H2, H3, H4: the control channel, the result pipe and the output pipe."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from typing import Any

import tenantq
from tests.adversarial.attacks.tools import (
    FORGED,
    RESULT_FD,
    SCRATCH_DIRS,
    errname,
    forged_frames,
    is_open,
    pids,
    write_nonblocking,
)

# -- C1 / H2: garbage and forged control records to every descriptor -----------------


def use_reopened(fd: int, frames: bytes) -> str:
    """What a descriptor reopened through /proc lets a job do: 'USABLE ...'
    when data moves either way, else 'inert ...' (opened, but read and write
    both refused)."""
    wrote = write_nonblocking(fd, frames)
    try:
        got = f"read {len(os.read(fd, 65536))} bytes"
    except BlockingIOError:
        got = "read would block"
    except OSError as exc:
        got = f"read {errname(exc.errno or 0)}"
    usable = (wrote.startswith("wrote") and not wrote.startswith("wrote 0 ")) or not got.startswith("read E")
    return f"{'USABLE' if usable else 'inert'}: {wrote}; {got}"


@tenantq.handler("adv.fds", timeout=20, memory_mb=256)
def fds(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    frames = forged_frames(ctx.job_id)
    blob = frames + os.urandom(4096) + b"\n\x00" * 512 + frames
    own: dict[str, str] = {}
    for fd in range(1024):
        if fd == RESULT_FD and not payload.get("result_fd"):
            continue
        if is_open(fd):
            own[str(fd)] = write_nonblocking(fd, blob)
    proc: dict[str, str] = {}
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
                proc[base] = f"listed {len(names)}"
            except OSError as exc:
                proc[base] = errname(exc.errno or 0)
                names = [str(n) for n in range(8)]  # try them blind
            for name in names:
                path = f"{base}/{name}"
                for label, flags in (("w", os.O_WRONLY | os.O_NONBLOCK), ("r", os.O_RDONLY | os.O_NONBLOCK)):
                    try:
                        fd = os.open(path, flags)
                    except OSError as exc:
                        if exc.errno not in (errno.ENOENT,):
                            proc[f"{path}:{label}"] = errname(exc.errno or 0)
                        continue
                    try:
                        proc[f"{path}:{label}"] = use_reopened(fd, frames)
                    finally:
                        os.close(fd)
    return {"own": own, "proc": proc, "pid": me, "ppid": os.getppid(), "pids": pids()}


@tenantq.handler("adv.raw_result", timeout=20, memory_mb=256)
def raw_result(payload: dict[str, Any], ctx: tenantq.JobContext) -> None:
    """Writes its own result frame on the result pipe, bypassing
    guest/jobs.py's checks, then exits without another word."""
    from tenantq.guest.protocol import write_all

    variant = payload["variant"]
    if variant == "deep":  # past the 64 levels the host allows
        body = '{"ok": true, "result": ' + "[" * 500 + "]" * 500 + "}"
    elif variant == "reason":  # a failure reason outside the fixed set
        body = json.dumps({"ok": False, "reason": "refund-me", "error": "bogus reason"})
    elif variant == "inf":  # 1e400 parses as inf: not JSON the host may store
        body = '{"ok": true, "result": {"cost": 1e400, "n": -1e400}}'
    elif variant == "nan_token":
        body = '{"ok": true, "result": NaN}'
    elif variant == "error_text":  # NUL and lone surrogates, far past 4,000 characters
        body = json.dumps({"ok": False, "reason": "exception",
                           "error": "bad\u0000text \ud800 \udfff " + "E" * 200_000})
    elif variant == "over_result_limit":  # under the frame limit, over the result limit
        body = json.dumps({"ok": True, "result": "R" * ((1 << 20) + (40 << 10))})
    elif variant == "nul_result":
        body = json.dumps({"ok": True, "result": {"k\u0000": "v\u0000"}})
    elif variant == "surrogate_result":
        body = json.dumps({"ok": True, "result": ["\ud800", {"\udfff": 1}]})
    elif variant == "extra_fields":  # tries to decide more than its own result
        body = json.dumps({"ok": True, "result": 1, "seq": 0, "status": "batch_end", "attempts": 0,
                           "job_id": ctx.job_id + 1, "refund": True})
    elif variant == "huge_header":
        write_all(RESULT_FD, b"9999999999\n" + b"{" * 4096)
        os._exit(0)
    elif variant == "truncated":
        write_all(RESULT_FD, b"%010d\n" % 1000 + b'{"ok": true')
        os._exit(0)
    else:
        raise ValueError(variant)
    data = body.encode("utf-8", "surrogatepass")
    write_all(RESULT_FD, b"%010d\n" % len(data) + data)
    os._exit(0)


# -- results --------------------------------------------------------------------


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


@tenantq.handler("adv.result", timeout=20, memory_mb=512)
def result(payload: dict[str, Any], ctx: tenantq.JobContext) -> Any:
    variant = payload["variant"]
    if variant == "huge":
        return {"blob": "x" * (3 << 20)}
    if variant == "large_ok":
        return {"blob": "y" * 900_000}
    if variant == "deep":
        return nested(10_000)
    if variant == "nan":
        return {"cost": float("nan")}
    if variant == "infinity":
        return [float("inf"), float("-inf")]
    if variant == "surrogate":
        return {"name": "lone \ud800 surrogate"}
    if variant == "nul":
        return {"name": "nul \u0000 char"}
    if variant == "bigint":
        return 10**5000
    if variant == "unserialisable":
        return {"set": {1, 2}, "bytes": b"\x00"}
    if variant == "huge_error":
        raise RuntimeError("E" * (8 << 20) + "\u0000\ud800")
    raise ValueError(variant)


# -- H3: output, disk --------------------------------------------------------------


@tenantq.handler("adv.flood", timeout=60, memory_mb=128)
def flood(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    total, chunk_size = int(payload.get("bytes", 1 << 30)), 1 << 20
    line = bool(payload.get("newlines", True))
    chunk = (b"m" * (chunk_size - 1) + b"\n") if line else b"A" * chunk_size
    targets = payload.get("fds", [1, 2])
    if targets == "all":
        # every open descriptor, the result pipe last
        targets = [fd for fd in range(1024) if is_open(fd) and fd != RESULT_FD] + [RESULT_FD]
    written: dict[str, int] = {}
    for fd in targets:
        done = 0
        try:
            while done < total:
                done += os.write(fd, chunk)
        except OSError as exc:
            written[f"{fd} {errname(exc.errno or 0)}"] = done
            continue
        written[str(fd)] = done
    if payload.get("then") == "raise":
        raise RuntimeError(f"flooded {written}")
    return {"written": written}


def _forge_forever(seconds: float) -> None:
    """Keep writing forged result frames and output, to every descriptor a
    job process holds, until killed."""
    from tenantq.guest.protocol import encode

    frame = encode({"ok": True, "result": FORGED})
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for fd in (RESULT_FD, 1, 2, 4):
            with contextlib.suppress(OSError):
                write_nonblocking(fd, frame)
        time.sleep(0.01)


@tenantq.handler("adv.shared", timeout=10, memory_mb=128, process="batch")
def shared(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    """A handler with process="batch" (docs/security.md, rule C2): it may
    affect the later jobs of its kind in its batch, never another kind's,
    never the next batch. It writes its own result frame and, behind it,
    forged frames for whatever job reads this pipe next; leaves a daemon and
    a thread that keep forging; and leaves files in the scratch dirs."""
    from tenantq.guest.protocol import encode, write_all

    mine = {"shared": ctx.job_id, "pid": os.getpid()}
    forged = encode({"ok": True, "result": FORGED}) * 8 + encode({"ok": False, "reason": "timeout",
                                                                   "error": FORGED})
    # its own result first (what comes first on the pipe is this job's to decide)
    write_all(RESULT_FD, encode({"ok": True, "result": mine}) + forged)
    if os.fork() == 0:
        os.setsid()
        with contextlib.suppress(BaseException):
            _forge_forever(120)
        os._exit(0)
    threading.Thread(target=_forge_forever, args=(120,), daemon=True).start()
    for directory in SCRATCH_DIRS:
        with contextlib.suppress(OSError), open(os.path.join(directory, f"shared-{ctx.job_id}"), "w") as fh:
            fh.write("left by a process='batch' job")
    return {"shared": ctx.job_id, "returned": True}
