"""Proposers: where draft tokens come from. One small interface, three implementations.

  start(prompt, reuse)          the prompt is committed; its last token is pending (not yet in any cache);
                                reuse: keep what the proposer's cache already holds of it
  propose(context, k, sampler)  up to k draft tokens continuing `context` (prompt + output so far, pending
                                last) and their real draft distributions q [k, V], or None when q is a
                                point mass (a deterministic proposer)
  commit(n_accepted, next)      the target kept the first n_accepted drafts and then `next`: sync state

`none` proposes nothing (plain decode); `ngram` looks the context's suffix up earlier in the context (prompt
lookup); `draft` runs the bundle's draft model, whose cache follows the same invariant as the target's: it
holds every committed token except the pending one. A draft cut from the target's own first layers
(`LayerDraftProposer`) reads the target's cache, which holds exactly that already.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import GenerationError
from .draft_length import RateChoice
from .model import ModelRunner, common_prefix
from .output_history import HISTORY_N_MIN, OutputHistory
from .penalties import PenaltyState
from .sampling import (SamplingParams, emittable_drafts, emittable_nodes, greedy_token, hold_back, probs_from_logits,
                       sample_token)


@dataclass
class Proposal:
    tokens: list[int]
    draft_probs: np.ndarray | None  # q, float64 [k, V_target]; None: a point mass on each token
    parents: list[int] | None = None  # a token tree (runtime/tree.py: spine plus leaves); None: a chain

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, n: int) -> "Proposal":
        """The chain's first n drafts (a proposer's commit takes any n_accepted up to what it proposed)."""
        if n >= len(self.tokens) or self.parents is not None:
            return self
        return Proposal(self.tokens[:n], None if self.draft_probs is None else self.draft_probs[:n])

    def emittable(self, first_position: int, min_new_tokens: int, stop) -> "Proposal":
        """Without the drafts that held-back stop ids would get rejected (sampling.emittable_drafts and
        emittable_nodes): a chain is cut before the first, a tree loses those nodes and what hangs under them
        (a tree left without leaves becomes a chain, as ngram_tree gives one). The output is the same; the
        verify step is smaller."""
        if self.parents is None:
            return self.cut(emittable_drafts(self.tokens, first_position, min_new_tokens, stop))
        kept = emittable_nodes(self.tokens, self.parents, first_position, min_new_tokens, stop)
        if len(kept) == len(self.tokens):
            return self
        index = {old: new for new, old in enumerate(kept)}
        parents = [0 if self.parents[i] == 0 else index[self.parents[i] - 1] + 1 for i in kept]
        probs = None if self.draft_probs is None else self.draft_probs[kept]
        tokens = [self.tokens[i] for i in kept]
        return Proposal(tokens, probs, None if parents == list(range(len(kept))) else parents)


EMPTY = Proposal([], None)


class Sampler:
    """The sampling settings and random stream one generation shares between draft and acceptance."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator, vocab_size: int,
                 penalty: PenaltyState | None = None):
        self.params, self.rng, self.vocab_size = params, rng, vocab_size
        # (output position of this round's first draft, min_new_tokens, stop ids) while stop ids are held back
        self.held: tuple[int, int, set[int]] | None = None
        # the generation's penalties (runtime/penalties.py), when on: drafts are penalized as the target's rows
        # are, each with the round's drafts before it, so they are accepted as often as without penalties
        self.penalty = penalty
        self._drafted: list[int] = []  # this round's drafts so far

    def hold_back(self, emitted: int, min_new_tokens: int, stop) -> None:
        """This round's drafts start at output position `emitted`: keep held-back stop ids out of them."""
        self.held = (emitted, min_new_tokens, stop) if emitted < min_new_tokens else None

    def draft_from(self, logits: np.ndarray, position: int = 0) -> tuple[int, np.ndarray | None]:
        """One draft token from draft logits [V_draft] for the round's draft `position`, with its q over the
        target's vocabulary. A stop id the target holds back there gets q = 0 too: the target would reject
        it, and the draft's next choice may be accepted (any q keeps acceptance exact). Penalties, when on,
        shape the draft's logits like the target's rows (in place where the array allows it)."""
        del self._drafted[position:]
        if self.penalty is not None:
            logits = self.penalty.apply(logits[None], [self._drafted])[0]
        if self.held is not None:
            emitted, min_new_tokens, stop = self.held
            logits = hold_back(logits[None], [emitted + position], min_new_tokens, stop)[0]
        if self.params.greedy:
            token, q = greedy_token(logits[: self.vocab_size]), None
        else:
            q = np.zeros(self.vocab_size)
            shared = min(self.vocab_size, logits.shape[-1])  # a smaller draft head leaves q = 0 above it
            q[:shared] = probs_from_logits(logits[None, :shared], self.params)[0]
            token = sample_token(q, self.rng)
        self._drafted.append(token)
        return token, q


