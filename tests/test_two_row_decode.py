"""Two-row decode (runtime/kernel_probe.py, RowPlan.min_rows = 2): every one-token run is a T=2 step with a padding
row, so no step computes a lone row. The plan is chosen for int4 bundles on CPUs whose one-row int4 kernel differs
(AVX2); here it is forced on float32 bundles, whose rows are exact at every T on every CPU, so the mechanics can
be checked against the plain plan's output bit for bit: the same tokens, no T=1 graph of the target ever loaded,
through prefill, decode, every proposer (a layer draft sharing the target's cache, a draft model with its own: a
draft's rows only propose, so it decodes in one-row steps under any plan), batches with lone rows, and the end of
the context, where the padding row needs a slot of its own.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import CHUNK, repetitive_prompts
from test_generate import prompt_of

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime import model as model_module
from specedge.runtime.batch import BatchGenerator
from specedge.runtime.generator import Generator
from specedge.runtime.kernel_probe import RowPlan, row_plan

TWO_ROWS = RowPlan(min_rows=2)


def _load(cls, bundle: str, plan: RowPlan | None):
    """A generator whose target runs under `plan` (None: the plan this machine chooses, as exported for float32);
    its draft is planned by the runtime's own rule."""
    with pytest.MonkeyPatch.context() as patch:
        if plan is not None:
            patch.setattr(model_module, "row_plan", lambda model, backend, target=None:
                          plan if target is None else row_plan(model, backend, target))
        return cls.load(bundle)


def _step_sizes(runner) -> set[int]:
    """T of every step and prefill session the runner made (batch and row graphs)."""
    return {tokens for _, tokens, _ in list(runner._steps) + list(runner._row_steps)}


@pytest.fixture(scope="module")
def layer_draft_pair(tiny_bundle):
    plain, two = _load(Generator, tiny_bundle, None), _load(Generator, tiny_bundle, TWO_ROWS)
    yield plain, two
    plain.close()
    two.close()


@pytest.mark.parametrize("proposer,gamma", [("none", 1), ("ngram", 1), ("ngram", 4), ("draft", 2), ("draft", 8)])
def test_two_row_decode_gives_the_plain_plans_tokens(layer_draft_pair, proposer, gamma):
    """Greedy output under two-row decode equals the one-row plan's, for every proposer; speculation ran, with
    drafts accepted and rejected; the target's T=1 graphs were never loaded, the draft's were."""
    plain, two = layer_draft_pair
    prompt = prompt_of(CHUNK + 7, 3)
    want = plain.generate(prompt, 40, proposer=proposer, gamma=gamma, stop_ids=[], adaptive=False)
    got = two.generate(prompt, 40, proposer=proposer, gamma=gamma, stop_ids=[], adaptive=False)
    assert two.target.plan == TWO_ROWS and two.draft.plan == RowPlan()  # a draft decodes in one-row steps
    assert got.tokens == want.tokens
    if proposer != "none":
        assert got.stats.proposed > got.stats.accepted > 0
    # prompt lookup fills the padding row of a round that proposes nothing (runtime/proposers.py, guesses); the
    # one-row plan has no such row (it guesses only after a chain shorter than gamma, padded into T=gamma+1:
    # never at gamma 1); plain decode never guesses, and a layer draft with a fixed length (adaptive=False)
    # neither pauses nor shrinks, so it leaves no padding (its guesses: test_sampled_rows_guess_as_their_batch_1_runs)
    if proposer != "ngram" or gamma == 1:
        assert want.stats.spare_proposed == 0
    assert (got.stats.spare_proposed > 0) == (proposer == "ngram"), got.stats
    assert 1 not in _step_sizes(two.target) and 2 in _step_sizes(two.target), _step_sizes(two.target)
    assert proposer != "draft" or 1 in _step_sizes(two.draft), _step_sizes(two.draft)


