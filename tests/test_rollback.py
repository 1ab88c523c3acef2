"""Commit and rollback are a rewrite of cache_len: after any pattern of accepts and rejects, the valid part
of each cache equals a fresh prefill of the committed tokens, and the buffers are the same objects. A layer
draft reading the target's cache sees exactly that history and never changes it."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.runtime.generator import Generator
from specedge.runtime.model import ModelRunner
from specedge.runtime.proposers import DraftModelProposer, LayerDraftProposer, Sampler, draft_cache_commit
from specedge.runtime.sampling import SamplingParams

TOL = 1e-5


@pytest.fixture(scope="module")
def runtime(tiny_bundle):
    g = Generator.load(tiny_bundle)
    fresh = Generator.load(tiny_bundle)  # a second runtime: the reference prefill
    yield g, fresh
    g.close()
    fresh.close()


def assert_cache_is_prefill_of(runner, reference, tokens):
    reference.reset()
    reference.prefill(tokens)
    n = len(tokens)
    assert runner.cache.used == n
    if n == 0:
        return
    for got, want in zip(runner.cache.keys + runner.cache.values, reference.cache.keys + reference.cache.values):
        assert np.abs(got[:, :, :n] - want[:, :, :n]).max() <= TOL


rounds = st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(2, 999)), min_size=1, max_size=10)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(2, 999), min_size=1, max_size=40), pattern=rounds, seed=st.integers(0, 99))
def test_target_cache_after_random_acceptance(runtime, prompt, pattern, seed):
    g, fresh = runtime
    target = g.target
    rng = np.random.default_rng(seed)
    target.reset()
    target.prefill(prompt[:-1])
    buffers = [b for b in target.cache.keys + target.cache.values]
    pointers = [b.ctypes.data for b in buffers]
    committed = list(prompt)
    for k, accept, correction in pattern:
        k = min(k, target.cache.free - 1)
        if k < 0 or target.step_graph_for(k + 1) is None:
            break
        drafts = rng.integers(2, 999, k).tolist()
        base = target.cache.used
        target.run([committed[-1]] + drafts)
        n = min(accept, k)
        target.cache.set_length(base + 1 + n)  # the commit: nothing else changes
        committed += drafts[:n] + [correction]
        assert_cache_is_prefill_of(target, fresh.target, committed[:-1])
    assert all(a is b for a, b in zip(target.cache.keys + target.cache.values, buffers))
    assert [b.ctypes.data for b in target.cache.keys + target.cache.values] == pointers


@pytest.fixture(scope="module")
def pair_runtime(tiny_pair_bundle):
    g = Generator.load(tiny_pair_bundle)
    fresh = Generator.load(tiny_pair_bundle)
    yield g, fresh
    g.close()
    fresh.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(2, 999), min_size=1, max_size=40), pattern=rounds)
def test_draft_cache_follows_the_commits(pair_runtime, prompt, pattern):
    """A separate draft model's cache holds every committed token but the pending one and those it must
    catch up on (after a full accept, the last draft waits to be fed with the next pending token)."""
    g, fresh = pair_runtime
    assert not g.draft_shares_cache
    proposer = DraftModelProposer(g.draft)
    sampler = Sampler(SamplingParams(), np.random.default_rng(0), g.target.dims.vocab_size)
    proposer.start(prompt)
    committed = list(prompt)
    for k, accept, correction in pattern:
        if g.draft.cache.free < 12:
            break
        proposal = proposer.propose(committed, min(k, 8), sampler)
        n = min(accept, len(proposal))
        proposer.commit(n, correction)
        committed += proposal.tokens[:n] + [correction]
        behind = len(proposer._behind)
        assert_cache_is_prefill_of(g.draft, fresh.draft, committed[: len(committed) - 1 - behind])
        assert committed[len(committed) - 1 - behind:-1] == proposer._behind
        if len(proposal):  # it owes only what it never ran: a fully accepted chain's last draft
            assert behind == (n == len(proposal)), (len(proposal), n, proposer._behind)


@pytest.mark.parametrize("feed, fed_drafts, accepted, keep, behind", [
    ([7], [1, 2, 3], [1, 2], 3, []),  # two of four drafts accepted: both ran
    ([7], [1, 2, 3], [1, 2, 3, 4], 4, [4]),  # all accepted: the last draft never ran
    ([5, 6, 7], [1], [1, 2, 9, 9], 4, [2, 9, 9]),  # a catch-up feed; accepted guesses after the chain
    ([7], [1, 2, 3], [1, 8], 2, [8]),  # the chain was cut (a held-back stop id): a guess where draft 2 was
    ([7], [1, 2, 3], [], 1, []),  # all rejected: the feed stays
    ([5, 7], None, [3, 4], 0, [5, 7, 3, 4]),  # no drafts this round: nothing ran, all is owed
])
def test_a_draft_model_keeps_the_entries_of_accepted_tokens_it_ran(feed, fed_drafts, accepted, keep, behind):
    """The one rule for what a draft model with its own cache keeps after a round, at batch 1 and per batch row."""
    assert draft_cache_commit(feed, fed_drafts, accepted) == (keep, behind)


@pytest.fixture(scope="module")
def own_cache_draft(tiny_bundle):
    """The tiny bundle's layer draft with a cache of its own: the reference for the shared one."""
    g = Generator.load(tiny_bundle)
    runner = ModelRunner("draft", tiny_bundle, g.manifest.draft, g.backend)
    yield runner
    runner.close()
    g.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(2, 999), min_size=1, max_size=40), pattern=rounds)
