"""specedge.runtime.tree_acceptance: tree verification keeps the target distribution exactly, and greedy
takes the longest path of argmax tokens. The oracles are the target rows themselves: the first committed
token must follow row 0, and, given that the path starts at node c, the next committed token row c + 1."""
from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest

from specedge.runtime.acceptance import accept_greedy, accept_sampling
from specedge.runtime.sampling import sample_token
from specedge.runtime.tree_acceptance import accept_tree, accept_tree_greedy


class GridRng:
    """Stands in for np.random.Generator: random() returns the scripted values in order; leftovers are fine
    (a rule that stops early simply does not look at them)."""

    def __init__(self, values):
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def committed(path, next_token, tokens) -> list[int]:
    return [tokens[i] for i in path] + [next_token]


# --- exact enumeration, deterministic candidates ------------------------------------------------------------
# root -> node 0 (token 0) -> node 2 (token 2); root -> node 1 (token 1). Every probability is a multiple of
# 1/8, so with three uniforms (the most a round here can draw) on a grid of 8 cells each, every decision of
# the rule is constant on a cell and the midpoints integrate it exactly.
D_TOKENS, D_PARENTS = [0, 1, 2], [0, 0, 1]
D_ROWS = [["1/2", "1/4", "1/8", "1/8"],  # after the root
          ["1/4", "1/4", "1/2", "0"],  # after node 0 (rejecting node 2 leaves the residual [1/2, 1/2, 0, 0])
          ["1/8", "3/8", "1/2", "0"],  # after node 1
          ["3/4", "0", "1/8", "1/8"]]  # after node 2
GRID = 8


def enumerate_round(rule):
    """Exact joint law of (first committed token, second committed token, first node of the path)."""
    p = np.array([[float(Fraction(x)) for x in row] for row in D_ROWS])
    law: dict[tuple, Fraction] = {}
    for cells in itertools.product(range(GRID), repeat=3):
        path, nxt = rule(np.array(D_TOKENS), np.array(D_PARENTS), p, None, GridRng((c + 0.5) / GRID for c in cells))
        out = committed(path, nxt, D_TOKENS)
        key = (out[0], out[1] if len(out) > 1 else None, path[0] if path else None)
        law[key] = law.get(key, Fraction(0)) + Fraction(1, GRID**3)
    return law


def marginal(law, select):
    out: dict = {}
    for key, w in law.items():
        k = select(key)
        if k is not None:
            out[k] = out.get(k, Fraction(0)) + w
    return out


def no_zeroing_rule(tokens, parents, target_probs, draft_probs, rng):
    """The tempting wrong rule: every sibling is tried against the node's own row, never a residual."""
    toks, pars = list(tokens), list(parents)
    path, row = [], 0
    while True:
        kids = [i for i, p in enumerate(pars) if p == row]
        c = next((c for c in kids if rng.random() < target_probs[row][toks[c]]), None)
        if c is None:
            return path, sample_token(target_probs[row], rng)
        path.append(c)
        row = c + 1


def test_deterministic_tree_is_exact_by_enumeration():
    law = enumerate_round(accept_tree)
    rows = [[Fraction(x) for x in row] for row in D_ROWS]
    first = marginal(law, lambda k: k[0])
    assert first == {t: w for t, w in enumerate(rows[0]) if w}
    for node in (0, 1):  # given the path starts at node c, the next token follows row c + 1
        joint = marginal(law, lambda k: k[1] if k[2] == node else None)
        total = sum(joint.values())
        assert total == rows[0][D_TOKENS[node]]
        assert {t: w / total for t, w in joint.items()} == {t: w for t, w in enumerate(rows[node + 1]) if w}


def test_trying_siblings_against_the_unchanged_row_is_biased():
    first = marginal(enumerate_round(no_zeroing_rule), lambda k: k[0])
    assert first != {t: Fraction(w) for t, w in enumerate(D_ROWS[0]) if Fraction(w)}


# --- Monte Carlo, sampled siblings --------------------------------------------------------------------------
V = 6
DRAWS = 100_000
TOL = 0.01  # >= 6 standard deviations of a frequency at 100k draws


def sampled_tree(rng, q_root, q_inner):
    """Three children of the root drawn i.i.d. from q_root, two children of node 0 drawn i.i.d. from q_inner."""
    tokens = [sample_token(q_root, rng) for _ in range(3)] + [sample_token(q_inner, rng) for _ in range(2)]
    parents = [0, 0, 0, 1, 1]
    draft = np.stack([q_root] * 3 + [q_inner] * 2)
    return np.array(tokens), np.array(parents), draft


def residual_free_rule(tokens, parents, target_probs, draft_probs, rng):
    """Wrong: each sampled sibling judged by min(1, p/q) against the node's own row, never the residual."""
    toks, pars = list(tokens), list(parents)
    path, row = [], 0
    while True:
        kids = [i for i, p in enumerate(pars) if p == row]
        c = next((c for c in kids if rng.random() * draft_probs[c][toks[c]] < target_probs[row][toks[c]]), None)
        if c is None:
            last = kids[-1] if kids else None
            r = np.maximum(target_probs[row] - draft_probs[last], 0) if last is not None else target_probs[row]
            return path, sample_token(r if r.sum() > 0 else target_probs[row], rng)
        path.append(c)
        row = c + 1


