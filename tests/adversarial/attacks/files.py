"""Rule H1 (symlinks, FIFOs, sockets under every name, swapped in a loop), rule P1's cleaner
against hostile scratch contents, and H3's disk quotas."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
from typing import Any

import tenantq
from tests.adversarial.attacks.tools import (
    HOST_NAMES,
    WORK,
    attempt,
    errname,
    head,
    mount_points,
    statvfs,
)

# -- H1: symlinks, FIFOs and sockets under every name the host might use -------------


class Planter:
    KINDS = ("link-marker", "fifo", "link-zero", "socket", "file", "link-victim", "fifo-noreader",
             "link-up", "link-loop", "link-urandom", "dir", "link-proc")

    def __init__(self, marker: str, victim: str) -> None:
        self.targets = {"link-marker": marker, "link-victim": victim, "link-zero": "/dev/zero",
                        "link-urandom": "/dev/urandom", "link-up": "../" * 24 + marker.lstrip("/"),
                        "link-proc": "/proc/1/fd/1"}
        self.readers: list[int] = []
        self.sockets: list[socket.socket] = []
        self.files: dict[str, int] = {}
        self.made = 0
        self.errors: dict[str, int] = {}

    def make(self, path: str, kind: str) -> None:
        if kind == "link-loop":
            os.symlink(os.path.basename(path), path)
        elif kind.startswith("link-"):
            os.symlink(self.targets[kind], path)
        elif kind.startswith("fifo"):
            os.mkfifo(path, 0o666)
            if kind == "fifo" and len(self.readers) < 300:
                self.readers.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        elif kind == "socket":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            sock.listen(16)
            sock.setblocking(False)
            if len(self.sockets) < 300:
                self.sockets.append(sock)
            else:
                sock.close()
        elif kind == "file":
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            self.files[path] = os.fstat(fd).st_ino
            os.close(fd)
        elif kind == "dir":
            os.mkdir(path, 0o777)

    def place(self, path: str, kind: str) -> None:
        """Put a `kind` object at `path`, atomically replacing what is there."""
        staging = f"{path}.{random.getrandbits(40):x}.swap"
        try:
            self.make(staging, kind)
        except OSError as exc:
            key = f"{kind}: {errname(exc.errno or 0)}"
            self.errors[key] = self.errors.get(key, 0) + 1
            return
        try:
            os.replace(staging, path)
        except OSError:
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                else:
                    os.unlink(path)
            try:
                os.replace(staging, path)
            except OSError as exc:
                key = f"replace: {errname(exc.errno or 0)}"
                self.errors[key] = self.errors.get(key, 0) + 1
                with contextlib.suppress(OSError):
                    if kind == "dir":
                        os.rmdir(staging)
                    else:
                        os.unlink(staging)
                return
        self.made += 1

    def harvest(self) -> dict[str, Any]:
        """Anything the host did to what was planted: bytes written into a
        FIFO, connections to a socket, content in an empty file."""
        fifo_bytes = 0
        for fd in self.readers:
            with contextlib.suppress(OSError):
                while chunk := os.read(fd, 65536):
                    fifo_bytes += len(chunk)
        connections = 0
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = sock.accept()
                    connections += 1
                    conn.close()
        changed = []
        for path, inode in self.files.items():
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if st.st_ino == inode and st.st_size:
                    changed.append(f"{path}: {st.st_size} bytes")
        return {"fifo_bytes": fifo_bytes, "socket_connections": connections, "files_written": changed}


def plant_dirs() -> list[str]:
    dirs = [WORK, "/tmp", "/dev/shm", os.getcwd(), "/tenantq", "/tenantq/egress", "/dev/mqueue", "/"]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i] and os.path.isdir(d)]


@tenantq.handler("adv.plant", timeout=20, memory_mb=256)
def plant(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    marker, victim, seconds = payload["marker"], payload["victim"], float(payload.get("seconds", 2.0))
    planter = Planter(marker, victim)
    dirs = plant_dirs()
    paths = [os.path.join(d, name) for d in dirs for name in HOST_NAMES]
    for index, path in enumerate(paths):
        planter.place(path, Planter.KINDS[index % len(Planter.KINDS)])
    reads = {p: attempt(lambda p=p: head(p)) for p in
             (marker, victim, f"/proc/1/root{marker}", f"/proc/self/root{marker}", f"/proc/1/cwd{marker}")}

    def swap(until: float, offset: int) -> None:
        turn = offset
        while time.monotonic() < until:
            for index, path in enumerate(paths):
                planter.place(path, Planter.KINDS[(index + turn) % len(Planter.KINDS)])
            turn += 1

    # a child keeps swapping after this job returned: it races whatever the
    # host does at job end, batch end and destroy, until it is killed
    if os.fork() == 0:
        with contextlib.suppress(BaseException):
            swap(time.monotonic() + 120, 5)
        os._exit(0)
    stop = time.monotonic() + seconds
    racer = threading.Thread(target=swap, args=(stop, 1), daemon=True)
    racer.start()
    racer.join()
    seen = planter.harvest()
    return {"dirs": dirs, "planted": planter.made, "errors": planter.errors, "reads": reads, **seen,
            "listing": {d: sorted(os.listdir(d))[:10] for d in dirs if d in (WORK, "/tmp")}}


def _deep_tree(directory: str, depth: int) -> int:
    """A chain of `depth` directories, built through dir fds (no PATH_MAX)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    made = 0
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
            made += 1
    finally:
        os.close(fd)
    return made


