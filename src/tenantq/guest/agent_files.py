"""The sandbox agent's file operations. Stdlib only (runs inside the sandbox).

They run here, inside the sandbox, as the sandbox's own user, so the host
never opens a path the guest can change (docs/security.md, rule H1): it
only sends a request and reads a bounded reply frame (rule H3). Each
reply's data is at most CHUNK_BYTES (base64 in the frame), so a file of
any size crosses in frames the host's reader bounds.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import stat
from typing import Any

# raw bytes per read/write frame (base64 makes it 4/3 of this: well under
# the 1 MiB + 64 KiB frame limit)
CHUNK_BYTES = 512 << 10
# a listing's reply stays under this many bytes of names
LIST_BUDGET_BYTES = 600 << 10


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _absolute(request: dict[str, Any]) -> str:
    path = request.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"path must be absolute: {path!r}")
    return path


def write(request: dict[str, Any]) -> dict[str, Any]:
    path = _absolute(request)
    data = base64.b64decode(str(request.get("data", "")))
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("append") else os.O_TRUNC)
    # O_NONBLOCK: a FIFO planted at the path must not hang the agent (it
    # would stop serving, and stop enforcing the TTL); only regular files
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(22, "not a regular file", path)
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return {"written": len(data)}


def read(request: dict[str, Any]) -> dict[str, Any]:
    path = _absolute(request)
    offset = max(0, int(request.get("offset", 0)))
    length = min(CHUNK_BYTES, max(0, int(request.get("length", CHUNK_BYTES))))
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO opens at once
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(21, "Is a directory", path)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(22, "not a regular file", path)
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    return {"data": base64.b64encode(data).decode(), "size": info.st_size}


def listing(request: dict[str, Any]) -> dict[str, Any]:
    path = _absolute(request)
    entries: list[dict[str, Any]] = []
    budget, truncated = LIST_BUDGET_BYTES, False
    with os.scandir(path) as scan:
        for entry in scan:
            budget -= len(entry.name) + 64
            if budget < 0:
                truncated = True
                break
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                entries.append({"name": entry.name, "type": _kind(info.st_mode), "size": info.st_size})
    entries.sort(key=lambda e: str(e["name"]))
    return {"entries": entries, "truncated": truncated}


def exists(request: dict[str, Any]) -> dict[str, Any]:
    return {"exists": os.path.lexists(_absolute(request))}


def remove(request: dict[str, Any]) -> dict[str, Any]:
    path = _absolute(request)
    info = os.lstat(path)
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path)  # never follows a symlink inside
    else:
        os.unlink(path)
    return {"removed": True}


def make_dir(request: dict[str, Any]) -> dict[str, Any]:
    path = _absolute(request)
    if os.path.isdir(path):
        return {"created": False}
    os.makedirs(path)
    return {"created": True}


OPERATIONS = {"write": write, "read": read, "list": listing, "exists": exists, "remove": remove,
              "make_dir": make_dir}


def handle(request: dict[str, Any]) -> dict[str, Any]:
    """One file operation's reply: its result, or ok=false with the error's
    class and message (the host raises the matching exception)."""
    operation = OPERATIONS.get(str(request.get("fs")))
    if operation is None:
        return {"ok": False, "error_type": "ValueError",
                "error": f"unknown file operation {request.get('fs')!r}"}
    try:
        return {"ok": True, **operation(request)}
    # RecursionError: a 1,500-deep tree to remove or make is an error, not a crash
    except (OSError, ValueError, TypeError, RecursionError) as exc:
        return {"ok": False, "error_type": type(exc).__name__, "error": str(exc)[:1000]}
