"""The sandbox agent: the init of a sandbox made through the Sandbox API
(`tenantq.Sandbox`). Stdlib only.

It takes frames on stdin and answers on stdout (guest/protocol.py framing):

    {"op": "env", "env": {...}}                 variables (and secrets) for every later exec
    {"op": "exec", "id": n, "argv": [...], "cwd": s|null, "env": {...},
     "stdin": b64|null, "keep_stdin": bool, "cap": bytes}
    {"op": "stdin", "id": n, "data": b64, "eof": bool}
    {"op": "kill", "id": n, "signal": k}        the command's whole process group
    {"op": "fs", "rid": r, "fs": "write"|"read"|"list"|"exists"|"remove"|"make_dir", ...}
    {"op": "quiesce", "rid": r}                 before a checkpoint: flush, reply, then stay silent
    {"op": "resume", "forget": bool}            after the restore: speak again (a fork child
                                                forgets its parent's commands, and reseeds)
    {"op": "egress", "rid": r}                  the host listens on /tenantq/egress/proxy.sock:
                                                forward loopback to it, HTTP(S)_PROXY for later execs
    {"op": "hand_over", "rid": r, "argv": [...], "env": {...}}
                                                the queue's sandboxes: reply, then exec argv in
                                                place (pid 1, on this same channel), so the
                                                guest runner is the sandbox's init from then on

    {"event": "ready", "pid": p}
    {"event": "started", "id": n, "pid": p} | {"event": "exit", "id": n, "error": "..."}
    {"event": "out", "id": n, "fd": 1|2, "data": b64}
    {"event": "exit", "id": n, "status": code (negative: the signal), "dropped": [a, b]}
    {"event": "reply", "rid": r, "ok": ..., ...}

As pid 1 it reaps every orphan and enforces the sandbox's TTL by itself:
it reads the deadline the host writes into a read-only host directory
(`--deadline-file`), and past it kills everything and exits, so the
sandbox ends on time even when no host process is left to end it. The host
does not need to believe any of this: it measures timeouts and OOM itself,
and its reaper removes sandboxes past their deadline (docs/sandbox-api.md).
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import select
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tenantq.guest import agent_files
from tenantq.guest.protocol import HEADER_BYTES, FrameError, decode_body, encode, parse_header

READ_CHUNK = 64 << 10
# queued frames to the host past which the agent stops reading commands'
# output (they block writing) until the host catches up
OUTBOX_LIMIT = 8 << 20
DEADLINE_CHECK_SECONDS = 1.0


def _open_fds() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))


def _inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:
        return False


@dataclass
class Command:
    id: int
    pid: int
    client: Client
    pipes: dict[int, int]  # our read end -> 1 (stdout) or 2 (stderr)
    cap: int
    stdin_fd: int | None
    sent: list[int] = field(default_factory=lambda: [0, 0])
    dropped: list[int] = field(default_factory=lambda: [0, 0])
    pending_stdin: bytearray = field(default_factory=bytearray)
    close_stdin: bool = False
    status: int | None = None


class Client:
    """One host connection: the init's stdin/stdout pipes, or a Unix socket
    the host listens on in the control dir (Sandbox.connect)."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self.inbox = bytearray()
        self.need: int | None = None
        self.outbox = bytearray()
        self.gone = False  # the host's end closed: its commands run on, unwatched
        self.reading = True
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)

    def say(self, record: dict[str, Any]) -> None:
        if not self.gone:
            self.outbox += encode(record)

    def flush(self) -> None:
        while self.outbox and not self.gone:
            try:
                written = os.write(self.write_fd, self.outbox[:1 << 20])
            except BlockingIOError:
                return
            except OSError:
                self.gone = True
                self.outbox.clear()
                return
            del self.outbox[:written]

    def frames(self) -> list[dict[str, Any]]:
        """The frames that arrived; at EOF `reading` turns False."""
        out: list[dict[str, Any]] = []
        while self.reading:
            want = (HEADER_BYTES - len(self.inbox)) if self.need is None else self.need - len(self.inbox)
            try:
                chunk = os.read(self.read_fd, max(1, want))
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.reading = False
                break
            self.inbox += chunk
            if self.need is None:
                if len(self.inbox) < HEADER_BYTES:
                    continue
                self.need = parse_header(bytes(self.inbox))
                self.inbox.clear()
            if len(self.inbox) >= self.need:
                out.append(decode_body(bytes(self.inbox)))
                self.inbox.clear()
                self.need = None
        return out


