"""End to end, speculative sampling keeps the target's distribution.

A tiny target/draft pair (vocab 16, sharpened heads so p and q differ a lot) is exported; 3-token
continuations are sampled many times with the draft and n-gram proposers, and their frequencies are tested
against the exact distribution of plain sampling (chi-square goodness of fit, fixed seeds). The exact law is
the product of the target's next-token distributions, enumerated over all 16^3 continuations, computed from
transformers' logits with transformers' own temperature, top-k and top-p warpers (independent of
specedge.runtime.sampling). Every speculative run also asserts that drafts were accepted and rejected. A
deliberately wrong acceptance rule (resample from p after a rejection) must fail the same test.
"""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime import generator as generator_module
from specedge.runtime.generator import Generator
from specedge.runtime.sampling import SamplingParams, sample_token

V = 16
START = 3
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
    export_bundle(str(root / "target"), out, ExportOptions(context=32, prefill_chunk=4, gammas=(2, 4), tree_sizes=(8,)),
                  draft_path=str(root / "draft"), progress=False)
    g = Generator.load(out)
    yield g, target, lookup_prompt(target)
    g.close()


def lookup_prompt(model) -> list[int]:
    """START, the target's greedy continuation g1 g2 g3, then START g1 again: prompt lookup finds [START, g1]
    earlier and proposes g2 g3 START g1, tokens the target likes, so proposals are accepted as well as
    rejected at every temperature/top-k/top-p setting (with a fixed repeat like 3 7 3 7 3, top-k 6 never kept
    the proposed tokens and no draft was ever accepted)."""
    ids = [START]
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids + [START, ids[1]]


def branching_prompt(model) -> list[int]:
    """[START, g1] followed once by the target's second choice h and later by its greedy g2 g3, then
    [START, g1] again: prompt lookup proposes g2 g3 ... as the chain and h as a leaf beside g2."""
    ids = lookup_prompt(model)[:4]  # START g1 g2 g3
    with torch.no_grad():
        second = int(model(torch.tensor([ids[:2]])).logits[0, -1].argsort(descending=True)[1])
    return ids[:2] + [second] + ids + ids[:2]


def hf_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Next-token distributions [N, V] as transformers' generate() makes them: temperature, then top-k, then
    top-p (its LogitsWarpers, in that order), then softmax; in float64."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    scores = torch.tensor(logits, dtype=torch.float64)
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        warpers.append(MinPLogitsWarper(params.min_p))
    for warp in warpers:
        scores = warp(None, scores)
    return torch.softmax(scores, dim=-1).numpy()


