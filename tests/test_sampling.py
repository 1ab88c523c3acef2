"""specedge.runtime.sampling: params, logits -> probs, greedy picks, the one-draw sampler."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specedge.runtime.sampling import (
    SamplingParams,
    emittable_drafts,
    greedy_token,
    greedy_tokens,
    probs_from_logits,
    sample_token,
)

PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None)
U_MAX = 1.0 - 2.0**-53  # the largest value Generator.random() returns


class ScriptedRng:
    """Stands in for np.random.Generator: random() returns the scripted values in order."""

    def __init__(self, *values: float):
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def reference_probs(row, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Plain-Python, one row, straight from the definitions (ties kept whole, as documented)."""

    def softmax(x):
        m = max(x)
        e = [math.exp(v - m) for v in x]
        return [v / sum(e) for v in e]

    x = [float(v) / temperature for v in row]
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    probs = softmax(x)
    if top_p < 1:
        mass, smallest = 0.0, 0.0
        for v in sorted(probs, reverse=True):
            mass += v
            if mass >= top_p:
                smallest = v
                break
        x = [v if pr >= smallest else -math.inf for v, pr in zip(x, probs)]
        probs = softmax(x)
    if min_p > 0:
        top = max(probs)
        probs = softmax([v if pr >= min_p * top else -math.inf for v, pr in zip(x, probs)])
    return probs


# --- SamplingParams ---------------------------------------------------------------------------------------


def test_params_defaults_are_greedy_and_frozen():
    params = SamplingParams()
    assert params.greedy and params.top_k == 0 and params.top_p == 1.0
    assert not SamplingParams(temperature=0.7).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]


def test_params_accept_numpy_scalars():
    SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": "5"}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.0001}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": math.inf}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"min_p": "0.1"}, "min_p"),
    ],
)
def test_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**kwargs)
    assert "\n" not in str(err.value)


# --- probs_from_logits ------------------------------------------------------------------------------------


def test_temperature_scales_logits():
    logits = np.array([[0.0, math.log(2.0)]], dtype=np.float32)
    np.testing.assert_allclose(probs_from_logits(logits, SamplingParams(1.0)), [[1 / 3, 2 / 3]], rtol=1e-6)
    # T = 0.5 doubles the logits: weights 1 and 4 (float32 log(2) limits the match to ~1e-7)
    np.testing.assert_allclose(probs_from_logits(logits, SamplingParams(0.5)), [[1 / 5, 4 / 5]], rtol=1e-6)
    np.testing.assert_allclose(probs_from_logits(logits, SamplingParams(1e6)), [[0.5, 0.5]], rtol=1e-6)


def test_top_k_keeps_the_k_largest():
    logits = np.array([1.0, 3.0, 2.0, 0.0])
    e = np.exp([3.0, 2.0])
    want = [0.0, e[0] / e.sum(), e[1] / e.sum(), 0.0]
    np.testing.assert_allclose(probs_from_logits(logits, SamplingParams(1.0, top_k=2)), want, rtol=1e-14)


def test_top_k_keeps_every_tie_at_the_kth_value():
    # the 2nd largest value (3) is shared by ids 1 and 2: both stay, so 3 tokens survive top_k=2
    probs = probs_from_logits(np.array([5.0, 3.0, 3.0, 1.0]), SamplingParams(1.0, top_k=2))
    assert (probs[:3] > 0).all() and probs[3] == 0
    assert probs[1] == probs[2]
    np.testing.assert_allclose(probs_from_logits(np.array([3.0, 3.0, 1.0]), SamplingParams(1.0, top_k=1)),
                               [0.5, 0.5, 0.0], rtol=1e-15)


def test_top_p_keeps_the_smallest_top_set_reaching_top_p():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    cases = {
        0.75: [0.5 / 0.8, 0.3 / 0.8, 0, 0],  # 0.5 < 0.75 <= 0.8
        0.85: [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
        0.4: [1, 0, 0, 0],  # below the top token's mass: the top token alone
        1e-9: [1, 0, 0, 0],
        0.999: [0.5, 0.3, 0.15, 0.05],
    }
    for top_p, want in cases.items():
        got = probs_from_logits(logits, SamplingParams(1.0, top_p=top_p))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15, err_msg=f"top_p={top_p}")


