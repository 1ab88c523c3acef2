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
from .kernel_probe import row_plan
from .kv_cache import KVCache, SharedKVCache, new_kv_block
from .prefill_plan import plan_prefill
from .tree import TreeLayout

LOOKUP_RELEASE_TOKENS = 64  # decode drops the lookup pages after this many tokens (release_lookup_pages)


class _StepBuffers:
    """The inputs (but the cache) and outputs of a graph (role, T), shared by its sessions of every context
    bucket: runs are one at a time, and a step's outputs are read (the new K/V copied into the cache) before
    the next run. A 64-row prefill's new K/V alone is 2.9 MB for SmolLM2."""

    def __init__(self, dims: C.ModelDims, role: str, T: int, step_mask: bool):
        B = dims.batch
        self.input_ids = np.zeros((B, T), np.int64)
        self.position_ids = np.zeros((B, T), np.int64)
        self.logits = np.zeros((B, T, dims.vocab_size), np.float32) if role == C.STEP else None
        self.new_kv = new_kv_block(dims, B, T)
        self.causal = np.tril(np.ones((T, T), bool)) if step_mask else None
        self.step_mask = np.broadcast_to(self.causal, (B, T, T)).copy() if step_mask else None


def _bind(session, buffers: _StepBuffers, keys: list[np.ndarray], values: list[np.ndarray], cache_len: np.ndarray,
          step_mask: np.ndarray | None = None) -> None:
    """Bind a session to its I/O buffers and to the cache buffers it reads (the batch's, or one row's slices)."""
    inputs = {C.INPUT_IDS: buffers.input_ids, C.POSITION_IDS: buffers.position_ids, C.CACHE_LEN: cache_len}
    if step_mask is not None:
        inputs[C.STEP_MASK] = step_mask
    outputs = {} if buffers.logits is None else {C.LOGITS: buffers.logits}
    for i in range(len(keys)):
        inputs[C.past_key(i)], inputs[C.past_value(i)] = keys[i], values[i]
        outputs[C.new_key(i)], outputs[C.new_value(i)] = buffers.new_kv[0, i], buffers.new_kv[1, i]
    session.bind(inputs, outputs)


class _Step:
    """One bound step session: T tokens in, logits (step role) and new K/V out."""

    def __init__(self, session, dims: C.ModelDims, graph: GraphEntry, cache: KVCache, buffers: _StepBuffers):
        keys, values = cache.buffers(graph.context)
        self.tokens, self.role = graph.tokens, graph.role
        self.input_ids, self.position_ids = buffers.input_ids, buffers.position_ids
        self.logits, self.new_kv = buffers.logits, buffers.new_kv
        self.step_mask = None
        if graph.step_mask:  # a tree run fills it; a chain (which runs in a tree graph too) gets `causal`
            self.causal, self.step_mask = buffers.causal, buffers.step_mask
        _bind(session, buffers, keys[:dims.num_layers], values[:dims.num_layers], cache.length, self.step_mask)
        self.session = session


class _RowStep:
    """A row graph's session (a batch-1 prefill or step graph of a batch model), bound to one row of the batch
    cache per run: the row's slice of every buffer is contiguous, so the binding is zero-copy."""

    def __init__(self, session, graph: GraphEntry, buffers: _StepBuffers):
        self.session, self.tokens, self.context, self.buffers = session, graph.tokens, graph.context, buffers
        self.input_ids, self.position_ids = buffers.input_ids, buffers.position_ids
        self.logits, self.new_kv = buffers.logits, buffers.new_kv
        self.row = None  # the row the session is bound to

    def bind(self, cache: KVCache, row: int) -> None:
        if self.row == row:
            return
        keys, values = cache.buffers(self.context)
        _bind(self.session, self.buffers, [k[row:row + 1] for k in keys], [v[row:row + 1] for v in values],
              cache.length[row:row + 1])
        self.row = row


