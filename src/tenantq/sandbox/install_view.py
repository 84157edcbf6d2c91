"""What of the Python installation a sandbox does not see (docs/security.md,
rule M1).

The installation trees (the interpreter's prefix, the site-packages
directories the worker uses, tenantq's package) are mounted whole: a guest
needs the standard library and the app's dependencies, thousands of files.
What in them is configuration or a credential, and nothing a guest needs,
is covered by an empty read-only file or directory:

- `.pth` files and `sitecustomize.py` / `usercustomize.py` at the top of a
  site-packages directory: the guest runs `python -I -S`, which never reads
  them, and tools put start-up configuration there (tokens, proxies);
- site-packages directories the worker's `sys.path` does not use (a
  virtualenv's base interpreter's): none of their packages is imported;
- at any depth, files named like credentials or tool configuration
  (`pip.conf`, `.netrc`, `.env`, ...), `.git` directories, and private keys.

The scan reads names only, but for `*.pem` files (are they a private
key?). It runs once per process and set of trees (about 0.3 s for a
virtualenv and a pyenv interpreter here).
"""

from __future__ import annotations

import fnmatch
import os
import threading
from collections.abc import Sequence

CONFIG_NAMES = ("pip.conf", "pip.ini", ".pypirc", ".netrc", ".pgpass", ".git-credentials", ".npmrc",
                ".env", ".env.*", ".envrc")
KEY_NAMES = ("*.key", "*.p12", "*.pfx")
START_UP = ("sitecustomize.py", "usercustomize.py")
SITE_NAMES = ("site-packages", "dist-packages")
PEM_SCAN_BYTES = 4 << 20

_cache: dict[tuple[tuple[str, ...], ...], tuple[tuple[str, bool], ...]] = {}
_lock = threading.Lock()


def hidden(trees: Sequence[str], site_dirs: Sequence[str],
           unused: Sequence[str] = ()) -> tuple[tuple[str, bool], ...]:
    """(path, is a directory) of everything in `trees` a sandbox must not
    see, sorted; `site_dirs` are the site-packages directories in use;
    `unused` are directories hidden whole (the standard library's own test
    suite, which ships test keys: one mount instead of one per key)."""
    key = (tuple(trees), tuple(site_dirs), tuple(unused))
    with _lock:
        found = _cache.get(key)
        if found is None:
            found = _cache[key] = _scan(trees, set(site_dirs), set(unused))
        return found


def _scan(trees: Sequence[str], used: set[str], unused: set[str]) -> tuple[tuple[str, bool], ...]:
    out: set[tuple[str, bool]] = {(d, True) for d in unused if os.path.isdir(d)}
    stack = list(trees)
    seen: set[str] = set()
    while stack:
        directory = stack.pop()
        if directory in seen or directory in unused:
            continue
        seen.add(directory)
        top_of_site = directory in used
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            name = entry.name.lower()
            try:
                if entry.is_symlink():
                    continue  # a link's target is scanned where it lives, or is not mounted
                if entry.is_dir():
                    if name == ".git":
                        out.add((entry.path, True))
                    elif name in SITE_NAMES and entry.path not in used:
                        out.add((entry.path, True))  # not on the worker's path: none of it is needed
                    elif name != "__pycache__":
                        stack.append(entry.path)
                elif entry.is_file() and _secret_file(entry.path, name, top_of_site):
                    out.add((entry.path, False))
            except OSError:
                continue
    return tuple(sorted(out))


def _secret_file(path: str, name: str, top_of_site: bool) -> bool:
    if top_of_site and (name.endswith(".pth") or name in START_UP):
        return True
    if any(fnmatch.fnmatchcase(name, p) for p in (*CONFIG_NAMES, *KEY_NAMES)):
        return True
    return name.endswith(".pem") and _holds_private_key(path)


def _holds_private_key(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            data = fh.read(PEM_SCAN_BYTES)
    except OSError:
        return True  # unreadable here: hidden rather than guessed at
    return b"PRIVATE KEY-----" in data
