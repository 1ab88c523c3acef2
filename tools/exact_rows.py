"""Position consistency of a model's step graphs: the property greedy speculation's exactness rests on.

A T-token step (verify, prefill) must compute each row t bit for bit as T one-token decode steps compute the
same tokens, one after another, at slots cache_len + t. Otherwise a verify step can pick another argmax than
plain decode at a near tie, and "speculative output equals plain output" fails; with int8 activations
(quantized bundles) such last-bit differences grow to whole quantization steps and the ties stop being rare.

The check drives the graphs through the contract with the runtime's own backend, from a past of random K/V
and random tokens: for every T > 1 graph, one T-token run against T one-token runs in the same bucket
(logits and new K/V compared bitwise), and the one-token graph of every bucket against the smallest bucket.
Decode runs as the runtime runs it on this machine (runtime/kernel_probe.py, RowPlan): where each decoded token
is a two-row step with a padding row, the one-token runs are T=2 runs of one token, and the T=1 graphs, which
the runtime does not run there, are left out.
A tree graph (step_mask) also runs a spine-plus-leaves token tree, each row against one-token runs along its
path from the root (the trees the runtime verifies; docs/bundle.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..graphs import contract as C
from ..graphs.manifest import GraphEntry, ModelEntry, read_index, weights_index_file
from ..runtime.backends import trim_heap
from ..runtime.kernel_probe import RowPlan
from ..runtime.model import snap_to_grid
from ..runtime.tree import TreeLayout, spine_and_leaves


@dataclass
class RowsResult:
    graph: GraphEntry
    reference: str  # what the graph's rows were compared with
    max_diff: float  # largest |difference| over logits and new K/V; 0.0 is the requirement
    cache_diff: float  # the same over the new K/V alone
    tree: bool = False  # the graph ran a token tree (step_mask), not a chain

    @property
    def exact(self) -> bool:
        return self.max_diff == 0.0


def _session_key(graph: GraphEntry) -> tuple:
    return graph.role, graph.tokens, graph.context, graph.step_mask, graph.batch


# Stale slots hold large values, so that a graph that lets them through differs visibly. In float16, keys of 1e4
# overflow a query's dot product (|score| > 65504), and the mask's -65504 cannot hide a non-finite score: in a
# probe of SmolLM2's layer 20 the hidden slots took most of the softmax, in the tree step and in decode alike, and
# the rows compared were garbage that the HTP did not round the same way at every T. A runtime's stale slots
# hold earlier entries of the model's own scale; 16 keeps SmolLM2's scores finite and the masked ones near -65504.
STALE_FLOAT16 = 16.0


class GraphDriver:
    """The contract's host side for one model: a cache per bucket, and `run(graph, tokens, start)`."""

    def __init__(self, bundle: str, model: ModelEntry, backend, seed: int = 0, logits_scale: float | None = None,
                 plan: RowPlan = RowPlan()):
        self.bundle, self.model, self.backend, self.dims = bundle, model, backend, model.dims
        self.plan = plan  # how the runtime loads and feeds the graphs on this backend
        self.logits_scale = logits_scale  # qnn-qdq16: logits are compared on the grid the runtime snaps them onto
        self.weights = os.path.join(bundle, model.weights)
        backend.add_weights_file(self.weights, read_index(os.path.join(bundle, weights_index_file(model.weights))))
        self.rng = np.random.default_rng(seed)
        self.sessions = {}

    def fresh_cache(self, context: int, valid: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V [L, B, H_kv, context, D]: random history in the first `valid` slots, garbage after."""
        d = self.dims
        shape = (d.num_layers, d.batch, d.num_kv_heads, context, d.head_dim)
        keys = self.rng.standard_normal(shape).astype(d.dtype)
        values = self.rng.standard_normal(shape).astype(d.dtype)
        stale = 1e4 if np.dtype(d.dtype).itemsize >= 4 else STALE_FLOAT16
        keys[:, :, :, valid:] = stale  # stale slots: must not matter
        values[:, :, :, valid:] = -stale
        return keys, values

    def run(self, graph: GraphEntry, keys, values, tokens: np.ndarray, start: int,
            tree: TreeLayout | None = None) -> dict:
        """One run of `graph` on tokens [B, n] at slots start.., writing the new K/V of the n rows into
        keys/values and returning the n rows' outputs; n < T pads with token 0, as the runtime does. A row graph
        (batch 1) runs on the first row only. A graph with step_mask runs a chain (the causal mask), or `tree`
        (its T rows: positions start + depth, each row seeing its ancestors)."""
        d, T = self.model.graph_dims(graph), graph.tokens
        tokens, B = tokens[: d.batch], d.batch
        n = tokens.shape[1]
        tokens = np.pad(tokens, ((0, 0), (0, T - n)))
        key = _session_key(graph)
        if key not in self.sessions:
            self.sessions[key] = self.backend.load(os.path.join(self.bundle, graph.file), self.weights,
                                                   prepack=True, config=self.model.session_config,
                                                   int4_block=self.plan.int4_block)
        depth = np.arange(T) if tree is None else tree.depth
        feeds = {C.INPUT_IDS: np.ascontiguousarray(tokens, dtype=np.int64),
                 C.POSITION_IDS: np.broadcast_to(start + depth, (d.batch, T)).copy(),
                 C.CACHE_LEN: np.full(d.batch, start, np.int64)}
        for i in range(d.num_layers):
            feeds[C.past_key(i)] = np.ascontiguousarray(keys[i, :B])
            feeds[C.past_value(i)] = np.ascontiguousarray(values[i, :B])
        if graph.step_mask:
            sees = np.tril(np.ones((T, T), bool)) if tree is None else tree.sees
            feeds[C.STEP_MASK] = np.broadcast_to(sees, (d.batch, T, T)).copy()
        outputs = {s.name: np.empty(s.shape, s.dtype) for s in C.step_outputs(d, T, graph.role)}
        session = self.sessions[key]
        session.bind(feeds, outputs)
        session.run()
        if self.logits_scale is not None and C.LOGITS in outputs:  # prefill graphs return no logits
            snap_to_grid(outputs[C.LOGITS], self.logits_scale)
        if n < T:
            outputs = {k: v[:, :n] if k == C.LOGITS else v[:, :, :n] for k, v in outputs.items()}
        for i in range(d.num_layers):
            keys[i, :B, :, start:start + n] = outputs[C.new_key(i)]
            values[i, :B, :, start:start + n] = outputs[C.new_value(i)]
        return outputs

    def release(self, graph: GraphEntry) -> None:
        """Close `graph`'s session once its rows are compared: on the emulated HTP each session holds its own
        compiled graph (a check of a 7-graph SmolLM2 qnn-fp16 bundle peaked at 3.08 GB with every session open,
        2.80 GB releasing them)."""
        session = self.sessions.pop(_session_key(graph), None)
        if session is not None:
            session.close()
            trim_heap()  # else glibc keeps the freed pages

    def close(self):
        for s in self.sessions.values():
            s.close()


def _result(graph: GraphEntry, reference: str, got: dict, want: dict, tree: bool = False) -> RowsResult:
    cache = {k: v for k, v in got.items() if k != C.LOGITS}
    return RowsResult(graph, reference, max_abs_diff(got, want), max_abs_diff(cache, want), tree)


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest |a[k] - b[k]| over the arrays both dicts name, in float64."""
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) for k in a.keys() & b.keys())