def test_layer_draft_reads_the_target_cache_and_leaves_its_history_alone(runtime, own_cache_draft, prompt,
                                                                          pattern):
    g, fresh = runtime
    target, draft = g.target, g.draft
    assert g.draft_shares_cache and draft.cache.resident_bytes == 0
    proposer = LayerDraftProposer(draft, target)
    sampler = Sampler(SamplingParams(), np.random.default_rng(0), target.dims.vocab_size)
    target.reset()
    target.prefill(prompt[:-1])
    proposer.start(prompt)
    committed = list(prompt)
    for k, accept, correction in pattern:
        k = min(k, 8, target.cache.free - 1)
        if k < 0 or target.step_graph_for(k + 1) is None:
            break
        if k:
            target.reserve(k + 1)
        base = target.cache.used
        # The draft reads the history the target stored: its logits equal a draft with its own cache.
        own_cache_draft.reset()
        own_cache_draft.prefill(committed[:-1])
        want = own_cache_draft.run(committed[-1:])[-1].copy()
        draft.cache.follow()
        assert np.abs(draft.run(committed[-1:])[-1] - want).max() <= 1e-4
        history = [b[:, :, :base].copy() for b in target.cache.keys + target.cache.values]
        proposal = proposer.propose(committed, k, sampler)
        assert len(proposal) == k
        # Drafting wrote only past the target's valid entries, into the target's own buffers.
        assert all(np.array_equal(b[:, :, :base], h) for b, h in zip(target.cache.keys + target.cache.values, history))
        assert all(a is b for a, b in zip(draft.cache.keys + draft.cache.values,
                                          target.cache.keys[:1] + target.cache.values[:1]))
        target.run([committed[-1]] + proposal.tokens)
        n = min(accept, k)
        target.cache.set_length(base + 1 + n)
        proposer.commit(n, correction)
        committed += proposal.tokens[:n] + [correction]
        assert_cache_is_prefill_of(target, fresh.target, committed[:-1])


class ScriptedProposer:
    """Proposes the next tokens of a known greedy output with the draft at index `wrong[r]` of round r
    changed, so the loop must accept exactly that many drafts and roll the rest back."""

    name = "ngram"

    def __init__(self, prompt_len: int, reference: list[int], wrong: list[int], vocab: int):
        self.prompt_len, self.reference, self.wrong, self.vocab = prompt_len, reference, list(wrong), vocab
        self.expected: list[int] = []  # accepted drafts the loop should report, round by round

    def start(self, prompt, reuse=False):
        pass

    def propose(self, context, k, sampler):
        from specedge.runtime.proposers import Proposal

        done = len(context) - self.prompt_len
        drafts = list(self.reference[done:done + k])
        bad = self.wrong.pop(0) if self.wrong else k
        if bad < len(drafts):
            drafts[bad] = (drafts[bad] + 1) % self.vocab
        self.expected.append(min(bad, len(drafts)))
        return Proposal(drafts, None)

    def commit(self, n_accepted, next_token):
        pass


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(2, 999), min_size=2, max_size=30),
       wrong=st.lists(st.integers(0, 8), min_size=1, max_size=12))
def test_the_loop_rolls_back_rejected_drafts(runtime, prompt, wrong):
    """Driven through Generator.stream: every round keeps exactly the drafts before the scripted wrong one
    (8: none wrong, a fully accepted round) and rolls the others back by rewriting cache_len; the output is
    plain greedy decode's, and the target's cache ends equal to a fresh prefill of everything committed but
    the pending token."""
    g, fresh = runtime
    new = 24
    reference = g.generate(prompt, new + 10, proposer="none", stop_ids=[]).tokens
    scripted = ScriptedProposer(len(prompt), reference, wrong, g.target.dims.vocab_size)
    g._proposer = lambda name, ngram, adaptive=True: scripted
    try:
        rounds = list(g.stream(prompt, new, proposer="ngram", gamma=8, stop_ids=[], adaptive=False))
    finally:
        del g._proposer
    assert sum(rounds, []) == reference[:new]
    accepted = [len(r) - 1 for r in rounds]
    assert accepted[:-1] == scripted.expected[:-1]  # the last round may be cut by max_new_tokens
    assert accepted[-1] <= scripted.expected[-1] and len(rounds) == len(scripted.expected)
    committed = prompt + reference
    assert_cache_is_prefill_of(g.target, fresh.target, committed[: g.target.cache.used])
