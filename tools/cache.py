"""`specedge cache`: what specedge keeps in its cache directory, and how to shrink it.

The cache ($SPECEDGE_CACHE, else the user cache dir) has three parts, each a folder of entries:
  bundles/<name>   the demo's exported SmolLM2 bundle, one per specedge version and bundle format (tools/demo.py)
  ort/<key>        onnxruntime's optimized quantized graphs and their weights, one per weights file
                   (runtime/backends/ort_cache.py)
  qnn/<key>        QNN context binaries, one per graph, SoC and wheel (runtime/backends/qnn_cache.py)
Entries are keyed by content, so nothing ever reuses a stale one, but nothing removes one either: a re-exported
bundle or a new onnxruntime wheel leaves the old entries behind. Every use of an entry sets its folder's mtime
(`mark_used`), so `prune` can remove the least recently used first. A folder whose name has `.tmp-` or `.old-`
in it is a write that never finished (a crash, a kill); `prune` removes those once they are an hour old.

Removing an entry while another process loads from it can make that load fail (the files it is about to open
are gone); a session already created keeps its mappings. Prune when no specedge process is starting.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from dataclasses import dataclass

from ..errors import SpecedgeError

PARTS = ("bundles", "ort", "qnn")
SOURCE_FILE = "source.json"  # what an ort or qnn entry was made from: {"path": ...}, for `specedge cache list`
LEFTOVER_AGE_S = 3600  # an unfinished write older than this is a crash's leftover, not a write in progress
_UNFINISHED = re.compile(r"\.(tmp|old)-")


def mark_used(entry: str) -> None:
    """Record that `entry` (a cache folder) was just used; a cache on a read-only device is left as it is."""
    try:
        os.utime(entry)
    except OSError:
        pass


def record_source(entry: str, path: str) -> None:
    """Write which bundle file an entry was made from (kept for listing; the key does not depend on it)."""
    try:
        with open(os.path.join(entry, SOURCE_FILE), "w") as f:
            json.dump({"path": os.path.abspath(path)}, f)
    except OSError:
        pass


@dataclass
class Entry:
    part: str
    path: str
    size: int  # bytes of the files under it
    used: float  # last use (the folder's mtime), seconds since the epoch
    source: str | None  # the bundle file it was made from, when recorded
    unfinished: bool  # a write that never finished

    @property
    def name(self) -> str:
        return f"{self.part}/{os.path.basename(self.path)}"


def _size(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:  # removed while we walk
                pass
    return total


def _source(path: str) -> str | None:
    try:
        with open(os.path.join(path, SOURCE_FILE)) as f:
            source = json.load(f).get("path")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) else None


def _unfinished_in(folder: str) -> list[str]:
    """Unfinished writes inside an ort entry (its tensors and graphs are written to .tmp- names, then renamed)."""
    try:
        return [os.path.join(folder, n) for n in os.listdir(folder) if _UNFINISHED.search(n)]
    except OSError:
        return []


def entries(root: str) -> list[Entry]:
    """Every entry of every part under `root`, least recently used first."""
    out = []
    for part in PARTS:
        folder = os.path.join(root, part)
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            unfinished = bool(_UNFINISHED.search(name))
            if not os.path.isdir(path) and not unfinished:
                continue  # not ours: left alone
            size = _size(path) if os.path.isdir(path) else st.st_size
            out.append(Entry(part, path, size, st.st_mtime, _source(path), unfinished))
    return sorted(out, key=lambda e: e.used)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def prune(root: str, max_bytes: int | None = None, unused_for_s: float | None = None,
          now: float | None = None) -> list[Entry]:
    """Remove crash leftovers older than an hour, entries not used for `unused_for_s` seconds, and then the least
    recently used entries until the cache holds at most `max_bytes`. Returns what was removed."""
    now = time.time() if now is None else now
    removed, kept = [], []
    for e in entries(root):
        crashed = e.unfinished and now - e.used > LEFTOVER_AGE_S
        if crashed or (not e.unfinished and unused_for_s is not None and now - e.used > unused_for_s):
            removed.append(e)
        else:
            kept.append(e)
    if max_bytes is not None:
        # a write in progress counts: it will hold its bytes once finished, but only finished entries can go
        total = sum(e.size for e in kept)
        for e in [e for e in kept if not e.unfinished]:  # least recently used first
            if total <= max_bytes:
                break
            removed.append(e)
            kept.remove(e)
            total -= e.size
    for e in removed:
        _remove(e.path)
    for e in kept:  # unfinished tensor writes inside ort entries that are kept
        if e.part == "ort" and not e.unfinished:
            leftovers = [p for p in _unfinished_in(e.path) if now - _mtime(p) > LEFTOVER_AGE_S]
            for leftover in leftovers:
                _remove(leftover)
            if leftovers:  # removing a file touches the folder: keep its last use as it was
                try:
                    os.utime(e.path, (e.used, e.used))
                except OSError:
                    pass
    return removed


def _mtime(path: str) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return float("inf")  # already gone: nothing to remove


def clear(root: str) -> list[Entry]:
    """Remove every entry of every part (files that specedge did not make are left where they are)."""
    gone = entries(root)
    for e in gone:
        _remove(e.path)
    return gone


# -- the command ----------------------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40}


def parse_size(text: str) -> int:
    """'500M', '2G', '1.5GB', '0' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 500M or 2G, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not days >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number of days >= 0, got {text!r}")
    return days


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="list the cache (demo bundles, optimized graphs, QNN binaries), prune or clear it",
                       description="The cache is $SPECEDGE_CACHE, else the user cache dir. Its entries are never "
                       "reused when stale (they are keyed by content) but never removed on their own either: a "
                       "re-exported bundle or a new onnxruntime leaves the old ones behind. `list` (the default) "
                       "shows every entry, least recently used first; `prune` removes entries by age or down to a "
                       "size, least recently used first; `clear` removes all. Do not prune while a specedge process "
                       "is loading a bundle.")
    p.add_argument("action", nargs="?", choices=["list", "prune", "clear"], default="list")
    p.add_argument("--max-size", type=parse_size, default=None, metavar="SIZE",
                   help="prune: remove least recently used entries until the cache holds at most this (500M, 2G)")
    p.add_argument("--unused-for", type=parse_days, default=None, metavar="DAYS",
                   help="prune: remove entries not used for more than DAYS days")