def one_token_steps(model: ModelEntry, tokens: int = 1) -> dict[int, GraphEntry]:
    """The step graph the runtime decodes with, per bucket: the causal one, or the masked one in a bundle
    exported with --step-mask, where every step graph takes a mask (the driver feeds it the causal one). `tokens`:
    its T, 2 where decode feeds one token and a padding row (RowPlan.min_tokens)."""
    decode: dict[int, GraphEntry] = {}
    for g in model.batch_graphs:
        if g.role == C.STEP and g.tokens == tokens and (g.context not in decode or decode[g.context].step_mask):
            decode[g.context] = g
    return decode


def tree_rows(driver: GraphDriver, graph: GraphEntry, decode: GraphEntry, start: int) -> RowsResult:
    """A tree graph's rows for a branching tree against one-token decode steps along each row's ancestors: row
    i is computed at position start + depth(i) over the past and its ancestors' entries, which decode finds at
    slots start .. start + depth(i) - 1."""
    T, S = graph.tokens, graph.context
    tokens = driver.rng.integers(0, driver.dims.vocab_size, T)
    tree = TreeLayout.build(tokens[0], tokens[1:].tolist(), spine_and_leaves(T - 1))
    keys, values = driver.fresh_cache(S, start)
    past = keys.copy(), values.copy()
    whole = driver.run(graph, keys, values, tokens[None], start, tree)
    rows = []
    for i in range(T):
        k1, v1 = past[0].copy(), past[1].copy()
        path = np.flatnonzero(tree.sees[i])  # the root, the ancestors, the row itself: slot order is depth order
        for j, node in enumerate(path):
            out = driver.run(decode, k1, v1, tokens[None, node:node + 1], start + j)
        rows.append(out)
    stacked = {name: np.concatenate([r[name] for r in rows], axis=2 if name != C.LOGITS else 1) for name in whole}
    return _result(graph, f"a tree of {T} rows (spine and leaves) against one-token steps along each path, S={S}",
                   whole, stacked, tree=True)


