"""The guest runner: the sandbox's long-lived parent. Stdlib only.

    python -I -S runner.py BOOT_JSON

Boot: put the app's code on sys.path, import the app (which registers its
handlers), run its warmups, then write `{"status": "ready"}` to stdout and
block reading stdin. This warm, idle parent is what a template snapshot
captures, and what a kept-warm sandbox keeps between batches.

Each batch arrives on stdin as two frames (`%010d\\n` length + JSON): a
command `{"ttl": seconds}` the parent reads, then the tenant's secrets, which
only the forked batch child reads, so the parent (and any snapshot of it)
never holds them. The child reseeds everything a restore or fork would
duplicate, runs the jobs (guest/jobs.py) and exits; the parent waits for it
(event-driven: SIGCHLD on a wakeup fd, stdin EOF), kills whatever the batch
left running, empties /tmp and appends `{"status": "batch_end", ...}` to the
work dir's results file. Batch k+1 therefore starts from the parent's
pristine memory, an emptied /tmp and (the host empties it) a fresh work dir.

Stdin EOF means the dispatcher is gone (its end of the pipe closed): the
parent kills the running batch and exits, which ends the sandbox. Each batch
also carries a TTL enforced by both the child (a watchdog thread) and the
parent; the host reaper is the last backstop.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import sys
import time
from typing import Any

HEADER_BYTES = 11  # b"%010d\n"
WORK_DIR = "/tenantq/work"
TMP_DIR = "/tmp"
FATAL_EXIT = 3


class Frames:
    """Length-prefixed frames from a file descriptor (no readline: a byte at a
    time costs one system call each, which gVisor makes expensive)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def _exactly(self, count: int) -> bytes | None:
        chunks: list[bytes] = []
        while count:
            chunk = os.read(self.fd, count)
            if not chunk:
                return None
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    def read(self) -> Any | None:
        """The next frame's JSON value, or None at EOF."""
        header = self._exactly(HEADER_BYTES)
        if header is None:
            return None
        body = self._exactly(int(header))
        return None if body is None else json.loads(body)


def _say(record: dict[str, Any]) -> None:
    os.write(1, (json.dumps(record, default=repr) + "\n").encode())


def boot(config: dict[str, Any]) -> None:
    # Started with -I -S: no site module, so none of the interpreter's own
    # site-packages and no .pth processing (that alone costs ~0.35 s under
    # gVisor). The app's code and its dependencies are put on sys.path here.
    for entry in reversed([*config.get("sys_path", []), *config.get("site_dirs", [])]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    from tenantq.guest.jobs import describe

    try:
        from tenantq.registry import REGISTRY

        importlib.import_module(config["app"])
    except BaseException as exc:
        _say({"status": "fatal", "error": f"cannot import app {config['app']!r}: {describe(exc)}"[:3000]})
        sys.exit(FATAL_EXIT)
    try:
        for name in REGISTRY.warmups():
            REGISTRY.resolve_warmup(name)()
    except BaseException as exc:
        _say({"status": "fatal", "error": f"warmup {name!r} failed: {describe(exc)}"[:3000]})
        sys.exit(FATAL_EXIT)


def _reseed() -> None:
    """A restored image and a fork both duplicate the parent's PRNG states:
    give this batch its own (os.urandom differs per restore and per fork)."""
    import random

    random.seed()
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile._name_sequence = None  # type: ignore[attr-defined]


def _child(stdin: Frames, ttl: float, ready_w: int) -> int:
    """The batch child: read the secrets, tell the parent, run the jobs."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    secrets = {str(k): str(v) for k, v in (stdin.read() or {}).items()}
    os.close(ready_w)  # the parent may watch stdin again: the secrets are consumed
    os.environ.update(secrets)
    _reseed()
    _start_watchdog(ttl)
    os.chdir(WORK_DIR)
    from tenantq.guest import egress
    from tenantq.guest.jobs import run_jobs

    proxied = egress.install() is not None

    return run_jobs(WORK_DIR, secrets, sync_starts=proxied)


def _start_watchdog(seconds: float) -> None:
    """End this process at the deadline even if a job ignores every signal
    (a thread, started after the fork: threads do not survive fork)."""
    import threading

    exit_now = os._exit  # bound before any tenant code runs

    def expire() -> None:
        time.sleep(seconds)
        exit_now(137)

    threading.Thread(target=expire, name="ttl", daemon=True).start()


def _run_batch(stdin: Frames, ttl: float, wake_r: int) -> dict[str, Any]:
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        code = 70
        try:
            code = _child(stdin, ttl, ready_w)
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(ready_w)
    os.read(ready_r, 1)  # EOF once the child has the secrets (or died)
    os.close(ready_r)
    end = _supervise(pid, ttl, wake_r)
    _clean_up()
    return end


def _supervise(pid: int, ttl: float, wake_r: int) -> dict[str, Any]:
    deadline = time.monotonic() + ttl
    watched = [0]
    while True:
        status = _reap(pid)
        if status is not None:
            if os.WIFSIGNALED(status):
                return {"status": "batch_end", "signal": os.WTERMSIG(status)}
            return {"status": "batch_end", "exit": os.waitstatus_to_exitcode(status)}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _kill(pid)
            return {"status": "batch_end", "timeout": ttl}
        readable, _, _ = select.select([wake_r, *watched], [], [], remaining)
        if wake_r in readable:
            os.read(wake_r, 4096)
        if 0 in readable:
            if _pending_bytes(0) == 0:
                # EOF: the dispatcher is gone, and so is this sandbox
                _kill(pid)
                _clean_up()
                os._exit(0)
            # data before batch_end is the host's next frame: leave it for
            # the next read and stop watching stdin for this batch
            watched = []


def _pending_bytes(fd: int) -> int:
    import fcntl
    import termios

    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return int.from_bytes(buf, sys.byteorder)


def _reap(pid: int) -> int | None:
    """Reap every exited child (as the container's init, orphans are ours
    too); return `pid`'s wait status once it has exited."""
    found: int | None = None
    while True:
        try:
            child, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if child == 0:
            return found
        if child == pid:
            found = status


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


KEEP_IN_TMP: set[str] = set()


def _clean_up() -> None:
    """Nothing of a batch outlives it: kill every other process this uid can
    signal (all but init and the parent) and empty /tmp (but for the mount
    points of read-only code that lives under the host's /tmp)."""
    import shutil

    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    for name in os.listdir(TMP_DIR):
        if name in KEEP_IN_TMP:
            continue
        path = os.path.join(TMP_DIR, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def serve(config: dict[str, Any]) -> int:
    boot(config)
    KEEP_IN_TMP.update(config.get("keep_tmp", []))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    stdin = Frames(0)
    _say({"status": "ready", "pid": os.getpid()})
    while True:
        # Blocks without a timeout: a snapshot taken here restores into the
        # same read, now on the restoring process's stdin (no clock to skew).
        command = stdin.read()
        if command is None:
            return 0
        end = _run_batch(stdin, float(command["ttl"]), wake_r)
        with open(os.path.join(WORK_DIR, "results.jsonl"), "a") as out:
            out.write(json.dumps(end) + "\n")


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