def _locked_dirs(directory: str) -> None:
    for name, mode in (("locked-000", 0o000), ("locked-500", 0o500), ("locked-100", 0o100)):
        path = os.path.join(directory, name)
        os.makedirs(os.path.join(path, "inner"), exist_ok=True)
        for file in (os.path.join(path, "inner", "secret"), os.path.join(path, "file")):
            with open(file, "w") as fh:
                fh.write("x")
        os.chmod(os.path.join(path, "inner"), mode)
        os.chmod(path, mode)


def _odd_names(directory: str) -> None:
    for name in (b"\xff\xfe-not-utf8", b"-dash", b"\n", b" ", b"...x"):
        with open(os.path.join(os.fsencode(directory), name), "wb"):
            pass
    os.symlink("loop", os.path.join(directory, "loop"))


def _many_files(directory: str, count: int) -> int:
    os.mkdir(os.path.join(directory, "many"))
    for i in range(count):
        with open(os.path.join(directory, "many", str(i)), "wb"):
            pass
    return count


@tenantq.handler("adv.poison_scratch", timeout=30, memory_mb=256)
def poison_scratch(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, str]:
    """Scratch contents made to defeat a cleaner: a tree deeper than
    Python's recursion limit, directories the owner cannot list or write,
    thousands of files, names that are not UTF-8, a symlink loop."""
    depth, many = int(payload.get("depth", 2500)), int(payload.get("files", 3000))
    what = payload.get("what", ["deep", "locked", "odd", "many"])
    out: dict[str, str] = {"pid": str(os.getpid())}
    for directory in ("/tmp", WORK, "/dev/shm"):
        if "deep" in what:
            out[f"{directory} deep"] = attempt(lambda d=directory: _deep_tree(d, depth))
        if "locked" in what:
            out[f"{directory} locked"] = attempt(lambda d=directory: _locked_dirs(d))
        if "odd" in what:
            out[f"{directory} odd"] = attempt(lambda d=directory: _odd_names(d))
    if "many" in what:
        out["/tmp many"] = attempt(lambda: _many_files("/tmp", many))
    return out


@tenantq.handler("adv.disk", timeout=60, memory_mb=128)
def disk(payload: dict[str, Any], ctx: tenantq.JobContext) -> dict[str, Any]:
    out: dict[str, Any] = {"statvfs": {m: statvfs(m) for m in mount_points()}}
    chunk = b"\xa5" * (1 << 20)
    for directory, cap in ((WORK, 2 << 30), ("/tmp", 1 << 30), ("/dev/shm", 256 << 20)):
        path = os.path.join(directory, "fill")
        written, error = 0, "none (cap reached)"
        try:
            with open(path, "wb", buffering=0) as fh:
                while written < cap:
                    written += fh.write(chunk)
        except OSError as exc:
            error = errname(exc.errno or 0)
        out[directory] = {"written": written, "error": error, "statvfs_full": statvfs(directory)}
        with contextlib.suppress(OSError):
            os.unlink(path)

        def sparse(directory: str = directory) -> int:
            with open(os.path.join(directory, "sparse"), "wb") as fh:
                fh.truncate(1 << 40)
                fh.seek((1 << 40) - 1)
                fh.write(b"z")
            return os.stat(os.path.join(directory, "sparse")).st_size

        out[directory]["sparse_1t"] = attempt(sparse)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, "sparse"))
    out["host_shm_marker_visible"] = os.path.exists(os.path.join("/dev/shm", payload["host_shm_name"]))
    out["dev_shm"] = sorted(os.listdir("/dev/shm"))[:20] if os.path.isdir("/dev/shm") else "absent"
    return out
