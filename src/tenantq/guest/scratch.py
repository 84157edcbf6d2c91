"""Scratch space a job may leave behind, removed before every job runs. Stdlib only.

Runs in the fresh job process, as the job's uid, after the supervisor has
killed every process of the previous job: nothing can race it. A kept-warm
sandbox therefore shows each job an empty work dir, /tmp and /dev/shm and
no System V IPC objects of an earlier job (docs/security.md, rule P1).
"""

from __future__ import annotations

import contextlib
import os
import shutil
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
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _libc() -> Any:
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


# loaded once in the warm parent (which imports this module at boot), not per job
_LIBC = _libc()


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