class NoProposer:
    name = "none"

    def start(self, prompt: list[int], reuse: bool = False) -> None:
        pass

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Proposal:
        return EMPTY

    def guesses(self, context: list[int], n: int) -> list[int]:
        return []  # plain decode stays plain decode: its padding row stays padding

    def commit(self, n_accepted: int, next_token: int, leaf: int | None = None) -> None:
        pass


# Suffix sizes prompt lookup tries, longest first. 8 (not 4) picks the right one of several earlier
# occurrences of a short suffix more often: with chained lookup, 5-6% more tokens per round at k=8 replayed
# on the prompt suite's and the short edits' plain outputs, 2-3% fewer rounds measured in the adaptive loop
# (benchmarks/ngram/README.md). 1-token suffixes draft too often for what they add.
NGRAM_SIZES = (2, 8)


class NgramProposer:
    """Prompt lookup: the longest suffix (n_max down to n_min tokens) seen earlier; its continuation, chained.
    With an OutputHistory (runtime/output_history.py), a round that finds nothing in the context looks the
    suffix up in earlier outputs."""

    name = "ngram"

    def __init__(self, n_min: int = NGRAM_SIZES[0], n_max: int = NGRAM_SIZES[1],
                 history: OutputHistory | None = None, adaptive: bool = True):
        if not 1 <= n_min <= n_max:
            raise GenerationError(f"ngram sizes must satisfy 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.history = history
        # Whether the history's drafts pay: they come from other texts and are accepted less often than the
        # context's, while a verify step costs more with every row (SmolLM2 int4 on 2 cores: T=9 2.9 decode
        # steps, where they lost 1-5% on the short edits; float32 gained 2-4%). Rounds where only the history
        # has drafts run with or without them, whichever has committed more tokens per second.
        self._use_history = RateChoice((True, False), adaptive)
        self._history_round: tuple[bool, float] | None = None  # this round's choice and when it was made

    def start(self, prompt: list[int], reuse: bool = False) -> None:
        pass

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Proposal:
        if k < 1:
            return EMPTY
        context = np.asarray(context)
        chain = ngram_chain(context, k, self.n_min, self.n_max)
        return Proposal(chain or self._from_history(context, k), None)

    def guesses(self, context: list[int], n: int) -> list[int]:
        """Up to n more drafts after `context` (which ends with this round's chain) for rows that the verify
        step computes anyway (its graph's padding rows, ModelRunner.padding_rows: two-row decode's second row
        in a round that proposes nothing, or the rows after a chain shorter than the graph)."""
        return ngram_guesses(np.asarray(context), n, self.n_max)

    def propose_tree(self, context: list[int], k: int, nodes: int, sampler: Sampler) -> Proposal:
        if k < 1 or nodes < 1:
            return EMPTY
        context = np.asarray(context)
        tokens, parents = ngram_tree(context, k, nodes, self.n_min, self.n_max)
        if not tokens:  # nothing in the context: a chain from the history, if any
            tokens = self._from_history(context, k)
        return Proposal(tokens, None, parents) if tokens else EMPTY

    def _from_history(self, context: np.ndarray, k: int) -> list[int]:
        if self.history is None:
            return []
        drafts = self.history.lookup(context, k, max(self.n_min, HISTORY_N_MIN), self.n_max)
        if not drafts:
            return []
        use = self._use_history.choose()
        self._history_round = (use, time.perf_counter())
        return drafts if use else []

    def commit(self, n_accepted: int, next_token: int, leaf: int | None = None) -> None:
        if self._history_round is not None:  # what this round, with or without the history's drafts, was worth
            use, start = self._history_round
            self._history_round = None
            self._use_history.update(use, n_accepted + 1 + (leaf is not None), time.perf_counter() - start)


def ngram_tree(context: np.ndarray, k: int, nodes: int, n_min: int, n_max: int) -> tuple[list[int], list[int] | None]:
    """Prompt lookup with several matches: a spine plus leaves (runtime/tree.py), at most `nodes` nodes; the
    parents are None when no leaf was found (the proposal is a chain).

    The spine is the continuation of the most recent occurrence of the longest matching suffix (the chain
    proposal), extended by looking its own end up again when the match ran into the end of the context.
    Every other occurrence of a matching suffix (longest first, most recent first) contributes the token
    where its continuation leaves the spine, as a leaf under the spine node before it: when the spine's
    token there is rejected, the target may still accept that alternative."""
    starts = list(dict.fromkeys(match_starts(context, n_min, n_max)))  # distinct, in priority order
    if not starts:
        return [], None
    spine = ngram_chain(context, k, n_min, n_max)[:nodes]
    tokens, parents = list(spine), list(range(len(spine)))
    seen = set()
    for start in starts[1:]:
        if len(tokens) >= nodes:
            break
        cont = context[start:start + len(spine)].tolist()
        d = next((i for i, t in enumerate(cont) if t != spine[i]), None)  # where it leaves the spine
        if d is None or (d, cont[d]) in seen:
            continue
        seen.add((d, cont[d]))
        tokens.append(cont[d])
        parents.append(d)  # the child of spine node d-1 (of the root when d = 0)
    return tokens, (parents if len(tokens) > len(spine) else None)


def ngram_guesses(context: np.ndarray, n: int, n_max: int) -> list[int]:
    """Drafts for padding rows, which a verify step computes whatever they hold: the chain of the longest
    suffix down to one token. A 1-token suffix drafts too often to pay for a longer verify step (NGRAM_SIZES),
    but here a draft costs nothing, and an accepted one saves a round."""
    return ngram_chain(context, n, 1, n_max)


def ngram_chain(context: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """The chain proposal: `ngram_lookup`, and while its continuation runs into the end of the context (the
    match was recent, as in repeated lines) short of k tokens, the lookup again on the context extended by it
    (chained lookup)."""
    chain = ngram_lookup(context, k, n_min, n_max)
    while 0 < len(chain) < k:
        more = ngram_lookup(np.concatenate([context, np.asarray(chain, context.dtype)]), k - len(chain), n_min, n_max)
        if not more:
            break
        chain += more
    return chain


def ngram_lookup(context: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Continuation (up to k tokens) of the most recent earlier occurrence of the longest matching suffix."""
    start = next(match_starts(context, n_min, n_max), None)
    return [] if start is None else context[start:start + k].tolist()


def match_starts(context: np.ndarray, n_min: int, n_max: int):
    """Where the continuations of earlier occurrences of the context's suffix start: suffixes of n_max down to
    n_min tokens, for each the most recent occurrence first.

    Runs every round, so it is one pass over the context instead of one per suffix size (about 20 us
    instead of 180-270 us on a 600-token context): the candidates are the positions after an earlier
    occurrence of the last token, and each gets the length of its match, counted backwards."""
    length = len(context)
    longest = min(n_max, length - 1)
    if longest < n_min or length < 2:
        return
    # c: a continuation start 1 .. length-1 (never the suffix itself); context[c-1] equals the last token.
    starts = np.flatnonzero(context[:length - 1] == context[length - 1]) + 1
    matched = np.ones(len(starts), np.int64)  # tokens before c that equal the suffix's, up to `longest`
    alive = np.ones(len(starts), bool)
    for j in range(1, longest):
        if not alive.any():
            break
        before = starts - 1 - j
        alive &= before >= 0
        alive[alive] = context[before[alive]] == context[length - 1 - j]
        matched += alive
    for n in range(longest, n_min - 1, -1):
        for hit in starts[matched >= n][::-1]:
            yield int(hit)


class DraftModelProposer:
    """The bundle's draft model: k steps of its T=1 graph; T=2 when it catches up after a full accept."""

    name = "draft"

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._behind: list[int] = []  # committed tokens the draft cache lacks, the pending one excluded
        self._feed: list[int] = []
        self._proposed: list[int] = []
        self._base = 0
        self._context = 0  # tokens of the context this round was proposed for
        self._verified: list[int] | None = None  # the chain the round verifies, when guesses follow it

    def start(self, prompt: list[int], reuse: bool = False) -> None:
        if not reuse:
            self.runner.reset()
        self.runner.prefill_reusing(prompt[:-1])
        self._behind = []

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Proposal:
        return self.propose_tree(context, k, k, sampler)

    def guesses(self, context: list[int], n: int) -> list[int]:
        """Prompt lookup's guesses (ngram_guesses) for the verify step's padding rows (rounds this draft sits out
        after misses, the rows after a chain whose k shrank): free there. An accepted guess is a token this
        model's cache never ran, so `commit` puts it behind, to be fed with the next round's pending token."""
        guesses = ngram_guesses(np.asarray(context), n, NGRAM_SIZES[1])
        self._verified = list(context[self._context:]) + guesses  # the chain as verified (maybe cut), guesses
        return guesses

    def propose_tree(self, context: list[int], k: int, nodes: int, sampler: Sampler) -> Proposal:
        """A chain of k drafts, plus leaves (the draft's next candidates at the first positions) up to
        `nodes` nodes; nodes == k: a chain."""
        cache = self.runner.cache
        self._feed = self._behind + [context[-1]]
        self._base = cache.used
        self._proposed, self._context, self._verified = [], len(context), None
        # Slots needed: the feed, then every draft but the last (it is never fed back).
        k = min(k, cache.free - len(self._feed) + 1)
        if k < 1:
            return EMPTY
        if self.runner.step_graph_for(len(self._feed)) is None:
            self.runner.prefill(self._feed[:-1])  # a long catch-up (rare): fill, then step on the last
            logits = self.runner.run(self._feed[-1:])[-1]
        else:
            logits = self.runner.run(self._feed)[-1]
        proposal = draft_tokens(self.runner, logits, k, sampler, max(nodes, k))
        self._proposed = proposal.tokens[:k]
        return proposal

    def commit(self, n_accepted: int, next_token: int, leaf: int | None = None) -> None:
        """n_accepted tokens of the chain (and of the guesses after it) were kept, then `leaf` (a tree node off
        the chain) if given."""
        accepted = (self._proposed if self._verified is None else self._verified)[:n_accepted]
        keep, self._behind = draft_cache_commit(self._feed, self._proposed[:-1] if self._proposed else None, accepted)
        self.runner.cache.set_length(self._base + keep)
        if leaf is not None:  # a tree node off the chain: never fed either
            self._behind.append(leaf)


def draft_cache_commit(feed: list[int], fed_drafts: list[int] | None, accepted: list[int]) -> tuple[int, list[int]]:
    """What a draft model with its own cache keeps after a round (batch 1 and each row of a batch). The round
    fed it `feed` (the committed tokens it lacked, then the pending one) and, when it drafted, each of its drafts
    but the last (`fed_drafts`; None when it sat the round out and ran nothing). `accepted`: the tokens the target
    accepted after the pending one (drafts, then guesses). Returns (entries past the round's base to keep, the
    committed tokens it now lacks): the entries of accepted tokens it ran stay; the rest (after a full accept
    the last draft, never fed; accepted guesses) is fed with the next round's pending token."""
    if fed_drafts is None:  # the target consumed the feed without drafts; the draft's cache never saw it
        return 0, feed + accepted
    ran = common_prefix(accepted, fed_drafts)
    return len(feed) + ran, accepted[ran:]


class LayerDraftProposer:
    """A draft cut from the target's first layers, reading the target's cache (runtime/kv_cache.py,
    SharedKVCache): the target's verify steps already stored every committed token's K/V for these layers,
    so there is no prefill and no catch-up; each round starts at the target's valid length."""

    name = "draft"

    def __init__(self, runner: ModelRunner, target: ModelRunner):
        self.runner, self.target = runner, target

    def start(self, prompt: list[int], reuse: bool = False) -> None:
        self.runner.reset()  # its length only: the entries it reads are the target's

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Proposal:
        return self.propose_tree(context, k, k, sampler)

    def guesses(self, context: list[int], n: int) -> list[int]:
        """Prompt lookup's guesses (ngram_guesses) for the verify step's padding rows: after a miss the draft's
        k shrinks (DraftLength) and its chain runs padded into T=gamma+1. They cost no draft step, and the
        draft reads the target's cache, which the verify step fills for every accepted token: no catch-up."""
        return ngram_guesses(np.asarray(context), n, NGRAM_SIZES[1])

    def propose_tree(self, context: list[int], k: int, nodes: int, sampler: Sampler) -> Proposal:
        if k < 1:
            return EMPTY
        # The verify step's bucket, chosen now: the shared buffers must not change bucket while draft
        # entries sit past the target's valid length.
        self.target.reserve(max(nodes, k) + 1, tree=nodes > k)
        cache = self.runner.cache
        cache.follow()
        k = min(k, cache.free)  # the pending token and k-1 drafts take k slots
        return draft_tokens(self.runner, self.runner.run(context[-1:])[-1], k, sampler, max(nodes, k))

    def commit(self, n_accepted: int, next_token: int, leaf: int | None = None) -> None:
        pass  # the target's commit is the draft's: the next round follows its valid length


def draft_tokens(runner: ModelRunner, logits: np.ndarray, k: int, sampler: Sampler, nodes: int | None = None) -> Proposal:
    """k drafts from a draft model, starting from its logits after the pending token; each but the last is
    fed back (the last is never needed: the target's verify step judges it).

    nodes > k: a tree (runtime/tree.py, spine plus leaves): the chain, then leaves with the draft's next most
    likely tokens at each position, the first positions first (where a leaf is most often reached), until
    `nodes`. A leaf is a deterministic candidate: its row of draft_probs is a point mass on it."""
    tokens, probs, leaves = [], [], []
    budget = max(0, (nodes or k) - k)
    for j in range(k):
        token, q = sampler.draft_from(logits, j)
        tokens.append(token)
        probs.append(q)
        if budget > len(leaves):
            width = -(-(budget - len(leaves)) // (k - j))  # the rest of the budget, front-loaded
            ranked = np.argsort(-logits[: sampler.vocab_size], kind="stable")[: width + 1]
            leaves += [(j, int(t)) for t in ranked if int(t) != token][:width]
        if j < k - 1:
            logits = runner.run([token])[-1]
    if not leaves:
        return Proposal(tokens, None if sampler.params.greedy else np.stack(probs))
    parents = list(range(k)) + [j for j, _ in leaves]
    if not sampler.params.greedy:
        point = np.zeros((len(leaves), sampler.vocab_size))
        point[np.arange(len(leaves)), [t for _, t in leaves]] = 1.0
        probs = list(probs) + list(point)
    return Proposal(tokens + [t for _, t in leaves], None if sampler.params.greedy else np.stack(probs), parents)