def test_top_p_keeps_ties_with_the_last_kept_token():
    # the smallest set reaching 0.5 is {0, any one 0.2}; its ties come along, so nothing is cut
    logits = np.log([0.4, 0.2, 0.2, 0.2])
    np.testing.assert_allclose(probs_from_logits(logits, SamplingParams(1.0, top_p=0.5)),
                               [0.4, 0.2, 0.2, 0.2], rtol=1e-12)


def test_top_p_applies_after_top_k():
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    # without top-k the mass reaches 0.72 only with 3 tokens (0.4, 0.7, 0.9) ...
    got = probs_from_logits(logits, SamplingParams(1.0, top_p=0.72))
    np.testing.assert_allclose(got, [4 / 9, 3 / 9, 2 / 9, 0], rtol=1e-12, atol=1e-15)
    # ... top_k=3 renormalizes to (4/9, 3/9, 2/9), where 2 tokens already hold 7/9 >= 0.72
    got = probs_from_logits(logits, SamplingParams(1.0, top_k=3, top_p=0.72))
    np.testing.assert_allclose(got, [4 / 7, 3 / 7, 0, 0], rtol=1e-12, atol=1e-15)


def test_matches_reference_on_random_logits():
    rng = np.random.default_rng(0)
    for trial in range(200):
        v = int(rng.integers(2, 40))
        row = (rng.standard_normal(v) * rng.uniform(0.1, 5)).astype(np.float32)
        t = float(rng.choice([0.3, 0.7, 1.0, 1.5]))
        k = int(rng.integers(0, v + 2))
        top_p = float(rng.choice([1.0, 0.95, 0.8, 0.5, 0.1]))
        min_p = float(rng.choice([0.0, 0.0, 0.05, 0.2, 0.6, 1.0]))
        got = probs_from_logits(row, SamplingParams(t, top_k=k, top_p=top_p, min_p=min_p))
        want = reference_probs(row, t, k, top_p, min_p)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300, err_msg=f"trial {trial}")


def test_top_p_over_a_large_vocabulary_matches_the_reference():
    """Top-p sorts only the largest TOP_P_CANDIDATES entries of a row while they hold top_p of its mass, and the
    whole row otherwise: rows of both kinds, with and without top-k and min-p, in one call."""
    from specedge.runtime.sampling import TOP_P_CANDIDATES

    rng = np.random.default_rng(5)
    v = 8 * TOP_P_CANDIDATES
    rows = np.stack([rng.standard_normal(v) * scale for scale in (8.0, 3.0, 0.05, 0.5)]).astype(np.float32)
    rows[1, :40] = rows[1].max()  # ties at the top
    # the five most likely first, most of the mass in the last TOP_P_CANDIDATES entries (a wrong candidate
    # set, such as the entries in index order, reaches top_p there with the wrong floor)
    tail = np.full(v, -10.0)
    tail[:5] = 5.0
    tail[-TOP_P_CANDIDATES:] = 4.5 + rng.uniform(0, 0.1, TOP_P_CANDIDATES)
    rows = np.concatenate([rows, tail[None].astype(np.float32)])
    for t, k, top_p, min_p in ((0.7, 0, 0.95, 0.0), (1.0, 0, 0.5, 0.0), (0.7, 300, 0.9, 0.0), (1.2, 50, 0.99, 0.1),
                               (0.7, 0, 0.999, 0.0)):
        params = SamplingParams(t, top_k=k, top_p=top_p, min_p=min_p)
        kept = reference_kept = 0
        got = probs_from_logits(rows, params)
        for row, g in zip(rows, got):
            want = reference_probs(row, t, k, top_p, min_p)
            np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-300, err_msg=str(params))
            kept, reference_kept = kept + (g > 0).sum(), reference_kept + sum(w > 0 for w in want)
        assert kept == reference_kept
    flat = probs_from_logits(rows[2:3], SamplingParams(1.0, top_p=0.95))
    assert (flat > 0).sum() > TOP_P_CANDIDATES  # that row needed the whole sort