def run(a) -> int:
    from .demo import cache_dir

    root = cache_dir()
    if os.path.exists(root) and not os.path.isdir(root):  # listing it as empty would hide the mistake
        raise SpecedgeError(f"the cache {root} is a file, not a folder (SPECEDGE_CACHE?)")
    if a.action != "prune" and (a.max_size is not None or a.unused_for is not None):
        raise SpecedgeError("--max-size and --unused-for go with `specedge cache prune`")
    if a.action == "list":
        found = entries(root)
        print(f"cache: {root} ({human(sum(e.size for e in found))} in {len(found)} entries)")
        now = time.time()
        for e in found:
            age = now - e.used
            when = f"{age / 86400:.1f} days ago" if age >= 86400 else f"{age / 3600:.1f} hours ago"
            note = "unfinished write" if e.unfinished else (f"from {e.source}" if e.source else "")
            print(f"  {e.name:<44} {human(e.size):>9}  used {when:<15} {note}".rstrip())
        return 0
    if a.action == "prune":
        if a.max_size is None and a.unused_for is None:
            raise SpecedgeError("prune needs --max-size SIZE or --unused-for DAYS (or both)")
        gone = prune(root, a.max_size, None if a.unused_for is None else a.unused_for * 86400)
    else:
        gone = clear(root)
    print(f"removed {len(gone)} entries ({human(sum(e.size for e in gone))}) from {root}; "
          f"{human(sum(e.size for e in entries(root)))} left")
    return 0