def check_model_rows(bundle: str, model: ModelEntry, backend, seed: int = 0,
                     logits_scale: float | None = None, plan: RowPlan = RowPlan()) -> list[RowsResult]:
    """Every T > 1 graph (and a batch model's T=1 row graph) against one-token steps in its bucket, and every
    bucket's one-token graph against the smallest bucket's. Each T-token run starts T + 3 slots before its
    bucket's end, so the comparison covers the whole slot range the bucket's reductions run over.
    `logits_scale`: the manifest's logits grid (qnn-qdq16), which the runtime snaps logits onto; the rows are
    compared as the runtime reads them. `plan`: how the runtime loads the graphs and decodes on this backend
    (kernel_probe.row_plan); graphs it does not run (T=1 under two-row decode) are left out."""
    d = model.dims
    driver = GraphDriver(bundle, model, backend, seed, logits_scale, plan)
    least = plan.min_tokens(d.batch)
    decode = one_token_steps(model, least)
    results = []
    try:
        for graph in model.graphs:
            row = graph.batch is not None  # a row step graph of T=1 is compared too
            unused = graph.tokens < (plan.min_rows if row else least)
            if (unused or (graph.tokens == 1 and not row) or graph.context not in decode
                    or graph.tokens + 3 > graph.context):
                continue
            T, S = graph.tokens, graph.context
            start = S - T - 3
            tokens = driver.rng.integers(0, d.vocab_size, (d.batch, T))
            keys, values = driver.fresh_cache(S, start)
            k1, v1 = keys.copy(), values.copy()
            whole = driver.run(graph, keys, values, tokens, start)
            rows = [driver.run(decode[S], k1, v1, tokens[:, t:t + 1], start + t) for t in range(T)]
            B = model.graph_dims(graph).batch  # a row graph is compared with the first row of the batch's steps
            stacked = {name: np.concatenate([r[name][:B] for r in rows], axis=2 if name != C.LOGITS else 1)
                       for name in whole}
            results.append(_result(graph, f"{T} one-token steps, S={S}", whole, stacked))
            if graph.step_mask and d.batch == 1:
                results.append(tree_rows(driver, graph, decode[S], start))
            driver.release(graph)
        smallest = min(decode)
        start = smallest - 5
        tokens = driver.rng.integers(0, d.vocab_size, (d.batch, 1))
        base_k, base_v = driver.fresh_cache(smallest, start)
        reference = driver.run(decode[smallest], base_k.copy(), base_v.copy(), tokens, start)
        for S, graph in sorted(decode.items()):
            if S == smallest:
                continue
            keys, values = driver.fresh_cache(S, start)
            keys[:, :, :, :start], values[:, :, :, :start] = base_k[:, :, :, :start], base_v[:, :, :, :start]
            out = driver.run(graph, keys, values, tokens, start)
            driver.release(graph)
            results.append(_result(graph, f"one-token step, S={smallest}", out, reference))
    finally:
        driver.close()
    return results
