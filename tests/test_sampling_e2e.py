"""End to end, speculative sampling keeps the target's distribution.

A tiny target/draft pair (vocab 16, sharpened heads so p and q differ a lot) is exported; 3-token
continuations are sampled many times with the draft and n-gram proposers, and their frequencies are tested
against the exact distribution of plain sampling (chi-square goodness of fit, fixed seeds). The exact law is
the product of the target's processed next-token distributions, enumerated over all 16^3 continuations. A
deliberately wrong acceptance rule (resample from p after a rejection) must fail the same test.
"""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime import generator as generator_module
from specedge.runtime.generator import Generator
from specedge.runtime.sampling import SamplingParams, probs_from_logits, sample_token

V = 16
PROMPT = [3, 7, 3, 7, 3]  # repeats so prompt lookup has something to propose
N = 3000
P_MIN = 1e-3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from models import make_hf_model

    root = tmp_path_factory.mktemp("sampling_pair")
    target = make_hf_model(str(root / "target"), "llama", vocab=V, layers=2, hidden=32, heads=4, kv_heads=2,
                           seed=1, logit_scale=10.0)
    make_hf_model(str(root / "draft"), "llama", vocab=V, layers=1, hidden=32, heads=4, kv_heads=2, seed=2,
                  logit_scale=10.0)
    out = str(root / "bundle")
    export_bundle(str(root / "target"), out, ExportOptions(context=32, prefill_chunk=4, gammas=(2, 4)),
                  draft_path=str(root / "draft"), progress=False)
    g = Generator.load(out)
    yield g, target
    g.close()


def exact_law(model, params: SamplingParams) -> np.ndarray:
    """P(a, b, c | prompt) for all 16^3 continuations, from transformers' logits."""
    seqs = np.array([[a, b] for a in range(V) for b in range(V)])
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0, -1].numpy()
        ctx = torch.tensor([PROMPT + [a] for a in range(V)])
        second = model(ctx).logits[:, -1].numpy()
        ctx = torch.tensor([PROMPT + list(s) for s in seqs])
        third = model(ctx).logits[:, -1].numpy()
    p1 = probs_from_logits(first[None], params)[0]
    p2 = probs_from_logits(second, params)
    p3 = probs_from_logits(third, params).reshape(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def sample_counts(gen, proposer, gamma, params, seed, n=N):
    counts = np.zeros(V ** 3)
    for i in range(n):
        out = gen.generate(PROMPT, 3, proposer=proposer, gamma=gamma, temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, seed=seed * 1_000_003 + i, stop_ids=[],
                           adaptive=False)
        a, b, c = out.tokens
        counts[(a * V + b) * V + c] += 1
    return counts


def goodness_of_fit(counts, law):
    """Chi-square over cells with >= 5 expected draws, the rest pooled into one cell."""
    expected = law * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
        exp = exp * obs.sum() / exp.sum()
    return chisquare(obs, exp).pvalue


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)]


@pytest.mark.parametrize("params", SETTINGS, ids=["t1.0", "t0.7-topk6-topp0.9"])
@pytest.mark.parametrize("proposer, gamma", [("draft", 2), ("draft", 4), ("ngram", 4)])
def test_speculative_sampling_matches_plain_sampling(pair, params, proposer, gamma):
    gen, model = pair
    law = exact_law(model, params)
    assert (law > 1e-3).sum() >= 8  # a law with real spread, or the test would say little
    counts = sample_counts(gen, proposer, gamma, params, seed=gamma)
    assert goodness_of_fit(counts, law) > P_MIN


@pytest.fixture(scope="module")
def layer_pair(tmp_path_factory):
    """A target whose draft is its own first layer, reading the target's KV cache (SharedKVCache)."""
    from models import make_hf_model

    root = tmp_path_factory.mktemp("sampling_layer_draft")
    target = make_hf_model(str(root / "target"), "llama", vocab=V, layers=2, hidden=32, heads=4, kv_heads=2,
                           seed=1, logit_scale=10.0)
    out = str(root / "bundle")
    export_bundle(str(root / "target"), out, ExportOptions(context=32, prefill_chunk=4, gammas=(2, 4), draft_layers=1),
                  progress=False)
    g = Generator.load(out)
    assert g.draft_shares_cache
    yield g, target
    g.close()


@pytest.mark.parametrize("params", SETTINGS, ids=["t1.0", "t0.7-topk6-topp0.9"])
def test_layer_draft_sampling_matches_plain_sampling(layer_pair, params):
    gen, model = layer_pair
    counts = sample_counts(gen, "draft", 4, params, seed=7)
    assert gen.generate(PROMPT, 3, proposer="draft", gamma=4, temperature=1.0, seed=0, stop_ids=[],
                        adaptive=False).stats.proposed > 0
    assert goodness_of_fit(counts, exact_law(model, params)) > P_MIN


@pytest.mark.parametrize("params", SETTINGS, ids=["t1.0", "t0.7-topk6-topp0.9"])
def test_plain_sampling_follows_the_exact_law(pair, params):
    """The control: plain sampling through the graphs passes the same test."""
    gen, model = pair
    assert goodness_of_fit(sample_counts(gen, "none", 0, params, seed=99), exact_law(model, params)) > P_MIN


def test_wrong_rule_is_caught(pair, monkeypatch):
    """Resampling from p after a rejection (instead of from norm(max(p - q, 0))) skews the output: the
    test above would see it."""
    gen, model = pair
    params = SETTINGS[0]

    def wrong_accept(draft_tokens, draft_probs, target_probs, rng):
        for j, token in enumerate(draft_tokens):
            q = draft_probs[j][token] if draft_probs is not None else 1.0
            if rng.random() * q >= target_probs[j][token]:
                return j, sample_token(target_probs[j], rng)
        return len(draft_tokens), sample_token(target_probs[len(draft_tokens)], rng)

    monkeypatch.setattr(generator_module, "accept_sampling", wrong_accept)
    counts = sample_counts(gen, "draft", 2, params, seed=5)
    assert goodness_of_fit(counts, exact_law(model, params)) < P_MIN
