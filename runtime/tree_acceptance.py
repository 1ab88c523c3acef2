"""Which nodes of a token tree to keep: exact verification of several candidate continuations at once.

A tree proposal is N nodes with a token and a parent each; the pending token is the root (row 0). The
target scores every node in one step (each node sees its ancestors) and gives N+1 rows:

  row 0      the target's distribution after the root
  row i + 1  its distribution after node i (so the rows of a node's children are judged by row parents[i])

parents[i] is 0 for a child of the root and j + 1 for a child of node j; parents come before children
(parents[i] <= i). A round accepts a path of nodes from the root down and emits their tokens plus one token
of the target's own (the recovered token where the path stops among rejected children, or the bonus token
after a leaf), exactly as the chain rules of acceptance.py do for a tree that is a single chain.

Sampling (SpecInfer, Miao et al. 2024: multi-candidate speculative sampling). At a node with target
distribution r, its children are tried in index order. A child c drawn from q_c (draft_probs[c]; siblings
drawn independently) is accepted with probability min(1, r(x_c) / q_c(x_c)); on rejection r becomes
norm(max(r - q_c, 0)), the target's distribution given that this child was not taken. Each try is one
exact speculative step of r against q_c, so whatever stops the scan, the emitted token follows r. With
deterministic candidates (draft_probs None: point masses) a try accepts with probability r(x_c), and a
rejection zeroes r(x_c) and renormalizes. When every child is rejected, the recovered token is sampled from
the last r. The residual edge cases (zero draft probability, a residual that is only rounding noise) are
handled as in acceptance.py.

Greedy: follow the target's argmax from the root; at each node take the first child whose token is the
argmax of that node's row. That is the longest root-to-leaf path whose tokens all equal the target's argmax,
and the next token is the argmax of the row where it stops (lowest id on ties).
"""
from __future__ import annotations

import numpy as np

from .acceptance import _RESIDUAL_EPS, _cumsum
from .sampling import _sample_cdf, greedy_tokens


def _check_tree(tokens, parents, rows: np.ndarray, name: str, draft_probs=None):
    """Validate a tree; returns (tokens list, children lists per row, rows, draft_probs)."""
    tokens = np.asarray(tokens)
    parents = np.asarray(parents)
    if tokens.ndim != 1 or parents.shape != tokens.shape or (tokens.size and (tokens.dtype.kind not in "iu"
                                                                               or parents.dtype.kind not in "iu")):
        raise ValueError(f"tokens and parents must be 1-D int arrays [N] of one length, got {tokens.shape} "
                         f"{tokens.dtype} and {parents.shape} {parents.dtype}")
    n = tokens.size
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[0] != n + 1 or rows.shape[1] == 0:
        raise ValueError(f"{name} must be [N+1, V] = [{n + 1}, V] for N={n} nodes, got shape {rows.shape}")
    v = rows.shape[1]
    if draft_probs is not None:
        draft_probs = np.asarray(draft_probs)
        if draft_probs.shape != (n, v) and not (n == 0 and draft_probs.size == 0):
            raise ValueError(f"draft_probs must be [N, V] = [{n}, {v}] to match {name}, got {draft_probs.shape}")
    toks, pars = tokens.tolist(), parents.tolist()
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for i, (t, p) in enumerate(zip(toks, pars)):
        if not 0 <= t < v:
            raise ValueError(f"tokens must be in [0, V={v}), got {t} at node {i}")
        if not 0 <= p <= i:
            raise ValueError(f"parents[{i}] = {p}: a parent is 0 (the root) or j + 1 for an earlier node j < {i}")
        children[p].append(i)
    return toks, children, rows, draft_probs


def accept_tree_greedy(tokens, parents, target_logits) -> tuple[list[int], int]:
    """Greedy tree verification.

    tokens         int   [N]       node tokens (N may be 0)
    parents        int   [N]       0: child of the root; j + 1: child of node j
    target_logits  float [N+1, V]  row 0 after the root, row i + 1 after node i
    returns (path, next_token): the accepted node indices from the root down, and the argmax of the row
    where the path stops (the bonus token after a leaf, the recovered token otherwise).
    """
    toks, children, logits, _ = _check_tree(tokens, parents, target_logits, "target_logits")
    argmax = greedy_tokens(logits)  # [N+1]
    path, row = [], 0
    while True:
        nxt = next((c for c in children[row] if toks[c] == argmax[row]), None)
        if nxt is None:
            return path, int(argmax[row])
        path.append(nxt)
        row = nxt + 1


def accept_tree(tokens, parents, target_probs, draft_probs, rng: np.random.Generator) -> tuple[list[int], int]:
    """Exact tree verification by multi-candidate speculative sampling (module notes).

    tokens        int   [N]       node tokens
    parents       int   [N]       0: child of the root; j + 1: child of node j
    target_probs  float [N+1, V]  p: row 0 after the root, row i + 1 after node i
    draft_probs   float [N, V]    the distribution node i was drawn from, or None for deterministic candidates
    rng           only rng.random() is called: once per tried child, once for next_token
    returns (path, next_token) as accept_tree_greedy; next_token follows the target's distribution given
    the accepted path.
    """
    toks, children, p, q = _check_tree(tokens, parents, target_probs, "target_probs", draft_probs)
    path, row = [], 0
    while True:
        r = p[row]
        accepted = None
        for c in children[row]:
            x = toks[c]
            q_x = 1.0 if q is None else q[c, x]
            if rng.random() * q_x < r[x]:  # u < r/q without a division (acceptance.py's edge cases)
                accepted = c
                break
            if q is None:  # max(r - onehot(x), 0): r with x zeroed
                residual = np.array(r, dtype=np.float64)
                residual[x] = 0.0
            else:
                residual = np.maximum(r - q[c], 0.0)
            total = residual.sum()
            if total <= _RESIDUAL_EPS:  # rounding noise: keep r (acceptance.py's fallback to p)
                continue
            r = residual / total
        if accepted is None:
            return path, _sample_cdf(_cumsum(r), rng)
        path.append(accepted)
        row = accepted + 1
