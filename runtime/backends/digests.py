"""Content digests of bundle files, for the caches that must never serve an entry made from other bytes."""
from __future__ import annotations

import hashlib
import os


def file_digest(path: str) -> str:
    """The file's SHA-256, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class FileDigests:
    """file_digest, remembered while a file's size and mtime stay: a weights file is hashed once per run."""

    def __init__(self):
        self._known: dict[str, tuple[tuple[int, int], str]] = {}  # path -> ((size, mtime_ns), sha256)

    def __call__(self, path: str) -> str:
        st = os.stat(path)
        stamp = (st.st_size, st.st_mtime_ns)
        known = self._known.get(path)
        if known is None or known[0] != stamp:
            known = self._known[path] = (stamp, file_digest(path))
        return known[1]
