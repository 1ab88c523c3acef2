"""Sessions: a conversation's KV cache kept between calls, snapshotted, saved to a file and restored.

Reusing a prefix is the loop's own rollback. After a generation the target's cache holds every committed
token but the pending one, and the runner knows which (`ModelRunner.history`). A new prompt that shares a
prefix with it keeps those entries (cache_len is set to the common length: a divergence rolls back, nothing
before it is recomputed) and prefills only the rest. The output equals a fresh generation of the full
prompt because the step graphs compute every row like a one-token step at its slot, whatever the chunking
(docs/bundle.md, position consistency); tests/test_session.py checks it on every flavour.

A snapshot is a copy of the valid cache entries and the tokens they belong to. `SnapshotStore` keeps a few
of them (least recently used first out) so that one generator can serve several conversations and still
resume each where it stopped; a snapshot file adds a digest of the bundle, so a snapshot is never restored
into a different model.

    gen = Generator.load(bundle)
    session = Session(gen)
    r1 = session.generate(turn1_ids)                       # full prefill
    r2 = session.generate(turn1_ids + r1.tokens + turn2)   # prefills only what follows the cached prefix
    session.save("chat.specedge-session")
    Session.load(gen, "chat.specedge-session")             # later, or in another process
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import SessionError
from ..graphs.manifest import MANIFEST, weights_index_file
from .generator import GenerationResult, Generator
from .model import ModelRunner, common_prefix

SNAPSHOT_FORMAT = 1


@dataclass
class CacheSnapshot:
    """The valid cache entries of a generator's target (and of a draft model with a cache of its own)."""

    tokens: list[int]  # the tokens whose K/V the entries are; the conversation's last token is not in it
    target: list[np.ndarray]  # per layer K then V, [H_kv, n, D]
    draft_tokens: list[int]
    draft: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.target + self.draft)


def take_snapshot(gen: Generator) -> CacheSnapshot:
    draft = gen.draft if gen.draft is not None and not gen.draft_shares_cache else None
    return CacheSnapshot(list(gen.target.history), _entries(gen.target),
                         list(draft.history) if draft else [], _entries(draft) if draft else [])


def restore_snapshot(gen: Generator, snap: CacheSnapshot) -> None:
    """Put a snapshot back into the generator's caches; its next `reuse` generation continues from it."""
    _restore(gen.target, snap.tokens, snap.target)
    if gen.draft is not None and not gen.draft_shares_cache:
        _restore(gen.draft, snap.draft_tokens, snap.draft)


def _entries(runner: ModelRunner) -> list[np.ndarray]:
    runner.cache.set_length(len(runner.history))  # history is the cache's valid prefix, nothing past it
    return runner.cache.read_entries()


def _restore(runner: ModelRunner, tokens: list[int], entries: list[np.ndarray]) -> None:
    runner.history = []
    runner.cache.write_entries(entries)
    runner.history = list(tokens)


class Session:
    """One conversation on a generator: each call reuses what the cache holds of its prompt.

    Several sessions may share a generator; a session whose entries were replaced by another one's restores
    its own snapshot first (one copy of its valid entries, no recomputation)."""

    def __init__(self, gen: Generator):
        self.gen = gen
        self._snapshot: CacheSnapshot | None = None

    @property
    def tokens(self) -> list[int]:
        """The tokens the session's cache holds (the conversation so far, minus its last token)."""
        return list(self._snapshot.tokens if self._snapshot else self.gen.target.history)

    def _activate(self) -> None:
        if self.gen.active_session is not self:
            owner = self.gen.active_session
            if owner is not None:
                owner._snapshot = take_snapshot(self.gen)
            if self._snapshot is not None:
                restore_snapshot(self.gen, self._snapshot)
            else:
                self.gen.target.reset()
            self._snapshot = None
            self.gen.active_session = self

    def stream(self, prompt_ids, **kwargs):
        """Generator.stream with reuse: yields the tokens of each round."""
        self._activate()
        yield from self.gen.stream(prompt_ids, reuse=True, **kwargs)

    def generate(self, prompt_ids, **kwargs) -> GenerationResult:
        self._activate()
        return self.gen.generate(prompt_ids, reuse=True, **kwargs)

    def reset(self) -> None:
        self._activate()
        self.gen.target.reset()
        if self.gen.draft is not None:
            self.gen.draft.reset()

    def save(self, path: str) -> None:
        """Write the session to a file (atomically: a reader never sees half a file)."""
        snap = self._snapshot if self._snapshot is not None else take_snapshot(self.gen)
        save_snapshot(path, snap, bundle_digest(self.gen))

    @classmethod
    def load(cls, gen: Generator, path: str) -> "Session":
        session = cls(gen)
        session._snapshot = load_snapshot(path, gen)
        session._activate()
        return session


