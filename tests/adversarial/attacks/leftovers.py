"""Rules C2 and P1: what a job leaves behind for the next job and batch."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from typing import Any

import tenantq
from tests.adversarial.attacks.tools import (
    IPC_CREAT,
    IPC_PRIVATE,
    RESULT_FD,
    SCRATCH_DIRS,
    STATE,
    attempt,
    describe_pid,
    errname,
    ipc_calls,
    libc,
    mq_lib,
    others,
    walk,
)

# -- C2 / P1: what a job leaves behind ----------------------------------------------------


def _orphan(tag: str) -> None:
    """A leftover: renames itself, shrugs off polite signals, keeps a
    heartbeat file and an abstract socket a later job could find."""
    with contextlib.suppress(Exception):
        libc().prctl(15, b"tqadv-orphan", 0, 0, 0)  # PR_SET_NAME
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1, signal.SIGPIPE):
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, signal.SIG_IGN)
    listener = None
    with contextlib.suppress(OSError):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + tag + "-" + str(os.getpid()))
        listener.listen(4)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with open(f"/tmp/{tag}-heartbeat-{os.getpid()}", "w") as fh:
                fh.write(str(time.time()))
        time.sleep(0.02)
    os._exit(0)


def _spawn_orphans(tag: str) -> list[str]:
    made: list[str] = []
    # double fork + setsid: a daemon
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            _orphan(tag)
        os._exit(0)
    os.waitpid(pid, 0)
    made.append("double-fork daemon")
    # a plain child in a session of its own
    if os.fork() == 0:
        os.setsid()
        _orphan(tag)
    made.append("setsid child")
    # a child in its own process group that keeps forking replacements
    if os.fork() == 0:
        os.setpgid(0, 0)
        end = time.monotonic() + 300
        while time.monotonic() < end:
            child = os.fork()
            if child == 0:
                _orphan(tag)
            time.sleep(0.05)
        os._exit(0)
    made.append("respawner")
    # an exec'd binary, detached
    for binary in ("/usr/bin/sleep", "/bin/sleep"):
        if os.path.exists(binary):
            with contextlib.suppress(OSError):
                subprocess.Popen([binary, "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
                made.append(binary)
                break
    # a thread of this very process (gone with it, but it tries)
    threading.Thread(target=_orphan, args=(tag,), daemon=True).start()
    return made


def _files(tag: str) -> dict[str, str]:
    made: dict[str, str] = {}
    for directory in (*SCRATCH_DIRS, os.getcwd()):
        if not os.path.isdir(directory):
            made[directory] = "absent"
            continue
        for rel in (f"{tag}-file", f".{tag}-hidden", f"{tag}-dir/sub/deeper/file", f"{tag} with\nnewline"):
            path = os.path.join(directory, rel)

            def write(path: str = path) -> None:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as fh:
                    fh.write(f"left by job of {tag}")

            made[path] = attempt(write)
        made[f"{directory}/{tag}-fifo"] = attempt(lambda d=directory: os.mkfifo(f"{d}/{tag}-fifo"))
        made[f"{directory}/{tag}-link"] = attempt(
            lambda d=directory: os.symlink("/etc/passwd", f"{d}/{tag}-link"))
    return made


def ipc_keys(base: int) -> dict[str, int]:
    return {"shm": base, "msg": base + 1, "sem": base + 2}


def _ipc(base: int) -> dict[str, str]:
    shmget, msgget, semget = ipc_calls()
    keys = ipc_keys(base)
    out = {}
    for name, call, args in (("shm", shmget, (keys["shm"], 4096, IPC_CREAT | 0o666)),
                             ("msg", msgget, (keys["msg"], IPC_CREAT | 0o666)),
                             ("sem", semget, (keys["sem"], 1, IPC_CREAT | 0o666)),
                             ("shm_private", shmget, (IPC_PRIVATE, 8192, IPC_CREAT | 0o600))):
        ident = call(*args)
        out[name] = f"ok: {ident}" if ident >= 0 else errname(ctypes.get_errno())
    lib = mq_lib()
    if lib is None:
        out["mq"] = "no mq_open"
    else:
        lib.mq_open.restype = ctypes.c_int
        mqd = lib.mq_open(f"/tqadv-{base}".encode(), os.O_CREAT | os.O_RDWR, 0o666, None)
        out["mq"] = f"ok: {mqd}" if mqd >= 0 else errname(ctypes.get_errno())
    return out


def ipc_seen(base: int) -> dict[str, str]:
    shmget, msgget, semget = ipc_calls()
    keys = ipc_keys(base)
    seen = {"shm": shmget(keys["shm"], 0, 0), "msg": msgget(keys["msg"], 0), "sem": semget(keys["sem"], 0, 0)}
    out = {k: ("FOUND" if v >= 0 else errname(ctypes.get_errno())) for k, v in seen.items()}
    lib = mq_lib()
    if lib is not None:
        lib.mq_open.restype = ctypes.c_int
        mqd = lib.mq_open(f"/tqadv-{base}".encode(), os.O_RDONLY, 0, None)
        out["mq"] = "FOUND" if mqd >= 0 else errname(ctypes.get_errno())
    for table in ("shm", "msg", "sem"):
        with contextlib.suppress(OSError):
            with open(f"/proc/sysvipc/{table}") as fh:
                rows = fh.read().splitlines()[1:]
            if rows:
                out[f"/proc/sysvipc/{table}"] = f"FOUND {len(rows)} rows"
    return out


@tenantq.handler("adv.leave", timeout=20, memory_mb=256)
def leave(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    tag, base = payload["tag"], int(payload["ipc_key"])
    what = payload.get("what", ["files", "ipc", "state", "processes"])
    out: dict[str, Any] = {"pid": os.getpid()}
    if "files" in what:
        out["files"] = _files(tag)
    if "ipc" in what:
        out["ipc"] = _ipc(base)
    if "processes" in what:
        out["processes"] = _spawn_orphans(tag)
        # wait until the leftovers are up before the job ends
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len([p for p in others() if "tqadv" in describe_pid(p)]) < 3:
            time.sleep(0.02)
    out["alive_at_end"] = [describe_pid(p) for p in others()]
    if "state" not in what:
        return out
    # state in this process: none of it may reach a later job (rule C2)
    STATE["pristine"] = False
    STATE["left_by"] = ctx.job_id
    os.environ["TQADV_LEFT"] = tag
    from tenantq.guest import jobs, protocol

    protocol.encode = lambda value: b"%010d\n" % 2 + b"{}"  # type: ignore[assignment]
    jobs.encode = protocol.encode  # type: ignore[attr-defined]
    random.seed(1234)
    # the patched encode above would eat this result: hand it over ourselves
    body = json.dumps({"ok": True, "result": out}).encode()
    protocol.write_all(RESULT_FD, b"%010d\n" % len(body) + body)
    os._exit(0)


@tenantq.handler("adv.look", timeout=20, memory_mb=256)
def look(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    tag, base = payload["tag"], int(payload["ipc_key"])
    abstract: list[str] = []
    with contextlib.suppress(OSError):
        with open("/proc/net/unix") as fh:
            abstract = [line.split()[-1] for line in fh if tag in line]
    return {"scratch": {d: walk(d) for d in (*SCRATCH_DIRS, os.getcwd()) if os.path.isdir(d)},
            "others": [describe_pid(p) for p in others()], "ipc": ipc_seen(base),
            "abstract_sockets": abstract,
            "state": dict(STATE), "environ_left": os.environ.get("TQADV_LEFT"),
            "random": random.random(), "ppid": os.getppid(), "attempt": ctx.attempt}