def test_guesses_in_the_padding_row_are_accepted_and_rejected_and_change_no_token(layer_draft_pair):
    """Rounds where prompt lookup finds nothing (or pauses after misses) put a 1-token-suffix guess in two-row
    decode's padding row: over several prompts some are accepted and some rejected, the output is the one-row
    plan's token for token, and the guesses cost no round: no more rounds than the one-row plan's (which guesses
    only after short chains)."""
    plain, two = layer_draft_pair
    spare = [0, 0]
    for prompt in repetitive_prompts(4):
        want = plain.generate(prompt, 48, proposer="ngram", gamma=4, stop_ids=[])
        got = two.generate(prompt, 48, proposer="ngram", gamma=4, stop_ids=[])
        assert got.tokens == want.tokens
        assert got.stats.rounds <= want.stats.rounds
        spare[0] += got.stats.spare_proposed
        spare[1] += got.stats.spare_accepted
    assert spare[0] > spare[1] > 0, spare


def test_the_padding_row_needs_a_slot_at_the_end_of_the_context(layer_draft_pair):
    """A generation that runs into the end of the context stops there ("context_full"), one token earlier than
    the one-row plan (the last slot would hold the padding row), and not with an error."""
    plain, two = layer_draft_pair
    prompt = prompt_of(120, 5)  # context 128
    for proposer in ("none", "ngram"):
        want = plain.generate(prompt, 30, proposer=proposer, gamma=4, stop_ids=[])
        got = two.generate(prompt, 30, proposer=proposer, gamma=4, stop_ids=[])
        assert want.stats.stop_reason == got.stats.stop_reason == "context_full"
        assert got.tokens == want.tokens[:len(got.tokens)] and len(got.tokens) == len(want.tokens) - 1
    longest = prompt_of(127, 6)  # the longest prompt a context of 128 takes: 126 prefilled, 2 free slots
    assert two.generate(longest, 5, proposer="none", stop_ids=[]).tokens == plain.generate(
        longest, 5, proposer="none", stop_ids=[]).tokens[:1]


def test_a_draft_model_with_its_own_cache_decodes_in_one_row_steps(tiny_pair_bundle):
    plain, two = _load(Generator, tiny_pair_bundle, None), _load(Generator, tiny_pair_bundle, TWO_ROWS)
    try:
        prompt = prompt_of(CHUNK + 3, 4)
        for gamma in (1, 4):
            want = plain.generate(prompt, 32, proposer="draft", gamma=gamma, stop_ids=[], adaptive=False)
            got = two.generate(prompt, 32, proposer="draft", gamma=gamma, stop_ids=[], adaptive=False)
            assert got.tokens == want.tokens and got.stats.proposed > got.stats.accepted > 0
        assert 1 not in _step_sizes(two.target) and 1 in _step_sizes(two.draft)
    finally:
        plain.close()
        two.close()


@pytest.mark.parametrize("draft", ["near", "poor"])
def test_a_draft_model_feeds_its_cache_the_guesses_it_missed(tiny_pair_bundle, tiny_models, tiny_draft_model,
                                                              tmp_path, monkeypatch, draft):
    """Under two-row decode the rounds a draft model sits out (paused after misses: often with a poor draft, an
    unrelated model) guess in the padding row, as do the rows after its shrunk chains; an accepted guess is a token
    its own cache never ran, fed with the next round's pending token. Its logits at every context length equal
    the one-row plan's without guesses (test_batch._first_drafts): the cache holds what it should."""
    from test_batch import _first_drafts

    bundle = tiny_pair_bundle
    if draft == "poor":
        bundle = str(tmp_path / "poor")
        export_bundle(tiny_models["llama"][0], bundle, ExportOptions(context=128, prefill_chunk=CHUNK),
                      draft_path=tiny_draft_model[0], progress=False)
    plain, two = _load(Generator, bundle, None), _load(Generator, bundle, TWO_ROWS)
    prompts = repetitive_prompts(4)
    try:
        with monkeypatch.context() as patch:
            reference = _first_drafts(patch)
            patch.setattr(plain.target, "padding_rows", lambda n: 0)
            want = [plain.generate(p, 60, proposer="draft", gamma=4, stop_ids=[]).tokens for p in prompts]
        seen = _first_drafts(monkeypatch)
        got = [two.generate(p, 60, proposer="draft", gamma=4, stop_ids=[]) for p in prompts]
    finally:
        plain.close()
        two.close()
    assert [g.tokens for g in got] == want
    made, accepted = sum(g.stats.spare_proposed for g in got), sum(g.stats.spare_accepted for g in got)
    assert made > accepted > 0, (made, accepted)
    shared = [key for key in seen if key in reference]
    assert len(shared) > 20 and all(np.array_equal(seen[key], reference[key]) for key in shared), len(shared)


