"""Unix sockets the host listens on for a sandbox (its egress proxy, its
host functions, a second client of its agent)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path


def bound_socket(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, however long the path: a socket
    address holds at most 107 bytes, so it is bound through a short
    /proc/self/fd/N/NAME alias of its directory."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.name, dir_fd=dir_fd)
        sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")
        os.chmod(path.name, 0o666, dir_fd=dir_fd)  # the parent dir is what keeps other users out
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(dir_fd)
    sock.listen(128)
    sock.setblocking(False)
    return sock