class Agent:
    def __init__(self, deadline_file: str | None) -> None:
        self.deadline_file = deadline_file
        self.control_dir = os.path.dirname(deadline_file) if deadline_file else None
        self.deadline: float | None = None
        self.next_deadline_check = 0.0
        self.env = dict(os.environ)
        self.egress_url: str | None = None
        self.commands: dict[tuple[int, int], Command] = {}
        self.by_pid: dict[int, Command] = {}
        self.clients: list[Client] = [Client(0, 1)]
        self.joined: set[str] = set()
        # between quiesce and resume nothing is written: a checkpoint then
        # holds the channel at a frame boundary, for the parent and every child
        self.quiet = False
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # the host asks us to look for a new client socket
        signal.signal(signal.SIGUSR1, lambda *_: None)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    # -- the host side ---------------------------------------------------

    def join_clients(self) -> None:
        """Connect to every client socket the host made in the control dir
        (host-owned, read-only here) that we have not joined yet."""
        if self.control_dir is None:
            return
        with contextlib.suppress(OSError):
            for name in os.listdir(self.control_dir):
                if not (name.startswith("client-") and name.endswith(".sock")) or name in self.joined:
                    continue
                self.joined.add(name)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(os.path.join(self.control_dir, name))
                except OSError:
                    sock.close()
                    continue
                fd = sock.detach()
                client = Client(fd, fd)
                client.say({"event": "ready", "pid": os.getpid()})
                self.clients.append(client)

    def dispatch(self, client: Client, frame: dict[str, Any]) -> None:
        op = frame.get("op")
        if op == "exec":
            self.start(client, frame)
        elif op == "stdin":
            self.feed(client, frame)
        elif op == "kill":
            command = self.commands.get((id(client), int(frame.get("id", -1))))
            if command is not None and command.status is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(command.pid, int(frame.get("signal", signal.SIGKILL)))
        elif op == "fs":
            client.say({"event": "reply", "rid": frame.get("rid"), **agent_files.handle(frame)})
        elif op == "env":
            self.env.update({str(k): str(v) for k, v in dict(frame.get("env") or {}).items()})
        elif op == "egress":
            client.say({"event": "reply", "rid": frame.get("rid"), "ok": self.start_egress()})
        elif op == "quiesce":
            client.say({"event": "reply", "rid": frame.get("rid"), "ok": True})
            self.flush_all()
            self.quiet = True
        elif op == "resume":
            self.quiet = False
            if frame.get("forget"):
                self.forget()
        elif op == "hand_over":
            self.hand_over(client, frame)

    def hand_over(self, client: Client, frame: dict[str, Any]) -> None:
        """Become the queue's guest runner (sandbox/api.py, Sandbox.hand_over).

        Only on the init's own channel, with no command running and no other
        client: afterwards nothing of the agent is left to speak for the
        sandbox, and the runner's frames follow the reply on the same pipes
        (the host's reader stops at the reply: a frame boundary). The runner
        keeps pid 1, as when a driver starts it directly: it reaps, and its
        `kill(-1)` of a batch's leftovers spares it (guest/supervisor.py)."""
        argv = [str(a) for a in frame.get("argv") or []]
        running = [c for c in self.commands.values() if c.status is None]
        refusal = ("not on the init's channel" if client is not self.clients[0] or len(self.clients) > 1
                   else "no argv" if not argv or not argv[0].startswith("/")
                   else f"{len(running)} commands still run" if running
                   else "frames arrived after it" if client.inbox or client.need is not None else None)
        if refusal is not None:
            client.say({"event": "reply", "rid": frame.get("rid"), "ok": False, "error": refusal})
            return
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update({str(k): str(v) for k, v in dict(frame.get("env") or {}).items()})
        client.say({"event": "reply", "rid": frame.get("rid"), "ok": True})
        self.flush_all()
        signal.set_wakeup_fd(-1)
        # the runner reads and writes its channel blocking; O_NONBLOCK is the
        # pipes' (shared) state, so it is undone before the exec
        for fd in (0, 1):
            os.set_blocking(fd, True)
        try:
            os.execve(argv[0], argv, env)
        except OSError as exc:
            print(f"tenantq agent: cannot hand over to {argv[0]}: {exc}", file=sys.stderr, flush=True)
            os._exit(127)

    def start_egress(self) -> bool:
        """Once per sandbox (a fork child's forwarder came with its memory and
        reaches the child's own socket: the path is the child's mount)."""
        from tenantq.guest import egress

        if self.egress_url is None:
            self.egress_url = egress.install()
        if self.egress_url is not None:
            self.env.update({n: os.environ[n] for n in egress.PROXY_VARS + egress.CA_VARS if n in os.environ})
            for name in ("NO_PROXY", "no_proxy"):
                self.env.pop(name, None)
        return self.egress_url is not None

    def forget(self) -> None:
        """A fork child: the parent's commands and connections are not ours."""
        random.seed(os.urandom(32))
        for command in list(self.commands.values()):
            for fd in [*command.pipes, command.stdin_fd]:
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        self.commands.clear()
        self.by_pid.clear()
        for client in self.clients[1:]:
            with contextlib.suppress(OSError):
                os.close(client.read_fd)
        del self.clients[1:]

    def flush_all(self) -> None:
        """Write everything queued, waiting for the hosts to read it."""
        while any(c.outbox and not c.gone for c in self.clients):
            select.select([], [c.write_fd for c in self.clients if c.outbox and not c.gone], [], 1.0)
            for client in self.clients:
                client.flush()

    # -- commands ----------------------------------------------------------

    def start(self, client: Client, frame: dict[str, Any]) -> None:
        command_id = int(frame["id"])
        argv = [str(a) for a in frame.get("argv") or []]
        env = {**self.env, **{str(k): str(v) for k, v in dict(frame.get("env") or {}).items()}}
        cwd = frame.get("cwd")
        stdin_data = base64.b64decode(frame["stdin"]) if frame.get("stdin") else b""
        keep_stdin = bool(frame.get("keep_stdin"))
        if not argv:
            client.say({"event": "exit", "id": command_id, "error": "empty command"})
            return
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe()
        pid = self.spawn(argv, env, cwd, in_r, out_w, err_w)
        for fd in (out_w, err_w, in_r):
            os.close(fd)
        for fd in (out_r, err_r, in_w):
            os.set_blocking(fd, False)
        command = Command(command_id, pid, client, {out_r: 1, err_r: 2}, int(frame.get("cap", 1 << 20)), in_w)
        command.pending_stdin += stdin_data
        command.close_stdin = not keep_stdin
        self.commands[(id(client), command_id)] = command
        self.by_pid[pid] = command
        client.say({"event": "started", "id": command_id, "pid": pid})
        self.write_stdin(command)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: object, in_r: int, out_w: int,
              err_w: int) -> int:
        """The command, in its own session (a kill reaches all it starts).
        posix_spawn (a vfork: the agent's memory is not copied, which under
        gVisor's ptrace platform is most of an exec's cost) where it can;
        a fork for a cwd (3.11's posix_spawn has no chdir) or when the spawn
        fails (the child then reports the error as a shell would)."""
        path = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH", os.defpath))
        if path is not None and not cwd:
            # fds the agent holds that a command must not: everything
            # inheritable above 2 (Python opens its own fds close-on-exec)
            keep_out = [fd for fd in _open_fds() if fd > 2 and _inheritable(fd)]
            actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1),
                       (os.POSIX_SPAWN_DUP2, err_w, 2), *((os.POSIX_SPAWN_CLOSE, fd) for fd in keep_out)]
            with contextlib.suppress(OSError):
                return os.posix_spawn(path, argv, env, file_actions=actions, setsid=True,
                                      setsigdef=(signal.SIGPIPE, signal.SIGCHLD))
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                os.closerange(3, 65536)
                signal.signal(signal.SIGPIPE, signal.SIG_DFL)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                if cwd:
                    os.chdir(str(cwd))
                os.execvpe(argv[0], argv, env)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.write(2, f"{argv[0]}: {exc.strerror}\n".encode())
                os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
            finally:
                os._exit(127)
        return pid

    def feed(self, client: Client, frame: dict[str, Any]) -> None:
        command = self.commands.get((id(client), int(frame.get("id", -1))))
        if command is None or command.stdin_fd is None:
            return
        command.pending_stdin += base64.b64decode(str(frame.get("data", "")))
        command.close_stdin = command.close_stdin or bool(frame.get("eof"))
        self.write_stdin(command)

    def write_stdin(self, command: Command) -> None:
        fd = command.stdin_fd
        if fd is None:
            return
        try:
            while command.pending_stdin:
                del command.pending_stdin[:os.write(fd, command.pending_stdin[:1 << 16])]
        except BlockingIOError:
            return
        except OSError:  # the command closed its stdin
            command.pending_stdin.clear()
            command.close_stdin = True
        if command.close_stdin and not command.pending_stdin:
            os.close(fd)
            command.stdin_fd = None

    def read_output(self, fd: int) -> None:
        command = next((c for c in self.commands.values() if fd in c.pipes), None)
        if command is None:
            return
        stream = command.pipes[fd]
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            os.close(fd)
            del command.pipes[fd]
            self.finish(command)
            return
        room = max(0, command.cap - command.sent[stream - 1])
        keep = chunk[:room]
        command.dropped[stream - 1] += len(chunk) - len(keep)
        if keep:
            command.sent[stream - 1] += len(keep)
            data = base64.b64encode(keep).decode()
            command.client.say({"event": "out", "id": command.id, "fd": stream, "data": data})

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            command = self.by_pid.pop(pid, None)
            if command is not None:
                command.status = os.waitstatus_to_exitcode(status)
                # what is in the pipes now is the command's; a background
                # child that keeps them open does not hold the exit back
                for fd in list(command.pipes):
                    self.read_output(fd)
                    if fd in command.pipes:
                        os.close(fd)
                        del command.pipes[fd]
                self.finish(command)

    def finish(self, command: Command) -> None:
        key = (id(command.client), command.id)
        if command.status is None or command.pipes or key not in self.commands:
            return
        if command.stdin_fd is not None:
            os.close(command.stdin_fd)
            command.stdin_fd = None
        del self.commands[key]
        command.client.say({"event": "exit", "id": command.id, "status": command.status,
                            "dropped": command.dropped})

    # -- the TTL -------------------------------------------------------------

    def check_deadline(self) -> None:
        now = time.monotonic()
        if self.deadline_file is None or now < self.next_deadline_check:
            return
        self.next_deadline_check = now + DEADLINE_CHECK_SECONDS
        with contextlib.suppress(OSError, ValueError):
            with open(self.deadline_file) as f:
                self.deadline = float(f.read().strip())
        if self.deadline is not None and time.time() >= self.deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
            os._exit(0)

    def serve(self) -> int:
        self.clients[0].say({"event": "ready", "pid": os.getpid()})
        while True:
            self.check_deadline()
            if self.deadline_file is None and not self.clients[0].reading:
                return 0  # without a deadline file, the agent ends with its one client
            if self.quiet:
                self.serve_quietly()
                continue
            for client in self.clients:
                client.flush()
            # a client whose host end is gone, and whose commands are done, is dropped
            self.clients[1:] = [c for c in self.clients[1:] if c.reading or
                                any(cmd.client is c for cmd in self.commands.values())]
            readable = [self.wake_r, *(c.read_fd for c in self.clients if c.reading)]
            if sum(len(c.outbox) for c in self.clients) < OUTBOX_LIMIT:
                readable += [fd for c in self.commands.values() for fd in c.pipes]
            writable = [c.stdin_fd for c in self.commands.values()
                        if c.stdin_fd is not None and c.pending_stdin]
            writable += [c.write_fd for c in self.clients if c.outbox and not c.gone]
            try:
                ready_r, ready_w, _ = select.select(readable, writable, [], DEADLINE_CHECK_SECONDS)
            except InterruptedError:
                continue
            if self.wake_r in ready_r or not ready_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
                self.join_clients()
            for client in list(self.clients):
                if client.read_fd in ready_r:
                    self.read_client(client)
            for fd in ready_r:
                if fd != self.wake_r and all(fd != c.read_fd for c in self.clients):
                    self.read_output(fd)
            for command in list(self.commands.values()):
                if command.stdin_fd in ready_w:
                    self.write_stdin(command)
            self.reap()

    def read_client(self, client: Client) -> None:
        try:
            for frame in client.frames():
                self.dispatch(client, frame)
        except (FrameError, ValueError, KeyError, TypeError) as exc:
            client.say({"event": "protocol_error", "error": str(exc)[:200]})
            client.reading = False

    def serve_quietly(self) -> None:
        """Between quiesce and resume: read the host's frames, write nothing."""
        first = self.clients[0]
        with contextlib.suppress(InterruptedError):
            select.select([first.read_fd] if first.reading else [], [], [], DEADLINE_CHECK_SECONDS)
        if first.reading:
            self.read_client(first)


def main(argv: list[str]) -> int:
    from tenantq.guest.supervisor import set_no_dump

    # a command of the sandbox's own uid cannot ptrace the agent to keep it
    # from ending the sandbox at its TTL (the host's reaper is the backstop)
    set_no_dump()
    deadline_file = None
    if len(argv) >= 2 and argv[0] == "--deadline-file":
        deadline_file = argv[1]
    return Agent(deadline_file).serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
