"""`sbx.filesystem`: files at any absolute path inside a Sandbox API sandbox.

Every operation is done inside the sandbox by its agent, as the sandbox's
own user; the host sends a request and reads a bounded reply, so it never
opens, follows or stats a path the guest can change (docs/security.md,
rule H1), and a read costs it at most `max_bytes` (rule H3).
"""

from __future__ import annotations

import base64
import builtins
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tenantq.errors import InvalidInput

if TYPE_CHECKING:
    from tenantq.sandbox.core import SandboxCore

CHUNK_BYTES = 512 << 10  # guest/agent_files.py sends at most this per reply
DEFAULT_READ_MAX_BYTES = 64 << 20
# how long a file request waits for the agent's reply (per chunk of at most
# CHUNK_BYTES): a command that reads the agent's own stdin through
# /proc/1/fd/0 can take a request before the agent does (the guest is
# hostile, rule S1), and the host's call then ends in TimeoutError after
# this long, never later (the adversarial forge suite waits 40 s)
REQUEST_SECONDS = 30.0
ERRORS: dict[str, type[OSError]] = {
    "FileNotFoundError": FileNotFoundError, "IsADirectoryError": IsADirectoryError,
    "NotADirectoryError": NotADirectoryError, "PermissionError": PermissionError,
    "FileExistsError": FileExistsError,
}


@dataclass(frozen=True)
class EntryInfo:
    name: str
    path: str
    type: str  # "file", "dir", "symlink" or "other"
    size: int


def _path(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidInput(f"sandbox path must be an absolute path without NUL bytes, got {path!r}")
    return path


class Filesystem:
    def __init__(self, sandbox: SandboxCore) -> None:
        self._sandbox = sandbox

    def _call(self, operation: str, path: str, **fields: Any) -> dict[str, Any]:
        reply = self._sandbox.link().request({"op": "fs", "fs": operation, "path": _path(path), **fields},
                                             REQUEST_SECONDS)
        if reply.get("ok") is True:
            return reply
        message = f"{operation} {path}: {str(reply.get('error'))[:300]}"
        error_type = ERRORS.get(str(reply.get("error_type")), OSError)
        raise error_type(message)

    def write(self, path: str, data: bytes | str) -> int:
        """Write (create or replace) a file, making its parent directories;
        returns the bytes written."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        offset = 0
        while True:
            chunk = raw[offset:offset + CHUNK_BYTES]
            self._call("write", path, data=base64.b64encode(chunk).decode(), append=offset > 0)
            offset += len(chunk)
            if offset >= len(raw):
                return len(raw)

    def read(self, path: str, *, max_bytes: int = DEFAULT_READ_MAX_BYTES) -> bytes:
        """The file's bytes; ValueError past `max_bytes` (the host holds the
        whole file, so it is bounded)."""
        out = bytearray()
        while True:
            reply = self._call("read", path, offset=len(out), length=CHUNK_BYTES)
            size = reply.get("size")
            if isinstance(size, int) and not isinstance(size, bool) and size > max_bytes:
                # refused before it crosses (the size is the guest's word: the
                # count below bounds what it can make the host hold anyway)
                raise ValueError(f"read {path}: {size} bytes, larger than max_bytes={max_bytes}")
            chunk = base64.b64decode(str(reply.get("data", "")), validate=True)
            if len(chunk) > CHUNK_BYTES:
                raise ValueError(f"read {path}: the sandbox sent more than it was asked for")
            out += chunk
            if len(out) > max_bytes:
                raise ValueError(f"read {path}: larger than max_bytes={max_bytes}")
            if len(chunk) < CHUNK_BYTES:
                return bytes(out)

    def read_text(self, path: str, *, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def list(self, path: str) -> builtins.list[EntryInfo]:
        """The directory's entries (not recursive; symlinks not followed)."""
        reply = self._call("list", path)
        base = path.rstrip("/") or ""
        entries = []
        for entry in builtins.list(reply.get("entries") or [])[:100_000]:
            name = str(entry.get("name"))
            size = entry.get("size")
            size = size if isinstance(size, int) and not isinstance(size, bool) else 0
            kind = str(entry.get("type"))
            entries.append(EntryInfo(name=name, path=f"{base}/{name}", type=kind, size=size))
        return entries

    def exists(self, path: str) -> bool:
        return bool(self._call("exists", path).get("exists"))

    def remove(self, path: str) -> None:
        """Remove a file, or a directory with everything in it."""
        self._call("remove", path)

    def make_dir(self, path: str) -> bool:
        """Make a directory and its parents; False when it already existed."""
        return bool(self._call("make_dir", path).get("created"))