def monte_carlo(rule, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V) * 0.7, size=6)  # rows: root, nodes 0..4
    q_root, q_inner = rng.dirichlet(np.ones(V) * 0.7), rng.dirichlet(np.ones(V) * 0.7)
    first = np.zeros(V)
    second_after_node0 = np.zeros(V)
    rejected_all = 0
    for _ in range(DRAWS):
        tokens, parents, draft = sampled_tree(rng, q_root, q_inner)
        path, nxt = rule(tokens, parents, p, draft, rng)
        out = committed(path, nxt, tokens.tolist())
        first[out[0]] += 1
        if path and path[0] == 0:
            second_after_node0[out[1]] += 1
        rejected_all += not path
    return p, first / DRAWS, second_after_node0 / second_after_node0.sum(), rejected_all


def test_sampled_tree_keeps_the_target_distribution():
    p, first, second, rejected_all = monte_carlo(accept_tree)
    assert np.abs(first - p[0]).max() < TOL
    assert np.abs(second - p[1]).max() < TOL
    assert rejected_all > DRAWS // 50  # the all-rejected branch (residual sampling) really ran


def test_judging_siblings_without_the_residual_is_biased():
    p, first, _, _ = monte_carlo(residual_free_rule)
    assert np.abs(first - p[0]).max() > 3 * TOL


# --- a chain is the chain rule ---------------------------------------------------------------------------
def test_a_chain_tree_is_the_chain_rule():
    rng = np.random.default_rng(3)
    for k in range(6):
        p = rng.dirichlet(np.ones(V), size=k + 1)
        q = rng.dirichlet(np.ones(V), size=k)
        toks = np.array([sample_token(q[j], rng) for j in range(k)], dtype=np.int64)
        parents = np.arange(k)  # node j's parent is node j-1 (row j), the first's the root
        for seed in range(20):
            n, tok = accept_sampling(toks, q if k else None, p, np.random.default_rng(seed))
            path, nxt = accept_tree(toks, parents, p, q if k else None, np.random.default_rng(seed))
            assert (path, nxt) == (list(range(n)), tok)
        logits = rng.standard_normal((k + 1, V))
        n, tok = accept_greedy(toks, logits)
        assert accept_tree_greedy(toks, parents, logits) == (list(range(n)), tok)


# --- greedy -------------------------------------------------------------------------------------------------
def test_greedy_takes_the_longest_argmax_path():
    # root -> a(5) -> c(7) -> d(1);  root -> b(3) -> e(2).  Argmax: root 3, b 2, e 4.
    tokens, parents = [5, 3, 7, 2, 1], [0, 0, 1, 2, 3]
    logits = np.zeros((6, 8))
    logits[0, 3] = logits[2, 2] = logits[4, 4] = 1.0
    assert accept_tree_greedy(tokens, parents, logits) == ([1, 3], 4)  # b, e, then the bonus after leaf e
    logits[4] = 0
    logits[4, 0] = logits[4, 6] = 1.0  # a tie after e: the lowest id
    assert accept_tree_greedy(tokens, parents, logits) == ([1, 3], 0)
    logits[0] = 0
    logits[0, 6] = 1.0  # no child of the root matches: the recovered token from row 0
    assert accept_tree_greedy(tokens, parents, logits) == ([], 6)


def test_duplicate_siblings_are_each_tried_once():
    tokens, parents = [4, 4, 2], [0, 0, 0]
    p = np.zeros((4, 5))
    p[0] = [0.0, 0.0, 0.5, 0.0, 0.5]
    p[1:] = 0.2
    # u = 0.9 rejects the first 4 (0.9 >= 0.5); the residual zeroes 4, so the second 4 is rejected for any u;
    # the 2 then has r = 1 and is accepted; u = 0.1 samples the bonus from row 3.
    path, nxt = accept_tree(np.array(tokens), np.array(parents), p, None, GridRng([0.9, 0.0, 0.99, 0.1]))
    assert path == [2] and nxt == 0


@pytest.mark.parametrize("tokens,parents,rows,match", [
    ([1, 2], [0, 2], (3, 4), "parents\\[1\\] = 2"),
    ([1, 2], [0, 0], (2, 4), "N\\+1, V"),
    ([1, 9], [0, 0], (3, 4), "tokens must be in"),
    ([1], [0, 0], (2, 4), "one length"),
])
def test_bad_trees_are_refused(tokens, parents, rows, match):
    with pytest.raises(ValueError, match=match):
        accept_tree_greedy(np.array(tokens), np.array(parents), np.zeros(rows))
    with pytest.raises(ValueError, match=match):
        accept_tree(np.array(tokens), np.array(parents), np.full(rows, 1 / rows[1]), None, GridRng([0.5] * 9))