# -- snapshot files ------------------------------------------------------------------------------------
def bundle_digest(gen: Generator) -> str:
    """sha256 over the manifest, the weights indexes and the weights files: what makes cache entries valid.
    Computed once per generator (it reads every weights file)."""
    cached = getattr(gen, "_bundle_digest", None)
    if cached:
        return cached
    h = hashlib.sha256()
    files = [MANIFEST] + sorted({f for m in gen.manifest.models.values()
                                 for f in (weights_index_file(m.weights), m.weights)})
    for name in files:
        h.update(name.encode() + b"\0")
        with open(os.path.join(gen.bundle_dir, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    gen._bundle_digest = h.hexdigest()
    return gen._bundle_digest


def save_snapshot(path: str, snap: CacheSnapshot, digest: str) -> None:
    """A zip of .npy arrays (numpy's own format, no pickle) plus a JSON header."""
    header = {"format": SNAPSHOT_FORMAT, "bundle_digest": digest, "tokens": snap.tokens,
              "draft_tokens": snap.draft_tokens, "target_arrays": len(snap.target), "draft_arrays": len(snap.draft)}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with zipfile.ZipFile(tmp, "w") as z:
            z.writestr("header.json", json.dumps(header))
            for role, arrays in (("target", snap.target), ("draft", snap.draft)):
                for i, a in enumerate(arrays):
                    buf = io.BytesIO()
                    np.save(buf, a, allow_pickle=False)
                    z.writestr(f"{role}/{i}.npy", buf.getvalue())
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise SessionError(f"cannot write session file {path}: {e.strerror or e}") from None


def load_snapshot(path: str, gen: Generator) -> CacheSnapshot:
    """Read a session file and check that it belongs to this generator's bundle and fits its caches."""
    try:
        with zipfile.ZipFile(path) as z:
            header = json.loads(z.read("header.json"))
            if header.get("format") != SNAPSHOT_FORMAT:
                raise SessionError(f"{path}: session format {header.get('format')!r}, this runtime reads "
                                   f"{SNAPSHOT_FORMAT}")
            if header.get("bundle_digest") != bundle_digest(gen):
                raise SessionError(f"{path} was saved from a different bundle (or the bundle changed since); "
                                   "a session only restores into the bundle that made it")
            arrays = {role: [np.load(io.BytesIO(z.read(f"{role}/{i}.npy")), allow_pickle=False)
                             for i in range(int(header[f"{role}_arrays"]))] for role in ("target", "draft")}
            snap = CacheSnapshot([int(t) for t in header["tokens"]], arrays["target"],
                                 [int(t) for t in header["draft_tokens"]], arrays["draft"])
    except SessionError:
        raise
    except FileNotFoundError:
        raise SessionError(f"session file not found: {path}") from None
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError, EOFError, OSError) as e:
        raise SessionError(f"{path} is not a readable session file (damaged or truncated: {e})") from None
    _check_fits(path, snap.tokens, snap.target, gen.target)
    if gen.draft is not None and not gen.draft_shares_cache:
        _check_fits(path, snap.draft_tokens, snap.draft, gen.draft)
    return snap


def _check_fits(path: str, tokens: list[int], entries: list[np.ndarray], runner: ModelRunner) -> None:
    d = runner.dims
    want = (d.num_kv_heads, len(tokens), d.head_dim)
    if (len(entries) != 2 * d.num_layers or any(a.shape != want or a.dtype != np.dtype(d.dtype) for a in entries)
            or len(tokens) >= d.context):
        raise SessionError(f"{path}: the cache entries do not fit this bundle's {runner.name} "
                           f"({2 * d.num_layers} arrays of {d.dtype}{list(want)} expected)")


# -- many conversations on one generator (the server) ---------------------------------------------------
class SnapshotStore:
    """Snapshots of recent conversations, least recently used evicted first, bounded in bytes.

    `prepare(prompt)` makes the generator's caches hold the longest prefix of the prompt that any stored
    snapshot (or the live cache) has, stashing the live conversation first when it is worth keeping."""

    def __init__(self, gen: Generator, max_bytes: int = 256 << 20, min_tokens: int = 16):
        self.gen, self.max_bytes, self.min_tokens = gen, max_bytes, min_tokens
        self._snaps: OrderedDict[tuple[int, ...], CacheSnapshot] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._snaps.values())

    def __len__(self) -> int:
        return len(self._snaps)

    def prepare(self, prompt: list[int]) -> int:
        """Returns how many prompt tokens the caches will reuse (the generation reports the same)."""
        head = prompt[:-1]
        live = self.gen.target.history
        live_keep = common_prefix(live, head)
        best_key, best_keep = None, live_keep
        for key, snap in self._snaps.items():
            keep = common_prefix(snap.tokens, head)
            if keep > best_keep:
                best_key, best_keep = key, keep
        best = self._snaps.pop(best_key) if best_key is not None else None  # safe from the stash's eviction
        if live_keep < len(live) and len(live) >= self.min_tokens:
            self._put(take_snapshot(self.gen))  # the live conversation is about to be overwritten
        if best is not None:
            restore_snapshot(self.gen, best)
            self._put(best)  # most recently used
        return best_keep

    def _put(self, snap: CacheSnapshot) -> None:
        key = tuple(snap.tokens)
        self._snaps.pop(key, None)
        # A stored conversation that is a prefix of this one adds nothing: this one reuses at least as much.
        for other in [k for k in self._snaps if len(k) <= len(key) and key[:len(k)] == k]:
            del self._snaps[other]
        self._snaps[key] = snap
        while self._snaps and self.nbytes > self.max_bytes:
            self._snaps.popitem(last=False)

