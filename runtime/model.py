"""One model of a bundle at run time: its step sessions, its KV cache, and `run(tokens)`.

`run` feeds n tokens through the smallest step graph that holds them (padding the rest), writes their K/V
after the valid entries and advances `cache_len` by n; the caller rolls back with `cache.set_length`. The sessions are created on first
use and bound once to the runtime's buffers: the cache buffers and `cache_len` are shared by every step
graph of the model, and each graph has its own input_ids/position_ids/logits/new K/V arrays.
"""
from __future__ import annotations

import os
import time

import numpy as np

from ..errors import BackendError, BundleError, PlacementError
from ..graphs import contract as C
from ..graphs.manifest import GraphEntry, ModelEntry
from .kv_cache import KVCache, SharedKVCache


class _Step:
    """One bound step session: T tokens in, logits (step role) and new K/V out."""

    def __init__(self, session, dims: C.ModelDims, graph: GraphEntry, cache: KVCache):
        B, T = dims.batch, graph.tokens
        keys, values = cache.buffers(graph.context)
        self.tokens, self.role = T, graph.role
        self.input_ids = np.zeros((B, T), np.int64)
        self.position_ids = np.zeros((B, T), np.int64)
        self.logits = np.zeros((B, T, dims.vocab_size), np.float32) if graph.role == C.STEP else None
        self.new_keys = [np.zeros(dims.new_kv_shape(T), dims.dtype) for _ in range(dims.num_layers)]
        self.new_values = [np.zeros(dims.new_kv_shape(T), dims.dtype) for _ in range(dims.num_layers)]
        inputs = {C.INPUT_IDS: self.input_ids, C.POSITION_IDS: self.position_ids, C.CACHE_LEN: cache.length}
        outputs = {}
        if self.logits is not None:
            outputs[C.LOGITS] = self.logits
        for i in range(dims.num_layers):
            inputs[C.past_key(i)], inputs[C.past_value(i)] = keys[i], values[i]
            outputs[C.new_key(i)], outputs[C.new_value(i)] = self.new_keys[i], self.new_values[i]
        session.bind(inputs, outputs)
        self.session = session


