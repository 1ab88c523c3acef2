"""Guesses in a verify step's padding rows (runtime/proposers.py NgramProposer.guesses, ModelRunner.padding_rows).

A run loads T=1 and T=gamma+1 only, so a prompt-lookup chain shorter than gamma runs padded into T=gamma+1; the
padding rows then take more prompt-lookup drafts (the continuation of a suffix down to one token) at no cost.
They are drafts like any other: the output stays plain decode's, token for token. (Two-row decode's padding row
is tested in test_two_row_decode.py, a batch's in test_batch.py.)

Chained lookup rarely ends short of gamma on its own (its continuation copies recent text, whose suffix recurs),
so the tests cut its chains to one token: the rows after it are then padding.
"""
from __future__ import annotations

import collections

import pytest
from conftest import repetitive_prompts

from specedge.runtime.generator import Generator
from specedge.runtime.proposers import NgramProposer


@pytest.fixture(scope="module")
def gen(tiny_bundle):
    g = Generator.load(tiny_bundle)
    yield g
    g.close()


@pytest.fixture
def short_chains(monkeypatch):
    real = NgramProposer.propose
    monkeypatch.setattr(NgramProposer, "propose", lambda self, context, k, sampler:
                        real(self, context, k, sampler).cut(1))


@pytest.mark.parametrize("gamma", [2, 4, 8])
def test_guesses_after_a_short_chain_are_verified_like_drafts(gen, gamma, short_chains, monkeypatch):
    """Over a few prompts: the output equals plain decode's with and without the guesses, guesses were made,
    accepted and rejected, and they saved rounds."""
    assert gen.target.padding_rows(1) == 0  # a one-row plan: every guess here follows a chain
    proposed = accepted = made = guessed = rounds = rounds_without = 0
    for prompt in repetitive_prompts(4):
        plain = gen.generate(prompt, 48, proposer="none", stop_ids=[])
        got = gen.generate(prompt, 48, proposer="ngram", gamma=gamma, stop_ids=[], adaptive=False)
        with monkeypatch.context() as patch:
            patch.setattr(gen.target, "padding_rows", lambda n: 0)
            without = gen.generate(prompt, 48, proposer="ngram", gamma=gamma, stop_ids=[], adaptive=False)
        assert got.tokens == plain.tokens == without.tokens
        assert plain.stats.spare_proposed == without.stats.spare_proposed == 0
        proposed += got.stats.proposed
        accepted += got.stats.accepted
        made += got.stats.spare_proposed
        guessed += got.stats.spare_accepted
        rounds += got.stats.rounds
        rounds_without += without.stats.rounds
    assert proposed > accepted > 0 and made > guessed > 0, (proposed, accepted, made, guessed)
    assert rounds < rounds_without, (rounds, rounds_without)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5])
def test_guesses_stop_at_max_new_tokens(gen, max_new_tokens, short_chains):
    """A round never verifies past the tokens still wanted: the output is plain decode's prefix, exactly as long."""
    for prompt in repetitive_prompts(4):
        plain = gen.generate(prompt, 48, proposer="none", stop_ids=[])
        got = gen.generate(prompt, max_new_tokens, proposer="ngram", gamma=8, stop_ids=[], adaptive=False)
        assert got.tokens == plain.tokens[:max_new_tokens]


def test_a_layer_draft_guesses_after_its_chain_shrinks(gen, monkeypatch):
    """After a miss a draft's k shrinks (DraftLength) and its chain runs padded into T=gamma+1: the tiny layer
    draft's misses shrink it to 1 here. Prompt lookup's guesses fill those rows (a layer draft reads the target's
    cache, so an accepted guess needs no catch-up): output equals plain decode with and without them, drafts and
    guesses were made, accepted and rejected, and the guesses saved rounds. (A draft model with its own cache:
    test_batch.py and test_two_row_decode.py, which check what its cache is fed.)"""
    totals = collections.Counter()
    for prompt in repetitive_prompts(4):
        plain = gen.generate(prompt, 48, proposer="none", stop_ids=[])
        got = gen.generate(prompt, 48, proposer="draft", gamma=4, stop_ids=[])
        with monkeypatch.context() as patch:
            patch.setattr(gen.target, "padding_rows", lambda n: 0)
            without = gen.generate(prompt, 48, proposer="draft", gamma=4, stop_ids=[])
        assert got.tokens == plain.tokens == without.tokens and without.stats.spare_proposed == 0
        totals.update(proposed=got.stats.proposed - got.stats.spare_proposed,
                      accepted=got.stats.accepted - got.stats.spare_accepted, made=got.stats.spare_proposed,
                      guessed=got.stats.spare_accepted, rounds=got.stats.rounds,
                      rounds_without=without.stats.rounds)
    assert totals["proposed"] > totals["accepted"] > 0 and totals["made"] > totals["guessed"] > 0, totals
    assert totals["rounds"] < totals["rounds_without"], totals