class ModelRunner:
    def __init__(self, name: str, bundle_dir: str, entry: ModelEntry, backend, shares: "ModelRunner | None" = None,
                 logits_scale: float | None = None, draft_of: ModelEntry | None = None):
        """`shares`: the target, for a draft cut from its first layers that reads the target's cache.
        `logits_scale`: the grid the graphs' logits lie on (Manifest.logits_scale), snapped onto after each run.
        `draft_of`: the target's entry, when this model drafts for it. The model's RowPlan (kernel_probe.py) says
        how its graphs load and the fewest rows a step computes; a draft's rows only propose, so it decodes in
        one-row steps, in the target's layout when it is cut from the target's layers."""
        self.name = name
        self._logits_scale = logits_scale
        self.entry = entry
        self.dims = entry.dims
        self.cache = SharedKVCache(entry.dims, shares.cache) if shares else KVCache(entry.dims, entry.buckets())
        self.bundle_dir = bundle_dir
        self._backend = backend
        self.plan = row_plan(entry, backend.name, draft_of)
        self._min_tokens = self.plan.min_tokens(entry.dims.batch)  # T below it would compute rows unlike others
        self._steps: dict[tuple[str, int, int], _Step] = {}  # (role, T, context)
        self._step_buffers: dict[tuple[str, int, bool], _StepBuffers] = {}  # (role, T, step_mask)
        self._row_steps: dict[tuple[str, int, int], _RowStep] = {}  # (role, T, context): row graphs
        self._row_buffers: dict[tuple[str, int], _StepBuffers] = {}  # (role, T), shared by the row graphs' buckets
        self._graph_buckets: dict[tuple[str, int, bool, bool], list[int]] = {}  # (role, T, tree, row): buckets with it
        self._step_sizes: list[int] = self._usable(entry.step_tokens())  # the step graphs runs may use (use_steps)
        self._row_step_tokens = frozenset(entry.row_step_tokens())  # read every batch round: not the manifest
        self._tree_sizes: list[int] = self._usable(entry.tree_tokens())
        self.graph_seconds = 0.0  # time inside session.run, for the host-overhead breakdown
        self.graph_runs = 0
        self._looked_up = 0  # tokens fed since the weights files' lookup pages were last dropped
        # The tokens whose K/V the cache holds (slot i <-> history[i]) when a generation ended cleanly; empty
        # while one runs or after it failed, so a later prefill never trusts entries it cannot name.
        self.history: list[int] = []

    @property
    def backend_name(self) -> str:
        return self._backend.name

    # -- sessions ------------------------------------------------------------------------------------
    def _step(self, role: str, tokens: int, context: int, tree: bool = False) -> _Step:
        """The session of graph (role, T, context), one per graph (the manifest names one graph per key);
        tree: it must have the step_mask input."""
        key = (role, tokens, context)
        if key in self._steps and tree and self._steps[key].step_mask is None:
            raise ValueError(f"the {role} graph T={tokens} has no step_mask input: it cannot run a tree")
        if key not in self._steps:
            graph = self.entry.graph(role, tokens, context, tree)
            session = self._load(graph)
            _check_io(graph, self.dims, session)
            shape = (role, tokens, graph.step_mask)
            if shape not in self._step_buffers:
                self._step_buffers[shape] = _StepBuffers(self.dims, *shape)
            self._steps[key] = _Step(session, self.dims, graph, self.cache, self._step_buffers[shape])
        return self._steps[key]

    def _load(self, graph: GraphEntry):
        path = os.path.join(self.bundle_dir, graph.file)
        if not os.path.isfile(path):
            raise BundleError(f"graph file missing: {path}")
        try:
            return self._backend.load(path, os.path.join(self.bundle_dir, self.entry.weights),
                                      config=self.entry.session_config, int4_block=self.plan.int4_block)
        except PlacementError:  # a sound graph this device cannot run: say that, not "corrupt"
            raise
        except BackendError as e:
            raise BundleError(f"{graph.file} is corrupt or not a graph of this runtime ({e})") from None

    def _row_step(self, role: str, tokens: int, context: int) -> _RowStep:
        key = (role, tokens, context)
        if key not in self._row_steps:
            graph = self.entry.row_graph(role, tokens, context)
            session = self._load(graph)
            dims = self.entry.graph_dims(graph)
            _check_io(graph, dims, session)
            if (role, tokens) not in self._row_buffers:
                self._row_buffers[(role, tokens)] = _StepBuffers(dims, role, tokens, False)
            self._row_steps[key] = _RowStep(session, graph, self._row_buffers[(role, tokens)])
        return self._row_steps[key]

    @property
    def sessions(self) -> int:
        return len(self._steps) + len(self._row_steps)

    def warm(self, roles_tokens: list[tuple[str, int]], trees: list[int] = (), reach: int | None = None,
             start: int = 0) -> None:
        """Create (and validate) the sessions a run will need before it produces output: in the buckets from the
        one that holds `start` cache slots to the one that holds `reach` (every bucket when None). Each session
        holds memory of its own (onnxruntime's copies of a quantized graph's scales, the optimizer's graph), so
        a run does not load the graphs of buckets it cannot reach; one that does reach them still gets them."""
        buckets = self.entry.buckets()
        if reach is not None:
            first = next((i for i, b in enumerate(buckets) if b >= start), len(buckets) - 1)
            last = next((i for i, b in enumerate(buckets) if b >= reach), len(buckets) - 1)
            buckets = buckets[first:last + 1]
        for role, tokens, tree in [(r, t, False) for r, t in roles_tokens] + [(C.STEP, t, True) for t in trees]:
            for context in buckets:
                if self.entry.graph(role, tokens, context, tree):
                    self._step(role, tokens, context, tree)

    def warm_prefill(self, n: int) -> None:
        """Create the sessions that a prefill of n tokens into an empty cache runs: each graph of its plan in
        the bucket that run will use, and no other (the last graph, often a small tail, runs in one bucket)."""
        used, bucket = 0, self.cache.buckets[0]
        for role, T in self.prefill_plan(n, self.cache.capacity):
            bucket = self._bucket_for(role, T, bucket=bucket, used=used)
            self._step(role, T, bucket, False)
            used += min(T, n - used)

    # -- graph choice --------------------------------------------------------------------------------
    def _least(self, row: bool) -> int:
        """The smallest T whose steps compute the plan's fewest rows: a row graph computes T rows, a batch graph
        B*T."""
        return self.plan.min_rows if row else self._min_tokens

    def _usable(self, sizes: list[int], row: bool = False) -> list[int]:
        """The graph sizes T the plan runs (all but T=1 under two-row decode)."""
        return [t for t in sizes if t >= self._least(row)]

    def _widen(self, sizes: list[int] | None, row: bool = False) -> list[int] | None:
        """Sizes asked for, each raised to the smallest the plan allows (two-row decode: a one-token run pads
        into T=2)."""
        return None if sizes is None else [max(t, self._least(row)) for t in sizes]

    def use_steps(self, sizes: list[int] | None) -> list[int]:
        """Restrict runs to these step graphs (None: all). Every session holds a few MB of its own, so a
        run loads the few it needs (T=1 and T=gamma+1) and pads shorter steps into them. Under two-row decode
        (RowPlan.min_rows) T=1 stands for T=2."""
        self._step_sizes = self.steps_for(sizes)
        return self._step_sizes

    def steps_for(self, sizes: list[int] | None, row: bool = False) -> list[int]:
        """The step graphs `use_steps(sizes)` would restrict runs to; `row`: those a batch-1 bundle of the same
        export would, under this plan (a batch step of B rows at T=1 is no one-row product, a row's is)."""
        return _restrict(self._usable(self.entry.step_tokens(), row), self._widen(sizes, row))

    @property
    def step_sizes(self) -> list[int]:
        """The step graphs runs may use (use_steps)."""
        return self._step_sizes

    def padding_rows(self, n: int, sizes: list[int] | None = None) -> int:
        """Rows past n that the step running n tokens computes anyway: its graph's padding (under two-row
        decode a one-token step's second row; a chain shorter than the verify graph, since a run loads only
        T=1 and T=gamma+1). A proposal can fill them at no cost. `sizes`: the step graphs to choose from
        (default: those in use)."""
        graph = _smallest_fit(self._step_sizes if sizes is None else sizes, n, self.cache.free)
        return 0 if graph is None else graph - n

    def step_graph_for(self, n: int) -> int | None:
        """The smallest step graph in use that holds n tokens and fits in the free cache slots."""
        return _smallest_fit(self._step_sizes, n, self.cache.free)

    def prefill_plan(self, n: int, free: int | None = None) -> tuple[tuple[str, int], ...]:
        """The graph runs (role, T), in order, that put n tokens in the cache at the least estimated cost
        (runtime/prefill_plan.py), over the prefill graphs and the step graphs in use; a step graph's LM head
        is cheap at a few rows, and only the last run pads."""
        free = self.cache.free if free is None else free
        graphs = tuple([(C.PREFILL, t) for t in self._usable(self.entry.prefill_tokens())]
                       + [(C.STEP, t) for t in self._step_sizes])
        return plan_prefill(n, graphs, free - n)

    # -- running -------------------------------------------------------------------------------------
    def _bucket_for(self, role: str, T: int, tree: bool = False, bucket: int | None = None,
                    used: int | None = None, row: bool = False) -> int:
        """The smallest past length, at or above the active one, that has the graph and holds the cache plus
        all T slots of the step, padding included: a T > 1 graph places its rows at slots cache_len..+T-1.
        (bucket, used) stand in for the cache's own when planning ahead; `row`: a batch's row graph, `used`
        then being that row's length."""
        bucket = self.cache.bucket if bucket is None else bucket
        need = max(bucket, (self.cache.used if used is None else used) + T)
        buckets = self._graph_buckets.get((role, T, tree, row))
        if buckets is None:  # once per kind of graph: this runs before every step
            buckets = [b for b in self.cache.buckets
                       if (self.entry.row_graph(role, T, b) if row else self.entry.graph(role, T, b, tree))]
            self._graph_buckets[(role, T, tree, row)] = buckets
        return next(b for b in buckets if b >= need)

    def _execute(self, role: str, T: int, rows, tree: TreeLayout | None = None) -> _Step:
        """Run graph (role, T): row b feeds rows[b] (rows past len(rows), or empty, idle), padded to T, at its
        own cache length; each row's new K/V go after its valid entries (a tree's in step order)."""
        self.cache.use_bucket(self._bucket_for(role, T, tree is not None))
        step = self._step(role, T, self.cache.bucket, tree is not None)
        counts = [len(r) for r in rows] + [0] * (self.dims.batch - len(rows))
        for b, n in enumerate(counts):
            if n:
                step.input_ids[b, :n] = rows[b]
            step.input_ids[b, n:] = 0
            start = self.cache.length[b]
            step.position_ids[b] = np.arange(start, start + T)  # padding rows continue the positions
        if tree is not None:  # batch 1: node rows sit at their depth, see their ancestors only
            n = counts[0]
            step.position_ids[0, :n] = self.cache.length[0] + tree.depth
            step.step_mask[0] = np.eye(T, dtype=bool)  # padding rows see themselves only
            step.step_mask[0, :n, :n] = tree.sees
        elif step.step_mask is not None:  # a tree may have run in this graph last
            step.step_mask[:] = step.causal
        self._run(step.session)
        if self._logits_scale and step.logits is not None:  # the fed rows: callers read no others
            for b, n in enumerate(counts):
                if n:
                    snap_to_grid(step.logits[b, :n], self._logits_scale)
        self._count_lookups(sum(counts))
        self.cache.append(step.new_kv, counts)
        return step

    def _count_lookups(self, n: int) -> None:
        """A decode run fed n tokens, each an embedding row read from the mapped weights file: drop the mapped
        pages every LOOKUP_RELEASE_TOKENS tokens."""
        self._looked_up += n
        if self._looked_up >= LOOKUP_RELEASE_TOKENS:
            self.release_lookup_pages()

    def release_lookup_pages(self) -> None:
        """Drop the weights files' mapped pages (backend.release_lookup_pages). Runs read an embedding row per
        token from the mapped file, and each read maps the page cache around it (a large folio, up to 2 MB,
        on kernels that cache files in them); prefills drop them after each run, decode every
        LOOKUP_RELEASE_TOKENS tokens (one madvise; the next read faults its rows back from the page cache)."""
        self._backend.release_lookup_pages()
        self._looked_up = 0

    def _run(self, session) -> None:
        began = time.perf_counter()
        session.run()
        self.graph_seconds += time.perf_counter() - began
        self.graph_runs += 1

    def reserve(self, n: int, tree: bool = False) -> None:
        """Move the cache now to the bucket that a run of n tokens (a tree of n rows) will use (see
        SharedKVCache)."""
        T = self.tree_graph_for(n) if tree else self.step_graph_for(n)
        if T is not None:
            self.cache.use_bucket(self._bucket_for(C.STEP, T, tree))

    def run(self, tokens) -> np.ndarray:
        """Process tokens in one step graph; return their logits [n, V] (a view, valid until the next run)."""
        n = len(tokens)
        T = self.step_graph_for(n)
        if T is None:
            raise ValueError(f"no step graph holds {n} tokens in {self.cache.free} free cache slots")
        return self._execute(C.STEP, T, [tokens]).logits[0, :n]

    # -- token trees (runtime/tree.py) -------------------------------------------------------------------
    def use_trees(self, sizes: list[int] | None) -> list[int]:
        """Restrict tree runs to these tree graphs (None: all exported)."""
        self._tree_sizes = _restrict(self._usable(self.entry.tree_tokens()), sizes)
        return self._tree_sizes

    def tree_graph_for(self, n: int) -> int | None:
        """The smallest tree graph in use that holds n rows (root included) and fits in the free slots."""
        return _smallest_fit(self._tree_sizes, n, self.cache.free)

    def run_tree(self, tree: TreeLayout) -> np.ndarray:
        """Verify a token tree (root = the pending token, then the nodes) in one tree graph; returns logits
        [N+1, V]: row 0 after the root, row i+1 after node i. The cache grows by N+1 entries in step order;
        `commit_tree` keeps the accepted path."""
        if self.dims.batch != 1:
            raise ValueError("token trees run at batch 1")
        T = self.tree_graph_for(len(tree.tokens))
        if T is None:
            raise ValueError(f"no tree graph holds {len(tree.tokens)} rows in {self.cache.free} free cache slots")
        return self._execute(C.STEP, T, [tree.tokens], tree).logits[0, :len(tree.tokens)]

    def commit_tree(self, base: int, path: list[int]) -> None:
        """Keep the root and the accepted nodes (indices from the root down): node i's entries move from step
        slot base+1+i to base+depth, its slot in the committed sequence (only nodes off the first chain move)."""
        for depth, node in enumerate(path, start=1):
            if node + 1 != depth:
                self.cache.move_entry(base + 1 + node, base + depth)
        self.cache.set_length(base + 1 + len(path))

    def prefill(self, tokens) -> None:
        """Fill the cache with tokens along the plan of least cost; no logits are kept. After each run the
        weights files' mapped pages go (`release_lookup_pages`)."""
        done = 0
        for role, T in self.prefill_plan(len(tokens)):
            n = min(T, len(tokens) - done)
            self._execute(role, T, [tokens[done:done + n]])
            self.release_lookup_pages()
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

    def prefill_chunk(self, pending: list[list[int]]) -> list[int]:
        """One prefill run for the rows of a batch: row b puts the first tokens of pending[b] in its cache
        (empty, or past len(pending): idle), planned like `prefill` for the row with the most left. Returns
        how many tokens each row consumed."""
        role, T = self.prefill_plan(max(len(p) for p in pending))[0]
        rows = [list(p[:T]) for p in pending]
        self._execute(role, T, rows)
        self.release_lookup_pages()
        return [len(r) for r in rows]

    # -- one row of a batch, through the row prefill graphs (manifest version 3) ------------------------------
    @property
    def row_prefill_sizes(self) -> list[int]:
        """T of the row prefill graphs, largest first; empty when the bundle has none (batch 1, or version 2)."""
        return self._usable(self.entry.row_prefill_tokens(), row=True)

    def warm_rows(self, steps: bool = False) -> None:
        """Create the row prefill sessions of every bucket and, with `steps`, the row step sessions of the step
        sizes in use (`row_step_sizes`)."""
        graphs = [(C.PREFILL, t) for t in self.row_prefill_sizes] + [(C.STEP, t) for t in self.row_step_sizes if steps]
        for context in self.entry.buckets():
            for role, t in graphs:
                if self.entry.row_graph(role, t, context):
                    self._row_step(role, t, context)

    def prefill_row(self, row: int, tokens: list[int]) -> int:
        """Put the first tokens of `tokens` in row `row`'s cache with one run of a batch-1 prefill graph (the
        first run of the row's prefill plan, see `prefill_plan`); the other rows are untouched. Returns how
        many."""
        start = int(self.cache.length[row])
        free = self.cache.capacity - start
        want = min(len(tokens), free)
        T = plan_prefill(want, tuple((C.PREFILL, t) for t in self.row_prefill_sizes), free - want)[0][1]
        n = min(T, len(tokens))
        self._run_row_graph(C.PREFILL, T, row, tokens[:n])
        self.release_lookup_pages()
        return n

    def _run_row_graph(self, role: str, T: int, row: int, tokens: list[int]) -> _RowStep:
        """One run of row graph (role, T) on row `row` alone, its new K/V stored after the row's valid entries."""
        n, start = len(tokens), int(self.cache.length[row])
        self.cache.use_bucket(self._bucket_for(role, T, used=start, row=True))
        step = self._row_step(role, T, self.cache.bucket)
        step.bind(self.cache, row)
        step.input_ids[0, :n] = tokens
        step.input_ids[0, n:] = 0
        step.position_ids[0] = np.arange(start, start + T)
        self._run(step.session)
        if self._logits_scale and step.logits is not None:
            snap_to_grid(step.logits[0, :n], self._logits_scale)
        self.cache.append_row(row, step.new_kv, n)
        return step

    @property
    def row_step_sizes(self) -> list[int]:
        """T of the row step graphs that lone rows use: those of the step graphs in use (`use_steps`), when the
        bundle has one for each (version 4); else none, and a lone row runs in the batch's step graphs. Their
        sessions are made on first use, in the buckets and widths lone rows reach: each holds about 6 MB of
        its own (SmolLM2 int4), and a batch of rows that never runs alone needs none of them."""
        rows, sizes = self._row_step_tokens, set(self._widen(self._step_sizes, row=True))
        return sorted(sizes) if rows and rows.issuperset(sizes) else []

    def row_fits(self, row: int) -> bool:
        """Whether row `row` can run alone: the bundle has row step graphs and the smallest fits in its free slots
        (under two-row decode it needs a slot for its padding row; a batch step then computes it with the rest)."""
        sizes = self.row_step_sizes
        return bool(sizes) and sizes[0] <= self.cache.capacity - int(self.cache.length[row])

    def row_step_width(self, row: int, n: int) -> int | None:
        """T of the row step graph that runs n tokens of row `row` alone (run_row)."""
        return _smallest_fit(self.row_step_sizes, n, self.cache.capacity - int(self.cache.length[row]))

    def run_row(self, row: int, tokens: list[int]) -> np.ndarray:
        """One step for row `row` alone, through the smallest row step graph that holds the tokens (a batch step
        computes every row, idle ones included): the other rows' caches are untouched. Returns logits [T, V]
        (a view, valid until the next run; rows past len(tokens) are padding)."""
        T = self.row_step_width(row, len(tokens))
        if T is None:
            raise ValueError(f"no row step graph holds {len(tokens)} tokens in row {row}'s free cache slots")
        step = self._run_row_graph(C.STEP, T, row, tokens)
        self._count_lookups(len(tokens))
        return step.logits[0]

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
        for step in list(self._steps.values()) + list(self._row_steps.values()):
            step.session.close()
        self._steps.clear()
        self._step_buffers.clear()
        self._row_steps.clear()


def snap_to_grid(logits: np.ndarray, scale: float) -> None:
    """Put logits that a graph computed as uint16 levels and dequantized (q - zero_point) * scale back onto that
    grid, in place. The emulated HTP dequantizes the same levels of a step of 8 or more rows a float32 ulp or two
    away from a one-token step's; snapped, equal levels are equal floats in every step, and a greedy argmax breaks
    a tie of levels the same way in a verify step as in decode."""
    np.multiply(logits, np.float32(1 / scale), out=logits)  # in place: no [T, V] temporaries per step
    np.rint(logits, out=logits)
    np.multiply(logits, np.float32(scale), out=logits)


def _restrict(available: list[int], sizes: list[int] | None) -> list[int]:
    return sorted(set(sizes) & set(available)) if sizes is not None else available


def _smallest_fit(sizes: list[int], n: int, free: int) -> int | None:
    fits = [t for t in sizes if n <= t <= free]
    return min(fits) if fits else None


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
