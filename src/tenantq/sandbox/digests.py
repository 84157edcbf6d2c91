"""Content hashes of files and trees, recomputed only when a file's size or
mtime change (a template key and the app's code view re-derive them every
few seconds)."""

from __future__ import annotations

import hashlib
import os


class FileDigests:
    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, int, str]] = {}

    def tree(self, root: str) -> str:
        digest = hashlib.sha256()
        paths = [root] if os.path.isfile(root) else sorted(
            os.path.join(d, f) for d, dirs, files in os.walk(root)
            if "__pycache__" not in d for f in files if not f.endswith((".pyc", ".pyo")))
        for path in paths:
            digest.update(f"{os.path.relpath(path, root)}\0{self.file(path)}\n".encode())
        return digest.hexdigest()

    def file(self, path: str) -> str:
        try:
            st = os.stat(path)
        except OSError:
            return "missing"
        cached = self._cache.get(path)
        if cached is not None and cached[:2] == (st.st_size, st.st_mtime_ns):
            return cached[2]
        with open(path, "rb") as fh:
            value = hashlib.sha256(fh.read()).hexdigest()
        self._cache[path] = (st.st_size, st.st_mtime_ns, value)
        return value


DIGESTS = FileDigests()
