"""The QNN context-binary cache: compile a step graph for the HTP once per bundle and SoC, load it after that.

onnxruntime writes a compiled graph as an "EP context" model (session options ep.context_enable,
ep.context_file_path, ep.context_embed_mode=1: one .onnx file holding a single EPContext node with the QNN
context binary, weights included). Loading that file skips the conversion and HTP graph preparation.

An entry lives in <cache>/qnn/<key>/ where the key is a digest of everything that shapes the binary: the graph
file's bytes, the weights file's bytes, the QNN options (backend, SoC model, precision, session config) and the
onnxruntime / onnxruntime-qnn / QNN SDK versions. A changed bundle or a new wheel therefore never meets an old
binary. Each entry also stores the SHA-256 of its binary, checked before loading, so a truncated or damaged file
is recompiled instead of handed to QNN. And it stores where onnxruntime placed the graph's nodes when it compiled
them (a context model's own graph is one EPContext node), so that a load from the cache can still say how many
of the bundle's nodes run on the HTP, and which graph it was made from (for `specedge cache list`). A lookup marks
the entry used, so `specedge cache prune` removes the least recently used entries first.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from ...tools.cache import mark_used, record_source
from .digests import FileDigests, file_digest

CACHE_FORMAT = 2  # bump when the layout of an entry changes (2: placement.json)
CONTEXT_FILE = "graph_ctx.onnx"
DIGEST_FILE = "graph_ctx.sha256"
PLACEMENT_FILE = "placement.json"  # {execution provider: nodes} of the compiled graph


def default_root() -> str:
    """<specedge cache>/qnn: $SPECEDGE_CACHE or the user cache dir, as the demo's bundles use."""
    from ...tools.demo import cache_dir

    return os.path.join(cache_dir(), "qnn")


class ContextCache:
    def __init__(self, root: str | None = None):
        self.root = root or default_root()
        self._content_digest = FileDigests()

    def key(self, graph_path: str, weights_path: str, options: dict) -> str:
        parts = {"format": CACHE_FORMAT, "graph": self._content_digest(graph_path),
                 "weights": self._content_digest(weights_path), "options": options}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]

    def entry(self, key: str) -> str:
        return os.path.join(self.root, key)

    def exists(self, key: str) -> bool:
        return os.path.isdir(self.entry(key))

    def lookup(self, key: str) -> str | None:
        """The cached context model of `key`, or None when absent or damaged (a damaged entry is removed)."""
        d = self.entry(key)
        ctx, digest = os.path.join(d, CONTEXT_FILE), os.path.join(d, DIGEST_FILE)
        if not os.path.isfile(ctx):
            return None
        try:
            with open(digest) as f:
                ok = f.read().strip() == file_digest(ctx)
        except OSError:
            ok = False
        if not ok:
            self.discard(key)
            return None
        mark_used(d)
        return ctx

    def staging(self, key: str) -> str:
        """A fresh directory for onnxruntime to write a context model into (see commit)."""
        os.makedirs(self.root, exist_ok=True)
        return tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=self.root)

    def commit(self, key: str, staged_dir: str, placement: dict[str, int], source: str | None = None) -> str:
        """Seal a staged context model with its digest and the compiled graph's node placement, and move it into
        place in one rename (a crash mid-write leaves only a .tmp directory, never a half entry)."""
        ctx = os.path.join(staged_dir, CONTEXT_FILE)
        with open(os.path.join(staged_dir, PLACEMENT_FILE), "w") as f:
            json.dump(placement, f)
        with open(os.path.join(staged_dir, DIGEST_FILE), "w") as f:
            f.write(file_digest(ctx))
        if source is not None:
            record_source(staged_dir, source)
        final = self.entry(key)
        try:
            os.rename(staged_dir, final)
        except OSError:  # another process won the race: its entry is as good as ours
            shutil.rmtree(staged_dir, ignore_errors=True)
        return os.path.join(final, CONTEXT_FILE)

    def placement(self, key: str) -> dict[str, int] | None:
        """Where the nodes of `key`'s graph were placed when it was compiled; None if that record is unreadable."""
        try:
            with open(os.path.join(self.entry(key), PLACEMENT_FILE)) as f:
                placed = json.load(f)
        except (OSError, ValueError):
            return None
        if not (isinstance(placed, dict) and all(isinstance(n, int) for n in placed.values())):
            return None
        return placed

    def discard(self, key: str) -> None:
        shutil.rmtree(self.entry(key), ignore_errors=True)