@pytest.fixture(scope="module")
def batch_bundle(tiny_models, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("two_row") / "b3")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK, batch=3,
                                                              draft_layers=1), progress=False)
    return out


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_batch_rows_and_lone_rows_decode_in_two_rows(batch_bundle, proposer):
    """A batch whose rows end at different times (one runs into the end of the context, then the other runs alone
    through the batch-1 row graphs): each row's tokens under two-row decode equal the one-row plan's but where the
    context ends; batch graphs compute 3 rows at T=1 and keep it, row graphs start at T=2."""
    prompts = [prompt_of(5, 1), prompt_of(110, 2)]
    plain, two = _load(BatchGenerator, batch_bundle, None), _load(BatchGenerator, batch_bundle, TWO_ROWS)
    try:
        want = plain.generate_batch(prompts, 30, proposer=proposer, gamma=4, stop_ids=[], adaptive=False)
        got = two.generate_batch(prompts, 30, proposer=proposer, gamma=4, stop_ids=[], adaptive=False)
        rows = {t for _, t, _ in two.target._row_steps}
        batch = {t for _, t, _ in two.target._steps}
    finally:
        plain.close()
        two.close()
    assert rows and 1 not in rows and 1 in batch, (rows, batch)  # lone rows ran, never in a T=1 row graph
    assert got[1].stats.stop_reason == want[1].stats.stop_reason == "context_full"
    assert got[1].tokens == want[1].tokens[:len(got[1].tokens)] and len(got[1].tokens) >= len(want[1].tokens) - 1
    assert got[0].tokens == want[0].tokens and len(got[0].tokens) == 30
    if proposer != "none":
        assert sum(r.stats.proposed for r in got) > sum(r.stats.accepted for r in got) > 0


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_rows_guess_as_their_batch_1_runs(batch_bundle, layer_draft_pair, proposer):
    """Under two-row decode a round without drafts (prompt lookup found nothing, or a layer draft paused after
    misses) puts a prompt-lookup guess in the padding row; a layer draft's sampled rounds with drafts (which
    carry probabilities) do not. A batch step of several rows at T=1 has no padding row, yet a sampled batch
    row guesses exactly where its batch-1 run does, so a seed still reproduces its batch-1 tokens."""
    _, one = layer_draft_pair  # the same model and export options at batch 1, under two-row decode
    two = _load(BatchGenerator, batch_bundle, TWO_ROWS)
    prompts = repetitive_prompts(3)
    sampling = dict(temperature=0.8, top_k=5, stop_ids=[])
    try:
        results = two.generate_batch(prompts, 40, proposer=proposer, gamma=4, seed=7, **sampling)
    finally:
        two.close()
    made = accepted = proposed = 0
    for b, (prompt, res) in enumerate(zip(prompts, results)):
        alone = one.generate(prompt, 40, proposer=proposer, gamma=4, seed=7 + b, **sampling)
        assert (res.tokens, res.stats.spare_proposed) == (alone.tokens, alone.stats.spare_proposed), b
        made, accepted = made + res.stats.spare_proposed, accepted + res.stats.spare_accepted
        proposed += res.stats.proposed - res.stats.spare_proposed
    assert made > accepted > 0 and proposed > 0, (made, accepted, proposed)


def test_a_row_at_the_end_of_the_context_runs_in_the_batch_step(batch_bundle):
    """Under two-row decode a lone row needs a slot for its padding row: with one slot left it is computed in
    the batch's T=1 step (3 rows) instead of a row graph."""
    plain, two = _load(BatchGenerator, batch_bundle, None), _load(BatchGenerator, batch_bundle, TWO_ROWS)
    try:
        for gen, fits in ((plain, True), (two, False)):
            cache = gen.target.cache
            cache.length[1] = cache.capacity - 1
            assert gen.target.row_fits(1) is fits and gen.target.row_fits(0)
            cache.length[1] = cache.capacity - 2
            assert gen.target.row_fits(1)
    finally:
        plain.close()
        two.close()