def test_disabled_filters_are_no_ops_and_rows_are_vectorized():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((16, 50)).astype(np.float32)
    plain = probs_from_logits(logits, SamplingParams(0.8))
    assert plain.dtype == np.float64 and plain.shape == (16, 50)
    for same in (SamplingParams(0.8, top_k=0, top_p=1.0), SamplingParams(0.8, top_k=50),
                 SamplingParams(0.8, top_k=1000)):
        np.testing.assert_array_equal(probs_from_logits(logits, same), plain)
    e = np.exp(logits.astype(np.float64) / 0.8)
    np.testing.assert_allclose(plain, e / e.sum(axis=1, keepdims=True), rtol=1e-13)
    for params in (SamplingParams(0.8), SamplingParams(1.3, top_k=7),
                   SamplingParams(0.5, top_k=20, top_p=0.6)):
        batch = probs_from_logits(logits, params)
        np.testing.assert_allclose(batch.sum(axis=1), 1.0, rtol=0, atol=1e-14)
        for row, got in zip(logits, batch):
            np.testing.assert_array_equal(probs_from_logits(row, params), got)


@pytest.mark.parametrize("temperature", [1e-306, 1e-6, 1e-3, 1.0, 100.0])  # 1e4 / 1e-306 overflows
def test_extreme_logits_stay_finite(temperature):
    logits = np.array([[1e4, -1e4, 0.0, 1e4], [-1e4, -1e4, -1e4, -1e4 + 1]], dtype=np.float32)
    for params in (SamplingParams(temperature), SamplingParams(temperature, top_k=2, top_p=0.9)):
        probs = probs_from_logits(logits, params)
        assert np.isfinite(probs).all()
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-14)
        assert probs[0, 0] == probs[0, 3] and probs[0, 0] >= 0.5 - 1e-12  # the two 1e4 ties split the mass


def test_masked_logits_get_zero_probability():
    probs = probs_from_logits(np.array([1.0, -np.inf, 2.0]), SamplingParams(1.0, top_p=0.99))
    assert probs[1] == 0 and probs.sum() == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize(
    "logits",
    [np.array([1.0, np.nan]), np.array([1.0, np.inf]), np.array([[0.0, 1.0], [-np.inf, -np.inf]]),
     np.zeros((2, 3, 4)), np.zeros((2, 0))],
)
def test_bad_logits_raise(logits):
    with pytest.raises(ValueError):
        probs_from_logits(logits, SamplingParams(1.0))


def test_greedy_params_have_no_distribution():
    with pytest.raises(ValueError, match="temperature"):
        probs_from_logits(np.zeros((1, 4)), SamplingParams())


# --- greedy -----------------------------------------------------------------------------------------------


def test_greedy_lowest_id_wins_ties():
    assert greedy_token(np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32)) == 1
    assert greedy_token(np.array([7.0])) == 0
    logits = np.array([[0.0, 0.0, 0.0], [1.0, 5.0, 5.0], [-1.0, -2.0, -1.0], [0.0, 0.0, 9.0]])
    got = greedy_tokens(logits)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [0, 1, 0, 2])
    assert [greedy_token(r) for r in logits] == got.tolist()


def test_greedy_shapes():
    with pytest.raises(ValueError):
        greedy_token(np.zeros((2, 3)))
    with pytest.raises(ValueError):
        greedy_tokens(np.zeros(3))


# --- sample_token -----------------------------------------------------------------------------------------

weights = st.lists(st.one_of(st.just(0.0), st.floats(5e-324, 1.0)), min_size=1, max_size=24).filter(
    lambda w: sum(w) > 0
)


