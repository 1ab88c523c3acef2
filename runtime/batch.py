"""Several sequences at once: one verify step per round for every row of a bundle exported with --batch B.

Each row keeps the loop's invariant (its cache holds every committed token but its pending one) with its own
`cache_len` entry, its own proposal, acceptance, draft length and stop; a round feeds row b
[pending_b, drafts_b...] padded to the step's T, and commits row b by rewriting cache_len[b]. Rows that are
free, finished or still prefilling are idle in a verify step: they feed nothing and their cache does not
move. Prefill runs chunk by chunk for the rows that have prompt left.

`BatchRunner` is that loop one step at a time, with rows that join and leave whenever a caller wants
(continuous batching: the server admits a request into a free row while the others keep generating);
`BatchGenerator.generate_batch` runs a list of prompts of any length through it, B at a time, each taking the
first row another one frees.

Why a row's output equals its batch-1 output: the step graphs compute every row of a step independently,
and each row bit for bit like a one-token step at its slot (docs/bundle.md, position consistency), so the
logits a row sees do not depend on the other rows, on the step's T or on the context bucket. Sampling draws
from a generator per row (seeded with the row's own seed), so a sampled row also repeats its batch-1 run,
as long as no row is near the end of the context (the step's T is bounded by the fullest row).

A free row keeps the cache of the last sequence it ran (`history`): a request that continues it keeps that
prefix and prefills only the rest, as a batch-1 session does (runtime/session.py).

Proposers: `none`, `ngram` (prompt lookup) and `draft`. Each round the rows that draft run the draft's graphs
together, one batched step per draft position, each row at its own cache length, so a row drafts what it
drafts at batch 1. A layer draft (cut from the target's first layers) reads the target's cache
(kv_cache.SharedKVCache); a draft model of its own has a batch cache of its own, which the rows prefill with
their prompts alongside the target and catch up on the tokens it has not seen, as proposers.DraftModelProposer
does for one sequence.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import GenerationError
from ..graphs import contract as C
from ..graphs.manifest import load_manifest, read_index, weights_index_file
from .acceptance import accept_greedy, accept_sampling
from .backends import create_backend
from .draft_length import DraftLength, StepWidth
from .exactness import warn_if_unverified
from .generator import (GenerationResult, check_min_new_tokens, check_ngram, check_request, check_seed,
                        check_speculation, check_vocab, shares_target_cache, stop_token_set, token_ids)
from .kv_cache import SharedKVCache
from .model import ModelRunner, common_prefix
from .output_history import HISTORY_N_MIN, OutputHistory, output_history
from .proposers import NGRAM_SIZES, Sampler, draft_cache_commit, ngram_chain, ngram_guesses
from .logprobs import TokenLogprob, check_logprobs, token_logprobs
from .penalties import Penalties, PenaltyState, sampling_settings
from .sampling import SamplingParams, emittable_drafts, hold_back, probs_from_logits
from .stats import Stats
from .stop_strings import cut_round, output_text, stop_strings_for
from .text_stream import TextStream
from .tokenizer import Tokenizer


@dataclass
class Row:
    """One sequence in a batch row."""

    prompt: list[int]
    max_new_tokens: int
    proposer: str
    gamma: int
    params: SamplingParams
    rng: np.random.Generator
    stop: set[int]
    ngram: tuple[int, int]
    length: DraftLength
    stats: Stats
    sampler: Sampler  # draws the row's drafts and acceptances from `rng`, in the order batch 1 does
    prefill: list[int]  # prompt tokens still to put in the cache (the last prompt token stays pending)
    context: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    reason: str = ""  # why it finished ("" while it runs)
    min_new_tokens: int = 0  # the stop ids are held back until the output has this many tokens
    penalty: PenaltyState | None = None  # logit bias, repetition / presence / frequency penalties (None: off)
    logprobs: int | None = None  # alternatives per token when the row reports logprobs (None: off)
    stop_strings: TextStream | None = None  # the row's text, watched for its stop strings (None: none)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    # a draft model with a cache of its own (proposers.DraftModelProposer's state, per row)
    draft_prefill: list[int] = field(default_factory=list)  # prompt tokens its cache still lacks
    draft_behind: list[int] = field(default_factory=list)  # committed tokens it lacks, the pending one excluded
    draft_feed: list[int] = field(default_factory=list)  # what this round fed it: behind + the pending token
    draft_base: int = 0  # its cache length when the round began


class BatchRunner:
    def __init__(self, target: ModelRunner, manifest, eos_ids: list[int], draft: ModelRunner | None = None):
        """`draft`: the bundle's draft model (a layer draft reading the target's cache, or a model with a batch
        cache of its own), or None."""
        self.target, self.manifest, self.eos_ids = target, manifest, list(eos_ids)
        self.draft = draft
        self.own_draft_cache = draft is not None and not isinstance(draft.cache, SharedKVCache)
        self.draft_history: list[list[int]] = [[] for _ in range(target.dims.batch)]  # own draft cache, per row
        # Drafts of one row lengthen every row's verify step, so each round the batch picks the step graph
        # (of those warm loaded) that its rows' drafts are expected to pay for, and cuts them to it.
        self.step_width = StepWidth([1])
        self.batch = target.dims.batch
        self.rows: list[Row | None] = [None] * self.batch
        self.history: list[list[int]] = [[] for _ in range(self.batch)]  # what each free row's cache holds
        # earlier outputs prompt lookup also drafts from (runtime/output_history.py); None: off
        self.output_history: OutputHistory | None = None
        self._gammas: set[int] = set()
        # True: `warm` also makes the row step sessions lone rows use, in every bucket (a server: no request
        # waits for one); False: each is made when a lone row first needs it (about 6 MB each, SmolLM2 int4)
        self.eager_row_steps = False

    # -- rows in and out -----------------------------------------------------------------------------
    def check(self, prompts: list[list[int]], max_new_tokens: int, proposer: str, gamma: int,
              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
              presence_penalty: float = 0.0, frequency_penalty: float = 0.0, min_p: float = 0.0,
              logit_bias: dict[int, float] | None = None) -> tuple[SamplingParams, Penalties]:
        """Refuse what the rows cannot run (GenerationError); returns the sampling parameters and penalties."""
        params, penalties = sampling_settings(self.target.dims.vocab_size, temperature, top_k, top_p, min_p,
                                              repetition_penalty, presence_penalty, frequency_penalty, logit_bias)
        check_request(prompts, self.target.dims, max_new_tokens)
        check_speculation(self.manifest, self.draft is not None, proposer, gamma)
        if proposer != "none":
            warn_if_unverified(self.manifest, self.target.backend_name, self.target.bundle_dir)
        return params, penalties

    def free_row(self, prompt: list[int]) -> int | None:
        """The free row whose cache holds the longest prefix of the prompt (None: every row is busy)."""
        free = [b for b, r in enumerate(self.rows) if r is None]
        return max(free, key=lambda b: common_prefix(self.history[b], prompt[:-1]), default=None)

    def admit(self, b: int, prompt: list[int], max_new_tokens: int = 128, proposer: str = "ngram", gamma: int = 4,
              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
              stop_ids: list[int] | None = None, ngram: tuple[int, int] = NGRAM_SIZES, adaptive: bool = True,
              min_new_tokens: int = 0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
              frequency_penalty: float = 0.0, min_p: float = 0.0, logprobs: int | None = None,
              logit_bias: dict[int, float] | None = None, stop_strings: TextStream | None = None) -> Row:
        """Start a sequence in free row b, keeping what the row's cache already holds of its prompt.
        `stop_strings`: a fresh TextStream that watches this sequence for its stop strings
        (stop_strings.stop_strings_for), or None."""
        prompt = token_ids(prompt)
        params, penalties = self.check([prompt], max_new_tokens, proposer, gamma, temperature, top_k, top_p,
                                       repetition_penalty, presence_penalty, frequency_penalty, min_p, logit_bias)
        check_min_new_tokens(min_new_tokens)
        check_seed(seed)
        check_logprobs(logprobs)
        stop, ngram = stop_token_set(stop_ids, self.eos_ids), check_ngram(ngram)
        if self.rows[b] is not None:
            raise ValueError(f"row {b} is busy")
        self.warm(gamma if proposer != "none" else 0)
        stats = Stats()
        stats.proposer, stats.gamma, stats.prompt_tokens = proposer, gamma if proposer != "none" else 0, len(prompt)
        stats.start()
        keep = common_prefix(self.history[b], prompt[:-1])
        self.history[b] = []
        self.target.cache.set_row_length(b, keep)
        stats.reused_tokens = keep
        rng = np.random.default_rng(seed)
        penalty = None if penalties.off else PenaltyState(penalties, self.target.dims.vocab_size, prompt)
        row = Row(prompt, max_new_tokens, proposer, gamma, params, rng,
                  stop, ngram,
                  DraftLength(gamma if proposer != "none" else 0, adaptive, shrink=proposer == "draft"), stats,
                  Sampler(params, rng, self.target.dims.vocab_size, penalty), prompt[keep:-1], list(prompt),
                  min_new_tokens=min_new_tokens, penalty=penalty, logprobs=logprobs, stop_strings=stop_strings)
        if self.own_draft_cache and proposer == "draft":
            keep = common_prefix(self.draft_history[b], prompt[:-1])
            self.draft.cache.set_row_length(b, keep)
            row.draft_prefill = prompt[keep:-1]
        self.draft_history[b] = []
        self.rows[b] = row
        return row

    def _lookup(self, row: Row, k: int) -> list[int]:
        """Prompt lookup for one row, then the output history (as proposers.NgramProposer does)."""
        context = np.asarray(row.context)
        chain = ngram_chain(context, k, *row.ngram)
        if not chain and self.output_history is not None:
            chain = self.output_history.lookup(context, k, max(row.ngram[0], HISTORY_N_MIN), row.ngram[1])
        return chain

    def release(self, b: int) -> Row:
        """Free row b; its cache keeps the sequence's committed tokens for a later request to reuse, and its
        output goes into the output history, if any."""
        row = self.rows[b]
        if self.output_history is not None:
            self.output_history.add(row.output)
        committed = row.context[:-1]
        n = min(int(self.target.cache.length[b]), len(committed))  # a cut round may have stored more
        self.target.cache.set_row_length(b, n)
        self.history[b] = committed[:n]
        if self.own_draft_cache and row.proposer == "draft":  # it holds committed tokens, in order, up to its length
            n = min(int(self.draft.cache.length[b]), len(committed))
            self.draft.cache.set_row_length(b, n)
            self.draft_history[b] = committed[:n]
        self.rows[b] = None
        return row

    def finish(self, b: int, reason: str) -> None:
        row = self.rows[b]
        if not row.reason:
            row.reason = reason
            row.stats.finish(reason)

    @property
    def active(self) -> list[int]:
        return [b for b, r in enumerate(self.rows) if r is not None and not r.reason]

    def warm(self, gamma: int) -> None:
        """Load the verify graph a row with this gamma (0: plain decode) needs; T=1 and every gamma seen stay
        loaded (and, with `eager_row_steps`, their row step graphs). Admitting a row does it; a server calls it
        first so that no request waits for it."""
        if gamma in self._gammas:
            return
        self._gammas.add(gamma)
        # Every step graph up to the longest proposal, not only T=1 and T=gamma+1 as at batch 1: a step computes
        # B*T rows, so padding a short proposal into the widest graph costs B times what it costs one row
        # (SmolLM2 float32 at batch 4: T=2 1.31x a T=1 step, T=5 1.93x).
        widest = max(g + 1 for g in self._gammas)
        steps = self.target.use_steps([t for t in self.target.entry.step_tokens() if t <= widest])
        # a round's seconds depend on (bucket, T) only, so those measured before stay true for the wider set
        self.step_width.widths = sorted(steps)
        self.target.warm(_prefill_graphs(self.target) + [(C.STEP, t) for t in steps])
        self.target.warm_rows(steps=self.eager_row_steps)
        if self.draft is not None and gamma and not self.own_draft_cache:
            self.draft.warm([(C.STEP, t) for t in self.draft.use_steps([1])])
        elif self.draft is not None and gamma:  # T=2 feeds a fully accepted round's last draft with the pending token
            self.draft.warm(_prefill_graphs(self.draft) + [(C.STEP, t) for t in self.draft.use_steps([1, 2])])
            self.draft.warm_rows()

    # -- steps ---------------------------------------------------------------------------------------
    def prefill_step(self) -> bool:
        """One prefill chunk for the rows with prompt left (and one for an own-cache draft's rows); False when
        none has."""
        pending = [r.prefill if r is not None and not r.reason else [] for r in self.rows]
        drafting = [r.draft_prefill if r is not None and not r.reason else [] for r in self.rows]
        if not any(pending) and not any(drafting):
            return False
        if any(pending):
            for row, n in zip(self.rows, _prefill_rows(self.target, pending)):
                if n:
                    row.prefill = row.prefill[n:]
        if any(drafting):
            for row, n in zip(self.rows, _prefill_rows(self.draft, drafting)):
                if n:
                    row.draft_prefill = row.draft_prefill[n:]
        for row in self.rows:
            if row is not None and not row.prefill and not row.draft_prefill and not row.stats.prefill_ms:
                row.stats.prefill_ms = row.stats.ms_since_start()
        return True

    def decode_step(self, closed: bool = False) -> dict[int, list[int]]:
        """One verify step for every running row whose prompt is in the cache; returns the tokens each row
        committed (after its stop and length cuts). A row that finishes gets its `reason`. `closed`: no
        sequence joins before the running ones end, so the step width aims at finishing them all soonest."""
        began = time.perf_counter()
        target, capacity = self.target, self.target.cache.capacity
        ready = [b for b in self.active if not self.rows[b].prefill and not self.rows[b].draft_prefill]
        # The step's width is chosen for greedy rows with an adaptive draft length, whose drafts are cut to it.
        # A sampled row keeps its own length, so that its random draws (drafts, then acceptances) stay those of
        # its batch-1 run with the same seed; a row that asked for a fixed length (adaptive=False) gets it.
        capped = {b for b in ready if self.rows[b].proposer != "none" and self.rows[b].length.adaptive
                  and self.rows[b].params.greedy}
        steps = target.step_sizes
        feeds: list[list[int]] = [[] for _ in range(self.batch)]
        drafts: dict[int, list[int]] = {}
        wanted: dict[int, int] = {}  # rows that draft with the layer draft: how many tokens
        room = capacity - target.cache.used  # a step's T must fit the fullest row too
        for b in ready:
            row = self.rows[b]
            free = capacity - int(target.cache.length[b])
            if free < 1:
                self.finish(b, "context_full")
                continue
            k = min(row.length.next(), row.max_new_tokens - len(row.output) - 1, max(steps) - 1, free - 1)
            while k > 0 and not any(k + 1 <= t <= room for t in steps):
                k -= 1
            # prompt lookup drafts for free, so its drafts are known before the width is chosen
            drafts[b] = self._lookup(row, k) if k > 0 and row.proposer == "ngram" else []
            if k > 0 and row.proposer == "draft":
                wanted[b] = k
        if not drafts:
            return {}
        # A row that runs alone takes the row step graphs (bundle version 4): a batch step computes every row.
        # Its rounds cost less than the batch's, so their seconds are measured apart.
        only = next(iter(drafts)) if len(drafts) == 1 else None
        lone = only if only is not None and target.row_fits(only) else None

        def cost_key():  # the bucket the step runs in (a run may move the cache to a larger one)
            return target.cache.bucket if lone is None else (target.cache.bucket, "row")
        if capped & drafts.keys():
            available = {b: len(drafts[b]) if self.rows[b].proposer == "ngram" else wanted.get(b, 0) for b in drafts}
            least = 1 + max((available[b] for b in drafts if b not in capped), default=0)
            left = {b: self.rows[b].max_new_tokens - len(self.rows[b].output) for b in drafts}
            rows = [(available[b], self.rows[b].length.acceptance.rate, left[b]) for b in drafts]
            most = max((t for t in steps if t <= room), default=1)
            width = self.step_width.choose(rows, cost_key(), least, most, closed,
                                           widths=None if lone is None else target.row_step_sizes)
            for b in capped & drafts.keys():
                if available[b] and width == 1:
                    self.rows[b].length.acceptance.unverified()
                drafts[b] = drafts[b][:width - 1]
                if b in wanted:
                    wanted[b] = min(wanted[b], width - 1)
                    if not wanted[b]:
                        del wanted[b]
        for b in wanted:
            self.rows[b].sampler.hold_back(len(self.rows[b].output), self.rows[b].min_new_tokens, self.rows[b].stop)
        if self.own_draft_cache:
            drafting = [b for b in drafts if self.rows[b].proposer == "draft"]
            draft_probs = self._draft_model_rows(wanted, drafts, drafting)
        else:
            draft_probs = self._draft_rows(wanted, drafts) if wanted else {}
        for b, d in drafts.items():
            row = self.rows[b]
            if len(row.output) < row.min_new_tokens:  # a held-back stop id ends what can be accepted
                n = emittable_drafts(d, len(row.output), row.min_new_tokens, row.stop)
                if n < len(d):  # an own-cache draft row then re-feeds a token it already ran: the same entry
                    drafts[b] = d = d[:n]
                    if draft_probs.get(b) is not None:
                        draft_probs[b] = draft_probs[b][:n]
            feeds[b] = [row.context[-1]] + d
        proposed = {b: len(d) for b, d in drafts.items()}  # without guesses
        self._add_guesses(drafts, feeds, lone)
        bases = {b: int(target.cache.length[b]) for b in drafts}
        sessions = target.sessions
        if lone is None:
            logits = target.run_rows(feeds)  # [B, T, V]: T is the step graph the round ran in
            width = logits.shape[1]
        else:
            logits = {lone: target.run_row(lone, feeds[lone])}  # row -> [T, V]
            width = logits[lone].shape[0]
        committed = {}
        for b, d in drafts.items():
            row = self.rows[b]
            rows_b = logits[b][:len(d) + 1]
            raw = rows_b.copy() if row.logprobs is not None else None  # row j chose the j-th new token
            if row.penalty is not None:
                rows_b = row.penalty.apply(rows_b, [d[:j] for j in range(len(d) + 1)])
            if len(row.output) < row.min_new_tokens:  # row j chooses new token len(output) + j
                rows_b = hold_back(rows_b, len(row.output) + np.arange(len(d) + 1), row.min_new_tokens, row.stop)
            if row.params.greedy:
                accepted, token = accept_greedy(np.asarray(d, np.int64), rows_b)
            else:
                accepted, token = accept_sampling(np.asarray(d, np.int64), draft_probs.get(b),
                                                  probs_from_logits(rows_b, row.params), row.rng)
            target.cache.set_row_length(b, bases[b] + 1 + accepted)
            if self.own_draft_cache and row.proposer == "draft":
                self._commit_draft_model_row(b, d, proposed[b], accepted)
            row.length.update(proposed[b], min(accepted, proposed[b]))
            new, reason = cut_round(d[:accepted] + [int(token)], len(row.output), row.max_new_tokens, row.stop,
                                    row.stop_strings)
            if reason:
                self.finish(b, reason)
            row.context += new
            row.output += new
            if row.penalty is not None:
                row.penalty.commit(new)
            if raw is not None:
                row.token_logprobs += token_logprobs(raw[:len(new)], new, row.logprobs)
            row.stats.record_round(len(d), len(new) - 1)
            row.stats.record_tokens(len(new))
            row.stats.spare_proposed += len(d) - proposed[b]
            row.stats.spare_accepted += max(0, len(new) - 1 - proposed[b])
            committed[b] = new
        # A batch step costs the same for any number of running rows (idle rows are padding). A round that made
        # a session (a lone row's first row step of this width and bucket) would teach the choice its making.
        if target.sessions == sessions:
            self.step_width.update(cost_key(), width, time.perf_counter() - began)
        return committed

    def _add_guesses(self, drafts: dict[int, list[int]], feeds: list[list[int]], lone: int | None) -> None:
        """Prompt-lookup guesses (proposers.ngram_guesses) in the padding rows of the step about to run, which
        computes them anyway: a row whose chain is shorter than the widest row's (or who proposed nothing) pads
        to the step's width T. Prompt-lookup rows take them, and draft rows whose drafts carry no probabilities
        (greedy, or a round without drafts): a draft token costs a draft step, a guess nothing. A
        sampled row fills only the padding it would have at batch 1 (its chain in the step graphs a batch-1 run of
        its gamma uses, T=1 and T=gamma+1, where the batch loads every T up to the widest), so that its
        acceptance draws, and its output, stay those of its batch-1 run with the same seed."""
        if lone is None:
            width = self.target.step_graph_for(max(len(f) for f in feeds))
        else:
            width = self.target.row_step_width(lone, len(feeds[lone]))
        for b, d in drafts.items():
            row = self.rows[b]
            # As at batch 1 (Generator: guesses follow drafts without probabilities). An own-cache draft model
            # feeds its accepted guesses with its next round's pending token (_commit_draft_model_row).
            if row.proposer == "none" or (row.proposer == "draft" and d and not row.params.greedy):
                continue
            if row.params.greedy:
                padding = width - len(feeds[b])
            else:
                padding = self.target.padding_rows(len(feeds[b]), self.target.steps_for([1, row.gamma + 1], row=True))
            room = min(padding, row.max_new_tokens - len(row.output) - 1 - len(d))
            n_max = row.ngram[1] if row.proposer == "ngram" else NGRAM_SIZES[1]  # the sizes batch 1's proposer has
            guesses = ngram_guesses(np.asarray(row.context + d), room, n_max) if room > 0 else []
            if guesses and len(row.output) < row.min_new_tokens:  # a held-back stop id ends what can be accepted
                guesses = guesses[:emittable_drafts(d + guesses, len(row.output), row.min_new_tokens, row.stop)
                                  - len(d)]
            if guesses:
                drafts[b] = d + guesses
                feeds[b] = feeds[b] + guesses

    def _draft_rows(self, wanted: dict[int, int], drafts: dict[int, list[int]]) -> dict[int, np.ndarray | None]:
        """wanted[b] drafts for each row b from the layer draft, into drafts[b]; every row starts at the
        target's valid length. Returns each row's draft distributions q [k, V] (None when greedy)."""
        self.target.reserve(max(wanted.values()) + 1)  # the verify step's bucket, before draft entries exist
        self.draft.cache.follow()
        return self._draft_positions(wanted, {b: [self.rows[b].context[-1]] for b in wanted}, drafts)

    def _draft_model_rows(self, wanted: dict[int, int], drafts: dict[int, list[int]],
                          rows: list[int]) -> dict[int, np.ndarray | None]:
        """The own-cache draft model's round for `rows` (every row that drafts with it, wanted[b] tokens or
        none): each feeds what its cache lacks plus the pending token (a long catch-up is prefilled first)."""
        draft = self.draft
        for b in rows:
            row = self.rows[b]
            row.draft_feed = row.draft_behind + [row.context[-1]]
            row.draft_base = int(draft.cache.length[b])
        wanted = {b: k for b, k in wanted.items() if k > 0}
        if not wanted:
            return {}
        widest = max(draft.step_sizes)
        while any(len(self.rows[b].draft_feed) > widest for b in wanted):  # rare: many rounds without drafts
            lag = [self.rows[b].draft_feed[:-1] if b in wanted and len(self.rows[b].draft_feed) > widest else []
                   for b in range(self.batch)]
            for b, n in enumerate(draft.prefill_chunk(lag)):
                if n:  # those n tokens are in the cache now: the round's feed starts after them
                    self.rows[b].draft_feed = self.rows[b].draft_feed[n:]
                    self.rows[b].draft_base += n
        return self._draft_positions(wanted, {b: self.rows[b].draft_feed for b in wanted}, drafts)

    def _draft_positions(self, wanted: dict[int, int], first: dict[int, list[int]],
                         drafts: dict[int, list[int]]) -> dict[int, np.ndarray | None]:
        """One batched draft step per draft position: position 0 feeds each row `first[b]`, position j its
        draft j-1 (a row with fewer drafts is idle), so each row drafts what it drafts at batch 1. Appends to
        drafts[b]; returns each row's draft distributions q [k, V] (None when greedy)."""
        probs: dict[int, list] = {b: [] for b in wanted}
        feeds = [first[b] if b in wanted else [] for b in range(self.batch)]
        for j in range(max(wanted.values())):
            if j:
                feeds = [[drafts[b][-1]] if wanted.get(b, 0) > j else [] for b in range(self.batch)]
            logits = self.draft.run_rows(feeds)  # [B, T, V]
            for b, k in wanted.items():
                if j < k:
                    token, q = self.rows[b].sampler.draft_from(logits[b, len(feeds[b]) - 1], j)
                    drafts[b].append(token)
                    probs[b].append(q)
        return {b: None if self.rows[b].params.greedy else np.stack(q) for b, q in probs.items()}

    def _commit_draft_model_row(self, b: int, verified: list[int], k: int, accepted: int) -> None:
        """Keep what the target accepted in the own-cache draft's row (draft_cache_commit, as at batch 1):
        `verified` is the round's chain, its first k tokens the draft's own (the rest guesses)."""
        row = self.rows[b]
        keep, row.draft_behind = draft_cache_commit(row.draft_feed, verified[:k - 1] if k else None,
                                                    verified[:accepted])
        self.draft.cache.set_row_length(b, row.draft_base + keep)


