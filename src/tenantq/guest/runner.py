"""The guest runner: the sandbox's long-lived parent (its init). Stdlib only.

    python -I -S runner.py BOOT_JSON

Boot: put the app's code on sys.path, import the app (which registers its
handlers), run its warmups, make itself non-dumpable, then say
`{"status": "ready"}` on the control channel (stdout, frames: see
guest/protocol.py) and block reading stdin. This warm, idle parent is what a
template snapshot captures and what a kept-warm sandbox keeps between batches.

Each batch starts with `{"op": "batch", ...}`: the parent forks the batch
supervisor (guest/supervisor.py), which reads the secrets frame and the
jobs; the parent never reads the secrets, so neither it nor any snapshot of
it holds them. When the supervisor is gone (done, killed, or past the batch
TTL) the parent kills every process of the batch and says `batch_end`. Each
job empties /tmp and the work dir before it runs, so batch k+1 (and job k+1)
start from the parent's pristine memory and empty scratch space.

Stdin EOF means the dispatcher is gone: the parent kills the batch and exits,
which ends the sandbox.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys
import time
from typing import Any

FATAL_EXIT = 3


def boot(config: dict[str, Any]) -> None:
    # Started with -I -S: no site module, so none of the interpreter's own
    # site-packages and no .pth processing (that alone costs ~0.35 s under
    # gVisor). The app's code and its dependencies are put on sys.path here.
    for entry in reversed([*config.get("sys_path", []), *config.get("site_dirs", [])]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    from tenantq.guest.jobs import describe
    from tenantq.guest.supervisor import say

    try:
        from tenantq.registry import REGISTRY

        importlib.import_module(config["app"])
    except BaseException as exc:
        say({"status": "fatal", "error": f"cannot import app {config['app']!r}: {describe(exc)}"[:3000]})
        sys.exit(FATAL_EXIT)
    name = ""
    try:
        for name in REGISTRY.warmups():
            REGISTRY.resolve_warmup(name)()
    except BaseException as exc:
        say({"status": "fatal", "error": f"warmup {name!r} failed: {describe(exc)}"[:3000]})
        sys.exit(FATAL_EXIT)


def _run_batch(stdin: Any, command: dict[str, Any], wake_r: int) -> dict[str, Any]:
    from tenantq.guest.supervisor import EOF_EXIT, Supervisor, kill_others

    ttl = float(command.get("ttl", 60))
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            # its own wake-up pipe: reading the parent's would steal the
            # parent's SIGCHLD wake-ups
            os.close(wake_r)
            own_r, own_w = os.pipe()
            os.set_blocking(own_r, False)
            os.set_blocking(own_w, False)
            signal.set_wakeup_fd(own_w, warn_on_full_buffer=False)
            code = Supervisor(stdin, command, own_r).serve()
        except BaseException:
            # the supervisor's own failure, for the host's stderr tail (bounded, H3)
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    end = _supervise(pid, ttl, wake_r)
    if end.get("exit") not in (0, EOF_EXIT):
        print(f"tenantq runner: the batch supervisor (pid {pid}) ended: {end}", file=sys.stderr, flush=True)
    kill_others()
    if end.get("exit") == EOF_EXIT:
        os._exit(0)  # the dispatcher is gone, and so is this sandbox
    return end


def _supervise(pid: int, ttl: float, wake_r: int) -> dict[str, Any]:
    from tenantq.guest.supervisor import reap

    deadline = time.monotonic() + ttl
    while True:
        status = reap(pid)
        if status is not None:
            if os.WIFSIGNALED(status):
                return {"status": "batch_end", "signal": os.WTERMSIG(status)}
            return {"status": "batch_end", "exit": os.waitstatus_to_exitcode(status)}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _kill(pid)
            return {"status": "batch_end", "timeout": ttl}
        readable, _, _ = select.select([wake_r], [], [], remaining)
        if wake_r in readable:
            os.read(wake_r, 4096)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def serve(config: dict[str, Any]) -> int:
    boot(config)
    from tenantq.guest import scratch
    from tenantq.guest.protocol import FrameError, FrameFile
    from tenantq.guest.supervisor import say, set_no_dump

    scratch.KEEP_IN_TMP.update(config.get("keep_tmp", []))
    set_no_dump()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    stdin = FrameFile(0)
    say({"status": "ready", "pid": os.getpid()})
    while True:
        # Blocks without a timeout: a snapshot taken here restores into the
        # same read, now on the restoring process's stdin (no clock to skew).
        try:
            command = stdin.read()
        except FrameError:
            return 2
        if command is None:
            return 0
        if command.get("op") == "cancel":
            continue  # for a job of the batch that just ended (the supervisor does the same between jobs)
        if command.get("op") != "batch":
            return 2
        say(_run_batch(stdin, command, wake_r))


if __name__ == "__main__":
    import json

    sys.exit(serve(json.loads(sys.argv[1])))
