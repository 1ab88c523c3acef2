"""specedge.runtime.acceptance: the emitted tokens follow the target exactly, and greedy matches argmax."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.runtime.acceptance import accept_greedy, accept_sampling, output_distribution
from specedge.runtime.sampling import sample_token

U_MAX = 1.0 - 2.0**-53  # the largest value Generator.random() returns
DRAWS = 200_000
TOL = 0.01  # ~9 standard deviations of a frequency at 200k draws


class ScriptedRng:
    """Stands in for np.random.Generator: random() returns the scripted values, in order, and no more."""

    def __init__(self, *values: float):
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


# --- the 3-token example, by exact enumeration ------------------------------------------------------------

P3 = ["0.5", "0.3", "0.2"]
Q3 = ["0.2", "0.5", "0.3"]
GRID = 30  # every threshold below (p/q = 3/5, 2/3; p's cdf 1/2, 4/5) is a multiple of 1/30


def enumerate_first_token(rule, P=P3, Q=Q3, grid=GRID) -> list[Fraction]:
    """Exact distribution of the first emitted token of a one-draft round, through `rule` itself.

    The rule sees two uniforms: u1 decides acceptance, u2 samples next_token. Both are piecewise constant
    in u with breakpoints (p/q, the cdfs of p and of the residual) on multiples of 1/grid, so the midpoints
    of the grid cells, each of measure 1/grid, integrate them exactly.
    """
    p = np.array([float(x) for x in P])
    q = np.array([float(x) for x in Q])
    target = np.stack([p, p])
    dist = [Fraction(0)] * len(P)
    for x, qx in enumerate(Q):
        for i in range(grid):
            for j in range(grid):
                rng = ScriptedRng((i + 0.5) / grid, (j + 0.5) / grid)
                n, token = rule(np.array([x]), q[None], target, rng)
                assert rng.values == [], "one draw to judge the draft, one for next_token"
                first = x if n == 1 else token
                dist[first] += Fraction(qx) / grid**2
    return dist


def resample_from_p_on_rejection(draft_tokens, draft_probs, target_probs, rng):
    """The tempting wrong rule: the same acceptance test, but a rejection redraws from p, not from
    max(p - q, 0)."""
    d = int(draft_tokens[0])
    if rng.random() * draft_probs[0, d] < target_probs[0, d]:
        return 1, sample_token(target_probs[1], rng)
    return 0, sample_token(target_probs[0], rng)


def test_three_token_example_is_exact():
    assert enumerate_first_token(accept_sampling) == [Fraction("0.5"), Fraction("0.3"), Fraction("0.2")]


def test_three_token_example_branches():
    # x=0: p/q = 2.5, always accepted; x=1: accepted iff u < 3/5; x=2: accepted iff u < 2/3
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.5, 0.3])
    target = np.stack([p, p])
    for x, accepted_cells in [(0, GRID), (1, 18), (2, 20)]:
        n_accepted = [accept_sampling(np.array([x]), q[None], target, ScriptedRng((i + 0.5) / GRID, 0.5))[0]
                      for i in range(GRID)]
        assert sum(n_accepted) == accepted_cells
    # the rejection probability 0.5 * 2/5 + 0.3 * 1/3 = 0.3 all goes to max(p - q, 0) = [0.3, 0, 0]
    for u2 in (0.0, 0.5, U_MAX):
        assert accept_sampling(np.array([1]), q[None], target, ScriptedRng(U_MAX, u2)) == (0, 0)


def test_resampling_from_p_on_rejection_is_biased():
    wrong = enumerate_first_token(resample_from_p_on_rejection)
    assert wrong == [Fraction("0.35"), Fraction("0.39"), Fraction("0.26")]
    assert wrong != [Fraction(x) for x in P3]


# Residuals spread over several tokens: norm(max(p - q, 0)) = [3/4, 1/4, 0, 0] and [2/5, 2/5, 1/5, 0, 0].
# Every breakpoint (p/q, the cdfs of p and of the residual) is a multiple of 1/60.
SPREAD = [(["0.4", "0.3", "0.2", "0.1"], ["0.1", "0.2", "0.3", "0.4"]),
          (["0.3", "0.3", "0.2", "0.1", "0.1"], ["0.1", "0.1", "0.1", "0.3", "0.4"])]


@pytest.mark.parametrize("P,Q", SPREAD)
def test_spread_residual_examples_are_exact(P, Q):
    assert enumerate_first_token(accept_sampling, P, Q, grid=60) == [Fraction(x) for x in P]
    assert enumerate_first_token(resample_from_p_on_rejection, P, Q, grid=60) != [Fraction(x) for x in P]


def test_output_distribution_closed_form():
    got = output_distribution([0.5, 0.3, 0.2], [0.2, 0.5, 0.3])
    np.testing.assert_allclose(got, [0.5, 0.3, 0.2], rtol=0, atol=1e-15)


distributions = st.integers(1, 12).flatmap(
    lambda v: st.tuples(*[st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=v, max_size=v)
                          .filter(lambda w: sum(w) > 0)] * 2)
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(distributions)
def test_output_distribution_is_p(pq):
    p, q = (np.array(w) / sum(w) for w in pq)
    np.testing.assert_allclose(output_distribution(p, q), p, rtol=0, atol=1e-12)


# --- Monte Carlo: the first emitted token follows p -------------------------------------------------------


def _normalized(w):
    w = np.asarray(w, dtype=np.float64)
    return w / w.sum()


def _pairs() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(20230518)
    pairs = []
    for i in range(15):  # 5 each: no zeros, q = 0 where p > 0, p = 0 where q > 0
        v = int(rng.integers(4, 11))
        p, q = rng.dirichlet(np.full(v, 0.8)), rng.dirichlet(np.full(v, 0.8))
        holes = rng.choice(v, size=4, replace=False)
        if i % 3 == 1:
            q[holes[:2]] = 0.0  # q = 0 where p > 0: reachable only through the residual
        elif i % 3 == 2:
            p[holes[:2]] = 0.0  # p = 0 where q > 0: drafted, always rejected, never emitted
            q[holes[2:]] = 0.0
        pairs.append((_normalized(p), _normalized(q)))
    same = rng.dirichlet(np.ones(7))
    pairs += [
        (same, same.copy()),  # p == q: every draft accepted
        (_normalized([0.4, 0, 0.3, 0, 0.3]), _normalized([0.4, 0, 0.3, 0, 0.3])),
        (_normalized([1, 2, 3, 0, 0, 0]), _normalized([0, 0, 0, 3, 2, 1])),  # disjoint: always rejected
        (_normalized([0, 0, 1, 0]), _normalized([1, 1, 1, 1])),  # p a point mass
        (_normalized([1, 1, 1, 1, 1]), _normalized([0, 0, 0, 1, 0])),  # q a point mass, passed as a row
        (_normalized([0.97, 0.01, 0.01, 0.01]), _normalized([0.01, 0.01, 0.01, 0.97])),
    ]
    return pairs


PAIRS = _pairs()


@pytest.mark.parametrize("case", range(len(PAIRS)))
def test_first_token_follows_p(case):
    p, q = PAIRS[case]
    v = len(p)
    rng = np.random.default_rng(case)
    bonus = rng.dirichlet(np.ones(v))  # row K: must not leak into a one-draft round's first token
    target, draft_probs = np.stack([p, bonus]), q[None]
    drafts = rng.choice(v, size=(DRAWS, 1), p=q)  # x ~ q
    n, token = np.array([accept_sampling(x, draft_probs, target, rng) for x in drafts]).T
    first = np.where(n == 1, drafts[:, 0], token)
    freq = np.bincount(first, minlength=v) / DRAWS
    assert np.abs(freq - p).max() < TOL, (freq, p)
    assert freq[p == 0].sum() == 0
    assert abs(n.mean() - np.minimum(p, q).sum()) < TOL  # accepted as often as the theory says


POINT_MASS = [
    (_normalized([0.1, 0.4, 0.2, 0.3]), 1),
    (_normalized([3, 0, 1, 1, 2, 1, 1]), 1),  # p(d) = 0: always rejected
    (_normalized([0, 0, 1, 0, 0]), 2),  # p a point mass on d: always accepted
    (_normalized([0, 0, 1, 0, 0]), 4),  # p a point mass elsewhere: always rejected, the residual is p
    (_normalized([0.001, 0.5, 0.499, 0, 0, 0]), 0),
]


@pytest.mark.parametrize("case", range(len(POINT_MASS)))
def test_first_token_follows_p_for_a_deterministic_proposer(case):
    p, d = POINT_MASS[case]
    rng = np.random.default_rng(100 + case)
    target = np.stack([p, rng.dirichlet(np.ones(len(p)))])
    draft = np.array([d])
    n, token = np.array([accept_sampling(draft, None, target, rng) for _ in range(DRAWS)]).T
    first = np.where(n == 1, d, token)
    freq = np.bincount(first, minlength=len(p)) / DRAWS
    assert np.abs(freq - p).max() < TOL, (freq, p)
    assert freq[p == 0].sum() == 0
    assert abs(n.mean() - p[d]) < TOL


def test_three_drafts_first_two_tokens_follow_the_target_chain():
    """K=3 drafts from a context-dependent draft model Q judged by a context-dependent target P.

    Both models are Markov: the next-token distribution depends on the previous token only. Emitted tokens
    (t1, t2) must follow P[c, t1] * P[t1, t2]; a round that emits only t1 (rejection at 0) is followed by
    another round from context t1, as the decoder would do.
    """
    rng = np.random.default_rng(7)
    v, c = 5, 0
    P = rng.dirichlet(np.full(v, 0.7), size=v)
    Q = rng.dirichlet(np.full(v, 0.7), size=v)
    Q[:, 3] = 0.0  # the draft model never proposes 3; the target does
    P[2, 1] = 0.0  # after 2 the target forbids 1
    P, Q = P / P.sum(1, keepdims=True), Q / Q.sum(1, keepdims=True)

    # drafts d0 ~ Q[c], d1 ~ Q[d0], d2 ~ Q[d1] for all rounds at once (inverse cdf, zero rows skipped)
    cdf = Q.cumsum(axis=1)
    last_positive = np.array([np.flatnonzero(row)[-1] for row in Q])
    drafts = np.empty((DRAWS, 3), dtype=np.int64)
    prev = np.full(DRAWS, c)
    for k in range(3):
        drawn = (cdf[prev] <= rng.random(DRAWS)[:, None] * cdf[prev, -1:]).sum(axis=1)
        drafts[:, k] = prev = np.minimum(drawn, last_positive[prev])
    contexts = np.concatenate([np.full((DRAWS, 1), c), drafts], axis=1)  # [N, K+1]
    draft_probs = Q[contexts[:, :3]]  # [N, K, V]
    target_probs = P[contexts]  # [N, K+1, V]

    pairs = np.empty((DRAWS, 2), dtype=np.int64)
    for i in range(DRAWS):
        d = drafts[i]
        n, token = accept_sampling(d, draft_probs[i], target_probs[i], rng)
        emitted = [*d[:n].tolist(), token]
        if n == 0:  # the next round, from context t1, supplies t2 (one draft is enough)
            d1 = np.array([sample_token(Q[token], rng)])
            n1, token1 = accept_sampling(d1, Q[token][None], np.stack([P[token], P[d1[0]]]), rng)
            emitted.append(int(d1[0]) if n1 else token1)
        pairs[i] = emitted[:2]

    joint = np.bincount(pairs[:, 0] * v + pairs[:, 1], minlength=v * v).reshape(v, v) / DRAWS
    want = P[c][:, None] * P
    assert np.abs(joint.sum(1) - P[c]).max() < TOL  # the first token
    assert np.abs(joint.sum(0) - want.sum(0)).max() < TOL  # the second token
    assert np.abs(joint - want).max() < TOL
    assert joint[2, 1] == 0


# --- numerical edges, with scripted uniforms --------------------------------------------------------------


def test_zero_draft_probability_is_accepted_iff_target_allows_it():
    p = np.array([0.5, 0.5, 0.0])
    q = np.array([[1.0, 0.0, 0.0]])
    target = np.stack([p, np.array([0.0, 0.0, 1.0])])
    assert accept_sampling(np.array([1]), q, target, ScriptedRng(U_MAX, 0.0)) == (1, 2)  # p/q = inf
    n, token = accept_sampling(np.array([2]), q, target, ScriptedRng(0.0, 0.0))  # p/q = 0/0
    assert n == 0 and token == 1  # the residual max(p - q, 0) = [0, 0.5, 0]


def test_zero_target_probability_is_always_rejected_and_never_recovered():
    p = np.array([0.0, 0.6, 0.4])
    q = np.array([[0.9, 0.05, 0.05]])
    for u1 in (0.0, 1e-300, 0.5):
        for u2 in (0.0, 0.5, U_MAX):
            n, token = accept_sampling(np.array([0]), q, np.stack([p, p]), ScriptedRng(u1, u2))
            assert n == 0 and token in (1, 2)


def test_noise_residual_falls_back_to_p():
    # p is q up to one ulp per entry: a rejection needs u within an ulp of 1, and max(p - q, 0) is ~5e-17 of
    # mass on token 0 only. Sampling that would always give 0; the fallback samples p instead.
    q = np.array([0.25, 0.25, 0.5])
    p = q.copy()
    p[2] = np.nextafter(0.5, 0.0)
    p[0] = np.nextafter(0.25, 1.0)
    target = np.stack([p, p])
    assert accept_sampling(np.array([2]), q[None], target, ScriptedRng(0.99, 0.9))[0] == 1
    for u2, want in [(0.1, 0), (0.3, 1), (0.9, 2)]:
        assert accept_sampling(np.array([2]), q[None], target, ScriptedRng(U_MAX, u2)) == (0, want)


def test_zero_residual_falls_back_to_p():
    q = np.array([0.25, 0.25, 0.5])
    p = np.nextafter(q, 0.0)  # below q everywhere: max(p - q, 0) is exactly 0
    for u2, want in [(0.1, 0), (0.3, 1), (0.9, 2)]:
        assert accept_sampling(np.array([2]), q[None], np.stack([p, p]), ScriptedRng(U_MAX, u2)) == (0, want)


def test_point_mass_residual_is_p_without_the_draft():
    p = np.array([0.2, 0.3, 0.5])
    target = np.stack([p, p])
    assert accept_sampling(np.array([1]), None, target, ScriptedRng(0.29, 0.0))[0] == 1  # u < p(d)
    # rejected (u >= p(d) = 0.3): the residual is [0.2, 0, 0.5] / 0.7
    for u2, want in [(0.0, 0), (0.2 / 0.7 - 1e-9, 0), (0.2 / 0.7 + 1e-9, 2), (U_MAX, 2)]:
        assert accept_sampling(np.array([1]), None, target, ScriptedRng(0.3, u2)) == (0, want)


def test_bonus_token_and_rng_use():
    target = np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.0, 0.0, 1.0]])
    drafts = np.array([0, 1, 2])
    rng = ScriptedRng(0.1, 0.1, 0.1, 0.0)  # 3 accepts, then the bonus from row K = 3
    assert accept_sampling(drafts, None, target, rng) == (3, 2) and rng.values == []
    rng = ScriptedRng(0.1, 0.9, 0.0)  # d1 rejected (0.9 >= 0.5): one draw for the recovered token, no more
    assert accept_sampling(drafts, None, target, rng) == (1, 0) and rng.values == []


def test_zero_drafts_sample_the_bonus():
    p = np.array([[0.0, 0.0, 1.0, 0.0]])
    assert accept_sampling(np.array([], dtype=np.int64), None, p, np.random.default_rng(0)) == (0, 2)
    assert accept_sampling([], np.empty((0, 4)), p, np.random.default_rng(0)) == (0, 2)
    assert accept_sampling([], [], p, np.random.default_rng(0)) == (0, 2)  # an empty list of q rows


@pytest.mark.parametrize(
    "draft_tokens, draft_probs, target_probs, match",
    [
        (np.array([0, 1]), np.full((1, 4), 0.25), np.full((3, 4), 0.25), "draft_probs"),  # K mismatch
        (np.array([0, 1]), np.full((2, 5), 0.2), np.full((3, 4), 0.25), "draft_probs"),  # V mismatch
        (np.array([0, 1]), None, np.full((2, 4), 0.25), "K\\+1"),  # target rows != K + 1
        (np.array([0]), None, np.full(4, 0.25), "K\\+1"),  # 1-D target
        (np.array([[0, 1]]), None, np.full((3, 4), 0.25), "draft_tokens"),  # 2-D drafts
        (np.array([0.0, 1.0]), None, np.full((3, 4), 0.25), "draft_tokens"),  # float drafts
        (np.array([0, 4]), None, np.full((3, 4), 0.25), "draft_tokens"),  # token >= V
        (np.array([-1, 0]), None, np.full((3, 4), 0.25), "draft_tokens"),  # token < 0
    ],
)
def test_accept_sampling_validates_shapes(draft_tokens, draft_probs, target_probs, match):
    with pytest.raises(ValueError, match=match):
        accept_sampling(draft_tokens, draft_probs, target_probs, np.random.default_rng(0))


# --- greedy -----------------------------------------------------------------------------------------------


def _logits_with_argmax(argmax, v=6):
    logits = np.zeros((len(argmax), v), dtype=np.float32)
    logits[np.arange(len(argmax)), argmax] = 1.0
    return logits


def test_greedy_all_accepted_takes_the_bonus_from_row_k():
    assert accept_greedy(np.array([3, 1, 4]), _logits_with_argmax([3, 1, 4, 5])) == (3, 5)


@pytest.mark.parametrize("j", [0, 1, 2])
def test_greedy_first_rejection_recovers_from_its_row(j):
    argmax = [3, 1, 4, 5]
    drafts = np.array([0, 0, 0])  # matches none of the rows
    drafts[:j] = argmax[:j]
    # the drafts after j mismatch too: only the first mismatch counts
    assert accept_greedy(drafts, _logits_with_argmax(argmax)) == (j, argmax[j])


def test_greedy_ties_go_to_the_lowest_id():
    logits = np.array([[0.0, 2.0, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    assert accept_greedy(np.array([3]), logits) == (0, 1)
    assert accept_greedy(np.array([1]), logits) == (1, 0)


def test_greedy_zero_drafts():
    assert accept_greedy(np.array([], dtype=np.int64), _logits_with_argmax([4])) == (0, 4)
    assert accept_greedy([], _logits_with_argmax([2])) == (0, 2)


def test_greedy_validates_shapes():
    with pytest.raises(ValueError, match="K\\+1"):
        accept_greedy(np.array([1, 2]), np.zeros((2, 6)))
    with pytest.raises(ValueError, match="draft_tokens"):
        accept_greedy(np.array([9]), np.zeros((2, 6)))