def _prefill_graphs(runner: ModelRunner) -> list[tuple[str, int]]:
    """The batch prefill graphs a runner uses: none when it prefills one row at a time (row graphs)."""
    return [] if runner.row_prefill_sizes else [(C.PREFILL, t) for t in runner.entry.prefill_tokens()]


def _prefill_rows(runner: ModelRunner, pending: list[list[int]]) -> list[int]:
    """One prefill chunk for every row with tokens pending; how many each took. With row graphs (bundle
    version 3) each such row runs alone, so idle rows and short prompts cost nothing; otherwise one batch
    chunk computes every row, idle ones included."""
    if not runner.row_prefill_sizes:
        return runner.prefill_chunk(pending)
    return [runner.prefill_row(b, p) if p else 0 for b, p in enumerate(pending)]


class BatchGenerator:
    def __init__(self, bundle_dir: str, manifest, backend):
        self.bundle_dir, self.manifest, self.backend = bundle_dir, manifest, backend
        self.tokenizer = Tokenizer.from_bundle(bundle_dir, manifest)  # first: a bad file fails before the caches
        self.target = ModelRunner("target", bundle_dir, manifest.target, backend,
                                  logits_scale=manifest.logits_scale("target"))
        self.batch = manifest.target.dims.batch
        self.eos_ids = list(manifest.tokenizer.eos_ids)
        self.draft = None
        if manifest.draft:
            shares = self.target if shares_target_cache(manifest) else None
            self.draft = ModelRunner("draft", bundle_dir, manifest.draft, backend, shares=shares,
                                     logits_scale=manifest.logits_scale("draft"), draft_of=manifest.target)
        self.runner = BatchRunner(self.target, manifest, self.eos_ids, self.draft)

    @classmethod
    def load(cls, bundle: str, backend: str = "cpu", threads: int | None = None,
             history_tokens: int = 0) -> "BatchGenerator":
        """history_tokens N > 0: prompt lookup also drafts from the last N tokens of earlier outputs."""
        history = output_history(history_tokens)
        manifest = load_manifest(bundle)
        check_vocab(manifest)
        engine = create_backend(backend, threads)
        try:
            for weights in {m.weights for m in manifest.models.values()}:
                engine.add_weights_file(os.path.join(bundle, weights),
                                        read_index(os.path.join(bundle, weights_index_file(weights))))
            gen = cls(bundle, manifest, engine)
        except BaseException:  # a bad weights index or tokenizer file: let go of the weights files mapped so far
            engine.close()
            raise
        gen.runner.output_history = history
        return gen

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
        self.target.close()
        self.backend.close()

    def generate_batch(self, prompts, max_new_tokens: int = 128, proposer: str = "ngram", gamma: int = 4,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                       stop_ids: list[int] | None = None, ngram: tuple[int, int] = NGRAM_SIZES,
                       adaptive: bool = True, min_new_tokens: int = 0, repetition_penalty: float = 1.0,
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       min_p: float = 0.0, logprobs: int | None = None,
                       logit_bias: dict[int, float] | None = None,
                       stop: str | list[str] | None = None) -> list[GenerationResult]:
        """Generate for any number of prompts through the bundle's B rows; returns one GenerationResult per
        prompt, in order. Up to B run at once, and the next prompt takes a row as soon as one finishes
        (continuous batching), so the verify steps stay full while the sequences end at different rounds.
        A newcomer goes to the free row whose cache holds the longest prefix of it (a shared system prompt is
        prefilled once per row) and is prefilled before the next decode step: every step then carries as many
        rows as it can. Prompt i samples with seed + i. `stop`: strings that end each output, as in
        Generator.stream (a result's text is its text before the string)."""
        if not prompts:
            raise GenerationError("no prompts")
        prompts = [token_ids(p, f" {i}") for i, p in enumerate(prompts)]
        runner = self.runner
        more = dict(repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty, min_p=min_p, logit_bias=logit_bias)  # check and admit
        runner.check(prompts, max_new_tokens, proposer, gamma, temperature, top_k, top_p, **more)  # before any row
        check_min_new_tokens(min_new_tokens)
        check_seed(seed)
        check_logprobs(logprobs)
        stop_strings_for(self.tokenizer, stop)  # refused before any row runs
        runner.history = [[] for _ in range(self.batch)]  # a batch starts from empty caches
        self.target.reset()
        waiting = list(range(len(prompts)))
        running: dict[int, int] = {}  # row -> prompt index
        results: list[GenerationResult | None] = [None] * len(prompts)
        while waiting or running:
            while waiting and (b := runner.free_row(prompts[waiting[0]])) is not None:
                i = waiting.pop(0)
                runner.admit(b, prompts[i], max_new_tokens, proposer, gamma, temperature, top_k, top_p,
                             None if seed is None else seed + i, stop_ids, ngram, adaptive, min_new_tokens,
                             logprobs=logprobs, **more,
                             stop_strings=stop_strings_for(self.tokenizer, stop, min_new_tokens))
                running[b] = i
            while runner.prefill_step():
                pass
            runner.decode_step(closed=not waiting)
            for b in [b for b in running if runner.rows[b].reason]:
                r = runner.release(b)
                results[running.pop(b)] = GenerationResult(r.prompt, r.output, r.stats,
                                                           output_text(self.tokenizer, r.output, r.stop_strings),
                                                           r.token_logprobs if logprobs is not None else None)
        return results
