"""Scratch space a job may leave behind, removed before every job runs. Stdlib only.

Runs in the fresh job process, as the job's uid, after the supervisor has
killed every process of the previous job: nothing can race it. A kept-warm
sandbox therefore shows each job an empty work dir, /tmp and /dev/shm and
no System V IPC objects of an earlier job (docs/security.md, rule P1).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

WORK_DIR = "/tenantq/work"
SCRATCH_DIRS = (WORK_DIR, "/tmp", "/dev/shm", "/dev/mqueue")
# mount points (absolute paths) of read-only code that lives under the
# host's /tmp: the directories leading to them stay, all else in them goes
KEEP_IN_TMP: set[str] = set()
_IPC = ((14, 13), (12, 11), (19, 18))  # (INFO, STAT) for shm, msg, sem
_IPC_RMID = 0


def _empty(directory: str, keep: set[str]) -> None:
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        if path in keep:
            continue
        if any(k.startswith(path + "/") for k in keep):
            _empty(path, keep)  # a directory on the way to a mount point
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            remove_tree(directory, name)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def remove_tree(parent: str, name: str) -> None:
    """Remove parent/name however the job built it: any depth (one open
    descriptor at a time and names relative to it: no recursion, no path
    length limit) and any mode (each directory is made 0700 first; the
    job's uid owns what the job made). Nothing else runs as this uid while
    it works, so walking back up through ".." cannot be raced."""
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    stack = [name]  # stack[-1]: the child of fd being emptied
    stuck: set[int] = set()  # inodes of directories that cannot be removed
    try:
        while stack:
            child = stack[-1]
            with contextlib.suppress(OSError):
                os.chmod(child, 0o700, dir_fd=fd)
            try:
                inner = os.open(child, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(child, dir_fd=fd)
                stack.pop()
                if stack:
                    fd = _up(fd)
                continue
            sub = _empty_files_and_find_a_dir(inner, stuck)
            if sub is not None:
                os.close(fd)
                fd = inner
                stack.append(sub)
                continue
            inode = os.fstat(inner).st_ino
            os.close(inner)
            try:
                os.rmdir(child, dir_fd=fd)
            except OSError:
                stuck.add(inode)  # e.g. holds a file of another uid: leave it
            stack.pop()
            if stack:
                fd = _up(fd)
    finally:
        os.close(fd)


def _up(fd: int) -> int:
    parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    return parent


def _empty_files_and_find_a_dir(fd: int, stuck: set[int]) -> str | None:
    """Unlink every non-directory in fd; the name of one directory left to
    empty, if any."""
    found: str | None = None
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if found is None and entry.inode() not in stuck:
                    found = entry.name
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.name, dir_fd=fd)
    return found


def _libc() -> Any:
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


# loaded once in the warm parent (which imports this module at boot), not per job
_LIBC = _libc()


def new_ipc_namespace() -> bool:
    """unshare(CLONE_NEWIPC): False where not permitted."""
    return _LIBC is not None and _LIBC.unshare(0x08000000) == 0


def _remove_ipc() -> None:
    """System V shared memory, message queues and semaphores outlive their
    processes: remove every one this uid may (there are none normally)."""
    import ctypes

    libc = _LIBC
    if libc is None:
        return
    buf = ctypes.create_string_buffer(512)
    calls = (libc.shmctl, libc.msgctl, libc.semctl)
    for call, (info, stat) in zip(calls, _IPC, strict=True):
        args = (0, info, buf) if call is not libc.semctl else (0, 0, info, buf)
        highest = call(*args)
        for index in range(max(highest, -1) + 1):
            stat_args = (index, stat, buf) if call is not libc.semctl else (index, 0, stat, buf)
            ident = call(*stat_args)
            if ident >= 0:
                rm_args = (ident, _IPC_RMID, None) if call is not libc.semctl else (ident, 0, _IPC_RMID)
                call(*rm_args)


def clean() -> None:
    keep = set(KEEP_IN_TMP)
    for directory in SCRATCH_DIRS:
        _empty(directory, keep)
    _remove_ipc()
