"""The commands beside the runtime (check, bench, cache, demo, loadtest, ...) and what they share."""
from __future__ import annotations

import os


def writable_folder_of(path: str) -> str | None:
    """The folder a file at `path` would go in, when it is missing or not writable (else None): checked before a
    long run, not after it."""
    folder = os.path.dirname(os.path.abspath(path))
    return None if os.path.isdir(folder) and os.access(folder, os.W_OK) else folder