@PROPERTY
@given(weights, st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.just(U_MAX), st.just(0.0)))
def test_sample_token_never_returns_zero_probability(w, u):
    probs = np.array(w)
    token = sample_token(probs, ScriptedRng(u))
    assert 0 <= token < len(w) and probs[token] > 0


@PROPERTY
@given(weights, st.integers(0, 2**32 - 1))
def test_sample_token_never_returns_zero_probability_real_rng(w, seed):
    probs = np.array(w) / sum(w)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        assert probs[sample_token(probs, rng)] > 0


def test_sample_token_past_the_rounded_total_returns_last_positive():
    # u == 1.0 (out of a Generator's range) and a subnormal total both put u * total at the total
    assert sample_token(np.array([0.2, 0.8, 0.0, 0.0]), ScriptedRng(1.0)) == 1
    assert sample_token(np.array([5e-324, 5e-324, 0.0]), ScriptedRng(U_MAX)) == 1


def test_sample_token_inverse_cdf():
    probs = np.array([0.25, 0.0, 0.5, 0.25])
    for u, want in [(0.0, 0), (0.2499, 0), (0.25, 2), (0.7499, 2), (0.75, 3), (U_MAX, 3)]:
        assert sample_token(probs, ScriptedRng(u)) == want, u


def test_sample_token_matches_its_distribution():
    rng = np.random.default_rng(2024)
    probs = np.array([0.3, 0.0, 0.05, 0.2, 0.001, 0.149, 0.0, 0.3])
    n = 100_000
    counts = np.bincount([sample_token(probs, rng) for _ in range(n)], minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    _, pvalue = stats.chisquare(counts[keep], n * probs[keep])
    assert pvalue > 1e-3, (counts, pvalue)


@pytest.mark.parametrize("probs", [np.array([]), np.zeros(3), np.array([0.5, -0.1, 0.6]),
                                   np.array([np.nan, 1.0]), np.ones((2, 2)), np.array([np.inf, 1.0])])
def test_sample_token_rejects_bad_input(probs):
    with pytest.raises(ValueError):
        sample_token(probs, np.random.default_rng(0))


def test_emittable_drafts_stops_at_the_first_held_back_stop_id():
    """Draft i is output token first + i; a stop id there while first + i < min_new_tokens ends the chain."""
    stop = {2, 7}
    assert emittable_drafts([5, 2, 9], 0, 10, stop) == 1
    assert emittable_drafts([2, 5], 3, 10, stop) == 0
    assert emittable_drafts([5, 6, 7, 2], 0, 10, stop) == 2  # the first stop id counts
    assert emittable_drafts([5, 6, 7], 8, 10, stop) == 3  # 7 would be output token 10: no longer held
    assert emittable_drafts([5, 7, 2], 8, 10, stop) == 1  # 7 is token 9, still held
    assert emittable_drafts([5, 6], 0, 10, []) == 2
    assert emittable_drafts([], 0, 10, stop) == 0
    assert emittable_drafts(np.array([4, 2]), 0, 1, stop) == 2  # min 1: only position 0 was held


@pytest.mark.parametrize("params", [SamplingParams(0.7, min_p=0.1), SamplingParams(1.3, top_k=9, top_p=0.8, min_p=0.3),
                                    SamplingParams(1.0, min_p=1.0)])
def test_min_p_matches_transformers_warpers(params):
    """transformers' generate: temperature, top-k, top-p, then MinPLogitsWarper (tokens below min_p times the
    top token's probability go), then softmax."""
    import torch
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = np.random.default_rng(4).standard_normal((8, 60)).astype(np.float32) * 3
    scores = torch.tensor(logits, dtype=torch.float64)
    warpers = [TemperatureLogitsWarper(params.temperature)]
    warpers += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    for warp in warpers + [MinPLogitsWarper(params.min_p)]:
        scores = warp(None, scores)
    want = torch.softmax(scores, dim=-1).numpy()
    got = probs_from_logits(logits, params)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-15)
    assert ((got > 0).sum(axis=1) < 60).all()  # min_p removed tokens in every row
