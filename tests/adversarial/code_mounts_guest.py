"""The attacker of rule M1, inside a sandbox (docs/security.md: "a sandbox sees
code, never the host's configuration or credentials"). Stdlib only: it is
copied into the throwaway project as its `hunt` module (the queue's handler
imports it) and run as `python3 -c` in Sandbox API sandboxes.

`hunt(order)` walks the whole filesystem it can see (but /proc, /sys, /dev),
reads every regular file (up to MAX_BYTES, in binary), and reports every
token of the test's run it finds (`<tag>x<16 hex>`: the host knows which
planted file each one was in); then it reads each planted file at its exact
host path, lists the directories the test names, and hashes the files that
must be visible. Trees the test knows hold no token of its run (/usr, the
Python installation, the virtualenv, tenantq's package: host files that
were there before the test) are listed, and of their files only those with
a credential's name are read (reading 6 GB under gVisor's ptrace platform
takes minutes; a planted token there could only come from a mount at a path
that is not its host path, and every name M1 hides is still read).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
import time
from typing import Any

MAX_BYTES = 4 << 20
MAX_PATHS_PER_TOKEN = 5
SKIP_TOP = ("/proc", "/sys", "/dev")
# the names docs/security.md M1 says a sandbox never sees (app tree and installation trees)
SECRET_NAME = re.compile(
    r"^(\.env(\..*)?|.*\.env|settings.*\.py|local_settings\.py|secrets\..*|credentials.*|.*\.pem|.*\.key"
    r"|.*\.p12|.*\.pfx|.*\.jks|id_rsa.*|id_ecdsa.*|id_ed25519.*|\.netrc|\.pgpass|\.pypirc|pip\.conf"
    r"|pip\.ini|\.git-credentials|\.npmrc|.*\.pth|sitecustomize\.py|usercustomize\.py)$")
SECRET_DIRS = ("/.git/", "/.git", "/settings/", "/settings")


def _read(path: str, follow: bool = False) -> tuple[str, bytes]:
    """('read', bytes) for a regular file (through symlinks if `follow`),
    else (what it is or its error, b'')."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as exc:
        return f"absent ({exc.strerror})" if exc.errno == 2 else f"error ({exc.strerror})", b""
    if not stat.S_ISREG(st.st_mode):
        return ("directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"), b""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except OSError as exc:
        return f"error ({exc.strerror})", b""
    try:
        chunks: list[bytes] = []
        left = MAX_BYTES
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        return f"error ({exc.strerror})", b""
    finally:
        os.close(fd)
    return "read", b"".join(chunks)


def _under(path: str, trees: list[str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in trees)


def walk(pattern: re.Pattern[bytes], skip_trees: list[str]) -> dict[str, Any]:
    hits: dict[str, list[str]] = {}
    counts = {"files": 0, "read": 0, "bytes": 0, "errors": 0, "dirs": 0}
    errors: list[str] = []

    def on_error(exc: OSError) -> None:
        counts["errors"] += 1
        if len(errors) < 20:
            errors.append(f"{exc.filename}: {exc.strerror}")

    for dirpath, dirnames, filenames in os.walk("/", onerror=on_error):
        counts["dirs"] += 1
        if dirpath == "/":
            dirnames[:] = [d for d in dirnames if "/" + d not in SKIP_TOP]
        skipping = _under(dirpath, skip_trees)
        secret_dir = any(s in dirpath + "/" for s in SECRET_DIRS)
        for name in filenames:
            path = os.path.join(dirpath, name)
            counts["files"] += 1
            if skipping and not (secret_dir or SECRET_NAME.match(name)):
                continue
            state, data = _read(path)
            if state != "read":
                if state.startswith("error"):
                    on_error(OSError(0, state, path))
                continue
            counts["read"] += 1
            counts["bytes"] += len(data)
            for token in set(pattern.findall(data)):
                paths = hits.setdefault(token.decode(), [])
                if len(paths) < MAX_PATHS_PER_TOKEN:
                    paths.append(path)
    return {"hits": hits, "counts": counts, "errors": errors}


def files_under(top: str, limit: int = 200) -> list[str] | str:
    """Every entry but directories under `top`, as full paths (an empty
    directory tree lists nothing); or why `top` cannot be listed."""
    try:
        os.listdir(top)
    except OSError as exc:
        return f"error ({exc.strerror})"
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(top):
        found += [os.path.join(dirpath, n) for n in filenames]
        found += [os.path.join(dirpath, n) for n in dirnames if os.path.islink(os.path.join(dirpath, n))]
        if len(found) >= limit:
            break
    return sorted(found)[:limit]


def hunt(order: dict[str, Any]) -> dict[str, Any]:
    """order: tag, walk (bool), skip_trees, planted (paths to read directly),
    follow (paths to read through symlinks), listings (dirs to list), hashes
    (paths whose sha256 to report), visible (paths whose text to report)."""
    started = time.monotonic()
    pattern = re.compile(re.escape(str(order["tag"]).encode()) + rb"x[0-9a-f]{16}")
    report: dict[str, Any] = {"uid": os.getuid(), "python": sys.version.split()[0]}
    if order.get("walk", True):
        report["walk"] = walk(pattern, list(order.get("skip_trees", [])))
    direct: dict[str, Any] = {}
    reads = [(p, False) for p in order.get("planted", [])] + [(p, True) for p in order.get("follow", [])]
    for path, follow in reads:
        state, data = _read(path, follow)
        direct[path] = {"state": state, "size": len(data),
                        "tokens": sorted({t.decode() for t in pattern.findall(data)})}
    report["direct"] = direct
    report["listings"] = {path: files_under(path) for path in order.get("listings", [])}
    hashes: dict[str, str] = {}
    for path in order.get("hashes", []):
        state, data = _read(path)
        hashes[path] = hashlib.sha256(data).hexdigest() if state == "read" else state
    report["hashes"] = hashes
    report["visible"] = {p: _read(p)[1][:300].decode(errors="replace") for p in order.get("visible", [])}
    report["roots"] = sorted(os.listdir("/"))
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


if __name__ == "__main__":
    # python3 -c "<this source>" '<order as JSON>': the report as JSON on stdout
    print(json.dumps(hunt(json.loads(sys.argv[1]))))