def penalize(logits: np.ndarray, contexts: list[list[int]], prompt_len: int, penalties: dict) -> np.ndarray:
    """Rows [N, V] after the logit bias and penalties for their contexts (prompt + output so far): transformers'
    own sequence bias (one-token sequences) and repetition penalty processors, then OpenAI's presence/frequency
    definitions over the output, written out here."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    bias = penalties.get("logit_bias")
    if bias:
        processor = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
        logits = processor(torch.tensor(contexts), torch.tensor(logits)).numpy()
    rep = penalties.get("repetition_penalty", 1.0)
    if rep != 1.0:
        logits = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor(contexts), torch.tensor(logits)).numpy()
    logits = logits.copy()
    for row, ctx in zip(logits, contexts):
        output = ctx[prompt_len:]
        for token in set(output):
            row[token] -= np.float32(output.count(token) * penalties.get("frequency_penalty", 0.0)
                                     + penalties.get("presence_penalty", 0.0))
    return logits


def exact_law(model, prompt, params: SamplingParams, penalties: dict | None = None) -> np.ndarray:
    """P(a, b, c | prompt) for all 16^3 continuations, from transformers' logits and warpers (and penalties)."""
    seqs = np.array([[a, b] for a in range(V) for b in range(V)])
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].numpy()
        ctx = torch.tensor([prompt + [a] for a in range(V)])
        second = model(ctx).logits[:, -1].numpy()
        ctx = torch.tensor([prompt + list(s) for s in seqs])
        third = model(ctx).logits[:, -1].numpy()
    if penalties:
        n = len(prompt)
        first = penalize(first[None], [prompt], n, penalties)[0]
        second = penalize(second, [prompt + [a] for a in range(V)], n, penalties)
        third = penalize(third, [prompt + list(s) for s in seqs], n, penalties)
    p1 = hf_probs(first[None], params)[0]
    p2 = hf_probs(second, params)
    p3 = hf_probs(third, params).reshape(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def sample_counts(gen, prompt, proposer, gamma, params, seed, n=N, tree=0, guesses=False, **penalties):
    """Counts of the 16^3 continuations over n seeded runs; asserts that a speculative proposer really ran:
    drafts were proposed, some accepted and some rejected (with trees: tree rounds ran, and some accepted
    paths ended in a node off the first chain; with `guesses`: guesses in padding rows were made, some
    accepted and some rejected)."""
    counts = np.zeros(V ** 3)
    proposed = accepted = tree_rounds = off_chain = spare_proposed = spare_accepted = 0
    for i in range(n):
        out = gen.generate(prompt, 3, proposer=proposer, gamma=gamma, temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, min_p=params.min_p, seed=seed * 1_000_003 + i,
                           stop_ids=[],
                           adaptive=False, tree=tree, **penalties)
        a, b, c = out.tokens
        counts[(a * V + b) * V + c] += 1
        proposed += out.stats.proposed
        accepted += out.stats.accepted
        tree_rounds += out.stats.tree_rounds
        off_chain += out.stats.off_chain_accepted
        spare_proposed += out.stats.spare_proposed
        spare_accepted += out.stats.spare_accepted
    if guesses:
        assert 0 < spare_accepted < spare_proposed, (spare_accepted, spare_proposed)
    if proposer != "none":
        assert 0 < accepted < proposed, (proposer, gamma, accepted, proposed)
    if tree:
        assert tree_rounds > 0 and off_chain > 0, (proposer, tree_rounds, off_chain)
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
    gen, model, prompt = pair
    law = exact_law(model, prompt, params)
    assert (law > 1e-3).sum() >= 8  # a law with real spread, or the test would say little
    counts = sample_counts(gen, prompt, proposer, gamma, params, seed=gamma)
    assert goodness_of_fit(counts, law) > P_MIN


@pytest.mark.parametrize("proposer, gamma, tree", [("draft", 2, 0), ("ngram", 4, 0), ("draft", 2, 8)])
def test_sampling_with_min_p_matches_plain_sampling(pair, proposer, gamma, tree):
    """min_p (transformers' MinPLogitsWarper after temperature): p and q both lose their unlikely tokens, and
    acceptance keeps the min-p law."""
    gen, model, prompt = pair
    params = SamplingParams(temperature=1.0, min_p=0.1)
    law = exact_law(model, prompt, params)
    assert np.abs(law - exact_law(model, prompt, SETTINGS[0])).sum() > 0.05  # min_p moves the law
    counts = sample_counts(gen, prompt, proposer, gamma, params, seed=17 + gamma + tree, n=2000, tree=tree)
    assert goodness_of_fit(counts, law) > P_MIN


PENALTIES = dict(repetition_penalty=1.5, presence_penalty=0.6, frequency_penalty=0.4)
BIAS = dict(logit_bias={3: 1.0, 7: -2.0, 11: -100.0})


@pytest.mark.parametrize("proposer, gamma, tree, bias", [("none", 0, 0, False), ("draft", 2, 0, False),
                                                         ("ngram", 4, 0, False), ("draft", 2, 8, False),
                                                         ("draft", 2, 0, True), ("draft", 2, 8, True)])
def test_sampling_with_penalties_matches_the_penalized_law(pair, proposer, gamma, tree, bias):
    """Repetition, presence and frequency penalties (runtime/penalties.py): the third token's law depends on the
    first two, so each verify row must be penalized with the drafts before it. A logit bias comes first."""
    gen, model, prompt = pair
    params = SETTINGS[0]
    penalties = PENALTIES | BIAS if bias else PENALTIES
    law = exact_law(model, prompt, params, penalties)
    assert np.abs(law - exact_law(model, prompt, params)).sum() > 0.2  # the penalties move the law
    if bias:
        assert np.abs(law - exact_law(model, prompt, params, PENALTIES)).sum() > 0.2  # and so does the bias
    counts = sample_counts(gen, prompt, proposer, gamma, params, seed=13 + gamma + tree, n=2000, tree=tree,
                           **penalties)
    assert goodness_of_fit(counts, law) > P_MIN


def test_rows_penalized_without_their_drafts_are_caught(pair, monkeypatch):
    """Penalizing every verify row with the committed text alone (ignoring the drafts before it) skews the
    output: the test above would see it."""
    from specedge.runtime.penalties import PenaltyState

    gen, model, prompt = pair
    apply = PenaltyState.apply

    def without_drafts(self, logits, prefixes):  # verify steps (several rows) only; one-row calls are drafts
        return apply(self, logits, [[]] * len(prefixes) if len(prefixes) > 1 else prefixes)

    monkeypatch.setattr(PenaltyState, "apply", without_drafts)
    counts = sample_counts(gen, prompt, "draft", 2, SETTINGS[0], seed=15, n=2000, **PENALTIES)
    assert goodness_of_fit(counts, exact_law(model, prompt, SETTINGS[0], PENALTIES)) < P_MIN


@pytest.fixture(scope="module")
def layer_pair(tmp_path_factory):
    """A target whose draft is its own first layer, reading the target's KV cache (SharedKVCache)."""
    from models import make_hf_model

    root = tmp_path_factory.mktemp("sampling_layer_draft")
    target = make_hf_model(str(root / "target"), "llama", vocab=V, layers=2, hidden=32, heads=4, kv_heads=2,
                           seed=1, logit_scale=10.0)
    out = str(root / "bundle")
    export_bundle(str(root / "target"), out, ExportOptions(context=32, prefill_chunk=4, gammas=(2, 4), draft_layers=1,
                                                           tree_sizes=(8,)), progress=False)
    g = Generator.load(out)
    assert g.draft_shares_cache
    yield g, target, lookup_prompt(target)
    g.close()


@pytest.mark.parametrize("params", SETTINGS, ids=["t1.0", "t0.7-topk6-topp0.9"])
def test_layer_draft_sampling_matches_plain_sampling(layer_pair, params):
    gen, model, prompt = layer_pair
    counts = sample_counts(gen, prompt, "draft", 4, params, seed=7)
    assert goodness_of_fit(counts, exact_law(model, prompt, params)) > P_MIN


@pytest.mark.parametrize("params", SETTINGS, ids=["t1.0", "t0.7-topk6-topp0.9"])
def test_guesses_in_two_row_decodes_padding_row_keep_the_law(pair, params, monkeypatch):
    """Under two-row decode (forced here: runtime/kernel_probe.RowPlan), a prompt-lookup round that proposes
    nothing guesses in the step's padding row (runtime/proposers.py, guesses), a deterministic candidate under
    the same acceptance rule: the output keeps the target's law, with guesses accepted and rejected."""
    from specedge.runtime import model as model_module
    from specedge.runtime.kernel_probe import RowPlan

    gen, model, prompt = pair
    prompt = prompt[:4]  # START and the target's greedy g1 g2 g3: no suffix of two tokens recurs, one often does
    monkeypatch.setattr(model_module, "row_plan", lambda *args: RowPlan(min_rows=2))
    two = Generator.load(gen.bundle_dir)
    try:
        assert two.target.padding_rows(1) >= 1  # a one-token step runs padded
        counts = sample_counts(two, prompt, "ngram", 4, params, seed=11, guesses=True)
    finally:
        two.close()
    assert goodness_of_fit(counts, exact_law(model, prompt, params)) > P_MIN


@pytest.mark.parametrize("params", SETTINGS, ids=["t1.0", "t0.7-topk6-topp0.9"])
def test_plain_sampling_follows_the_exact_law(pair, params):
    """The control: plain sampling through the graphs passes the same test."""
    gen, model, prompt = pair
    assert goodness_of_fit(sample_counts(gen, prompt, "none", 0, params, seed=99), exact_law(model, prompt, params)) > P_MIN


def test_wrong_rule_is_caught(pair, monkeypatch):
    """Resampling from p after a rejection (instead of from norm(max(p - q, 0))) skews the output: the
    test above would see it."""
    gen, model, prompt = pair
    params = SETTINGS[0]

    def wrong_accept(draft_tokens, draft_probs, target_probs, rng):
        for j, token in enumerate(draft_tokens):
            q = draft_probs[j][token] if draft_probs is not None else 1.0
            if rng.random() * q >= target_probs[j][token]:
                return j, sample_token(target_probs[j], rng)
        return len(draft_tokens), sample_token(target_probs[len(draft_tokens)], rng)

    monkeypatch.setattr(generator_module, "accept_sampling", wrong_accept)
    counts = sample_counts(gen, prompt, "draft", 2, params, seed=5)
    assert goodness_of_fit(counts, exact_law(model, prompt, params)) < P_MIN


@pytest.mark.parametrize("params", SETTINGS, ids=["t1.0", "t0.7-topk6-topp0.9"])
@pytest.mark.parametrize("which, proposer", [("pair", "draft"), ("pair", "ngram"), ("layer", "draft")])
def test_tree_sampling_matches_plain_sampling(pair, layer_pair, params, which, proposer):
    """Token trees (runtime/tree.py) of up to 7 nodes: the chain plus the draft's next candidates (point
    masses) or prompt lookup's other matches, accepted by multi-candidate speculative sampling."""
    gen, model, prompt = pair if which == "pair" else layer_pair
    if proposer == "ngram":
        prompt = branching_prompt(model)
    counts = sample_counts(gen, prompt, proposer, 2, params, seed=11, n=2000, tree=8)
    assert goodness_of_fit(counts, exact_law(model, prompt, params)) > P_MIN


def test_wrong_tree_rule_is_caught(pair, monkeypatch):
    """Trying each child against the original r (never taking the residual after a rejected sibling) skews
    the output; the tree test above would see it."""
    from specedge.runtime import tree_acceptance

    gen, model, prompt = pair
    params = SETTINGS[0]

    def wrong_accept_tree(tokens, parents, target_probs, draft_probs, rng):
        children = {}
        for i, p in enumerate(parents):
            children.setdefault(int(p), []).append(i)
        path, row = [], 0
        while True:
            for c in children.get(row, []):
                q = draft_probs[c][tokens[c]] if draft_probs is not None else 1.0
                if rng.random() * q < target_probs[row][tokens[c]]:
                    path.append(c)
                    row = c + 1
                    break
            else:
                return path, sample_token(target_probs[row], rng)

    assert tree_acceptance.accept_tree is generator_module.accept_tree
    monkeypatch.setattr(generator_module, "accept_tree", wrong_accept_tree)
    counts = sample_counts(gen, prompt, "draft", 2, params, seed=13, n=2000, tree=8)
    assert goodness_of_fit(counts, exact_law(model, prompt, params)) < P_MIN