class ModelRunner:
    def __init__(self, name: str, bundle_dir: str, entry: ModelEntry, backend, shares: "ModelRunner | None" = None):
        """`shares`: the target, for a draft cut from its first layers that reads the target's cache."""
        self.name = name
        self.entry = entry
        self.dims = entry.dims
        self.cache = SharedKVCache(entry.dims, shares.cache) if shares else KVCache(entry.dims, entry.buckets())
        self._dir = bundle_dir
        self._backend = backend
        self._steps: dict[tuple[str, int, int], _Step] = {}
        self._step_sizes: list[int] = entry.step_tokens()  # the step graphs runs may use (see use_steps)
        self.graph_seconds = 0.0  # time inside session.run, for the host-overhead breakdown
        self.graph_runs = 0
        # The tokens whose K/V the cache holds (slot i <-> history[i]) when a generation ended cleanly; empty
        # while one runs or after it failed, so a later prefill never trusts entries it cannot name.
        self.history: list[int] = []

    # -- sessions ------------------------------------------------------------------------------------
    def _step(self, role: str, tokens: int, context: int) -> _Step:
        key = (role, tokens, context)
        if key not in self._steps:
            graph = self.entry.graph(role, tokens, context)
            path = os.path.join(self._dir, graph.file)
            if not os.path.isfile(path):
                raise BundleError(f"graph file missing: {path}")
            try:
                session = self._backend.load(path, os.path.join(self._dir, self.entry.weights),
                                             config=self.entry.session_config)
            except PlacementError:  # a sound graph this device cannot run: say that, not "corrupt"
                raise
            except BackendError as e:
                raise BundleError(f"{graph.file} is corrupt or not a graph of this runtime ({e})") from None
            _check_io(graph, self.dims, session)
            self._steps[key] = _Step(session, self.dims, graph, self.cache)
        return self._steps[key]

    @property
    def sessions(self) -> int:
        return len(self._steps)

    def warm(self, roles_tokens: list[tuple[str, int]]) -> None:
        """Create (and validate) the sessions a run will need, in every bucket, before it produces output."""
        for role, tokens in roles_tokens:
            for context in self.entry.buckets():
                if self.entry.graph(role, tokens, context):
                    self._step(role, tokens, context)

    # -- graph choice --------------------------------------------------------------------------------
    def use_steps(self, sizes: list[int] | None) -> list[int]:
        """Restrict runs to these step graphs (None: all). Every session holds a few MB of its own, so a
        run loads the few it needs (T=1 and T=gamma+1) and pads shorter steps into them."""
        available = self.entry.step_tokens()
        self._step_sizes = sorted(set(sizes) & set(available)) if sizes is not None else available
        return self._step_sizes

    def step_graph_for(self, n: int) -> int | None:
        """The smallest step graph in use that holds n tokens and fits in the free cache slots."""
        fits = [t for t in self._step_sizes if n <= t <= self.cache.free]
        return min(fits) if fits else None

    def _prefill_plan(self, remaining: int) -> tuple[str, int]:
        """Full prefill chunks first; a tail goes through the smallest graph that holds it (a half-size
        prefill graph, or a step graph, whose LM head is cheap at a few rows), padding the rest."""
        free = self.cache.free
        sizes = [(t, C.PREFILL) for t in self.entry.prefill_tokens() if t <= free]
        sizes += [(t, C.STEP) for t in self._step_sizes if t <= free]
        if not sizes:
            raise ValueError("cache full")
        chunk = max((t for t, role in sizes if role == C.PREFILL), default=0)
        if chunk and remaining >= chunk:
            return C.PREFILL, chunk
        holding = [(t, role) for t, role in sizes if t >= remaining]
        # The smallest graph that holds the rest; near the end of the cache, the largest that fits.
        t, role = min(holding) if holding else max(sizes)
        return role, t

    # -- running -------------------------------------------------------------------------------------
    def _bucket_for(self, role: str, T: int) -> int:
        """The smallest past length, at or above the active one, that has the graph and holds the cache plus
        all T slots of the step, padding included: a T > 1 graph places its rows at slots cache_len..+T-1."""
        need = max(self.cache.bucket, self.cache.used + T)
        return next(b for b in self.cache.buckets if b >= need and self.entry.graph(role, T, b))

    def _execute(self, role: str, T: int, rows) -> _Step:
        """Run graph (role, T): row b feeds rows[b] (rows past len(rows), or empty, idle), padded to T, at its
        own cache length; each row's new K/V go after its valid entries."""
        self.cache.use_bucket(self._bucket_for(role, T))
        step = self._step(role, T, self.cache.bucket)
        counts = [len(r) for r in rows] + [0] * (self.dims.batch - len(rows))
        for b, n in enumerate(counts):
            if n:
                step.input_ids[b, :n] = rows[b]
            step.input_ids[b, n:] = 0
            start = self.cache.length[b]
            step.position_ids[b] = np.arange(start, start + T)  # padding rows continue the positions
        began = time.perf_counter()
        step.session.run()
        self.graph_seconds += time.perf_counter() - began
        self.graph_runs += 1
        self.cache.append(step.new_keys, step.new_values, counts)
        return step

    def reserve(self, n: int) -> None:
        """Move the cache now to the bucket that a run of n tokens will use (see SharedKVCache)."""
        T = self.step_graph_for(n)
        if T is not None:
            self.cache.use_bucket(self._bucket_for(C.STEP, T))

    def run(self, tokens) -> np.ndarray:
        """Process tokens in one step graph; return their logits [n, V] (a view, valid until the next run)."""
        n = len(tokens)
        T = self.step_graph_for(n)
        if T is None:
            raise ValueError(f"no step graph holds {n} tokens in {self.cache.free} free cache slots")
        return self._execute(C.STEP, T, [tokens]).logits[0, :n]

    def prefill(self, tokens) -> None:
        """Fill the cache with tokens in the fewest graph runs; no logits are kept."""
        done = 0
        while done < len(tokens):
            role, T = self._prefill_plan(len(tokens) - done)
            n = min(T, len(tokens) - done)
            self._execute(role, T, [tokens[done:done + n]])
            done += n

    # -- batches (runtime/batch.py) ------------------------------------------------------------------------
    def run_rows(self, rows: list[list[int]]) -> np.ndarray:
        """One step for the rows of a batch: row b feeds rows[b] (empty: an idle row, whose cache does not
        change). Returns logits [B, T, V] (a view, valid until the next run)."""
        n = max(1, max(len(r) for r in rows))
        T = self.step_graph_for(n)
        if T is None:
            raise ValueError(f"no step graph holds {n} tokens in {self.cache.free} free cache slots")
        return self._execute(C.STEP, T, rows).logits

    def prefill_rows(self, prompts: list[list[int]]) -> None:
        """Fill row b's cache with prompts[b], all rows in the same steps, planned like `prefill` for the row
        with the most left; a row with nothing left (or past len(prompts)) idles."""
        done = [0] * len(prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            role, T = self._prefill_plan(max(len(p) - d for d, p in zip(done, prompts)))
            rows = [list(p[d:d + T]) for d, p in zip(done, prompts)]
            self._execute(role, T, rows)
            done = [d + len(r) for d, r in zip(done, rows)]

    def prefill_reusing(self, tokens: list[int]) -> int:
        """Fill the cache with tokens, keeping the longest prefix it already holds (see `history`): a
        divergence rolls back by setting cache_len, nothing before it is recomputed. Returns the tokens kept."""
        keep = common_prefix(self.history, tokens)
        self.history = []
        if keep:
            self.cache.set_length(keep)
        else:
            self.reset()
        self.prefill(tokens[keep:])
        return keep

    def keep_history(self, committed: list[int]) -> None:
        """A generation ended with the cache holding a prefix of `committed` (a round cut by a stop token or
        the token limit may have stored accepted tokens past the output): keep exactly committed[:n]."""
        n = min(self.cache.used, len(committed))
        self.cache.set_length(n)
        self.history = list(committed[:n])

    def reset(self) -> None:
        self.cache.reset()
        self.history = []

    def close(self) -> None:
        for step in self._steps.values():
            step.session.close()
        self._steps.clear()


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


def _check_io(graph: GraphEntry, dims: C.ModelDims, session) -> None:
    """A graph whose I/O disagrees with the manifest's dims would corrupt the cache silently: refuse it."""
    want_in = {(s.name, s.dtype, s.shape) for s in C.step_inputs(dims, graph.tokens, graph.step_mask, graph.context)}
    want_out = {(s.name, s.dtype, s.shape) for s in C.step_outputs(dims, graph.tokens, graph.role)}
    got_in = {(n, d, tuple(s)) for n, d, s in session.inputs}
    got_out = {(n, d, tuple(s)) for n, d, s in session.outputs}
    if got_in != want_in or got_out != want_out:
        diff = sorted((want_in ^ got_in) | (want_out ^ got_out))[:3]
        raise BundleError(f"manifest disagrees with {graph.file}: graph I/O {diff[0] if diff else ''} "
                          f"does not match the manifest's dims (T={graph.tokens}, role={graph.role})")
