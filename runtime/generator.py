"""The speculative loop: draft -> verify -> commit, over a bundle's static step graphs.

Invariant, per model: its cache holds every committed token except the last one, the *pending* token.
Each round:
  1. draft   the proposer offers k tokens d_1..d_k (with their real q when sampled);
  2. verify  the target runs one step on [pending, d_1..d_k]; row j of its logits judges d_{j+1}, row k
             gives the bonus token;
  3. commit  accept greedily (argmax, lowest id on ties) or by min(1, p/q) with a residual resample; the
             target keeps pending + accepted drafts by setting cache_len, the proposer syncs the same way,
             and the new token becomes pending.
Plain decode is the same loop with k = 0, through the same graphs.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..errors import BundleError, GenerationError
from ..graphs import contract as C
from ..graphs.manifest import Manifest, load_manifest, read_index, weights_index_file
from .acceptance import accept_greedy, accept_sampling
from .tree import TreeLayout, spine_length
from .tree_acceptance import accept_tree, accept_tree_greedy
from .backends import create_backend
from .draft_length import DraftLength, TreeChoice
from .exactness import warn_if_unverified
from .logprobs import TokenLogprob, check_logprobs, token_logprobs
from .model import ModelRunner
from .output_history import OutputHistory, output_history
from .penalties import PenaltyState, sampling_settings
from .kv_cache import SharedKVCache
from .proposers import (NGRAM_SIZES, DraftModelProposer, LayerDraftProposer, NgramProposer, NoProposer, Proposal,
                        Sampler)
from .sampling import hold_back, is_int, probs_from_logits
from .stats import Stats
from .stop_strings import cut_round, output_text, stop_strings_for
from .text_stream import TextStream
from .tokenizer import Tokenizer

PROPOSERS = ("draft", "ngram", "none")


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]
    stats: Stats
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for (runtime/logprobs.py)


class Generator:
    def __init__(self, bundle_dir: str, manifest: Manifest, backend):
        self.bundle_dir = bundle_dir
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = Tokenizer.from_bundle(bundle_dir, manifest)  # first: a bad file fails before the caches
        self.target = ModelRunner("target", bundle_dir, manifest.target, backend,
                                  logits_scale=manifest.logits_scale("target"))
        self.draft = None
        if manifest.draft:
            shares = self.target if shares_target_cache(manifest) else None
            self.draft = ModelRunner("draft", bundle_dir, manifest.draft, backend, shares=shares,
                                     logits_scale=manifest.logits_scale("draft"), draft_of=manifest.target)
        self.eos_ids = list(manifest.tokenizer.eos_ids)
        self._sessions_seen = (0, 0)
        self.active_session = None  # the runtime.session.Session whose entries the caches hold, if any
        # Earlier outputs prompt lookup also drafts from (runtime/output_history.py); None: off. Every
        # generation's output is added to it.
        self.output_history: OutputHistory | None = None

    @classmethod
    def load(cls, bundle: str, backend: str = "cpu", threads: int | None = None,
             history_tokens: int = 0) -> "Generator":
        """history_tokens N > 0: prompt lookup also drafts from the last N tokens of earlier outputs."""
        history = output_history(history_tokens)
        manifest = load_manifest(bundle)
        if manifest.target.dims.batch != 1:
            raise BundleError(f"this bundle has batch {manifest.target.dims.batch}: run it with specedge generate "
                              "--prompts FILE.jsonl (runtime.batch.BatchGenerator), or export with --batch 1")
        check_vocab(manifest)
        engine = create_backend(backend, threads)
        try:
            for weights in {m.weights for m in manifest.models.values()}:
                index = read_index(os.path.join(bundle, weights_index_file(weights)))
                engine.add_weights_file(os.path.join(bundle, weights), index)
            gen = cls(bundle, manifest, engine)
        except BaseException:  # a bad weights index or tokenizer file: let go of the weights files mapped so far
            engine.close()
            raise
        gen.output_history = history
        return gen

    @property
    def draft_shares_cache(self) -> bool:
        """Whether the draft reads the target's cache (a layer draft) instead of keeping its own."""
        return self.draft is not None and isinstance(self.draft.cache, SharedKVCache)

    def close(self) -> None:
        self.target.close()
        if self.draft:
            self.draft.close()
        self.backend.close()

    # -- validation ----------------------------------------------------------------------------------
    def _validate(self, prompt_ids, max_new_tokens, proposer, gamma, tree: int = 0) -> None:
        check_request([prompt_ids], self.target.dims, max_new_tokens)
        check_speculation(self.manifest, self.draft is not None, proposer, gamma)
        if proposer != "none":
            warn_if_unverified(self.manifest, self.backend.name, self.bundle_dir)
        if not is_int(tree) or tree < 0:
            raise GenerationError(f"tree must be an int >= 0 (0 = chains), not {tree!r}")
        if tree and proposer != "none":
            trees = self.manifest.target.tree_tokens()
            if tree not in trees:
                raise GenerationError(f"tree {tree} has no tree graph in this bundle (export with --tree {tree}); "
                                      f"exported trees: {', '.join(map(str, trees)) or 'none'}")
            if gamma > tree - 1:
                raise GenerationError(f"gamma {gamma} drafts do not fit a tree of {tree - 1} nodes")

    def _proposer(self, name: str, ngram: tuple[int, int], adaptive: bool = True):
        if name == "draft":
            if self.draft_shares_cache:
                return LayerDraftProposer(self.draft, self.target)
            return DraftModelProposer(self.draft)
        if name == "ngram":
            return NgramProposer(*ngram, history=self.output_history, adaptive=adaptive)
        return NoProposer()

    def warm(self, proposer: str, gamma: int, tree: int = 0, prompt: int | None = None, new: int = 0) -> None:
        """Choose and create the sessions this run uses, so a broken graph fails before any output and no
        session is created inside a timed round: the prefill graphs, T=1 and the verify graph T=gamma+1
        (shorter proposals pad into it), the tree graph, and the draft's graphs when it drafts. With the
        `prompt` length (and `new` tokens) known, only the context buckets the run can reach get sessions:
        the prefill plan's graphs in the buckets they run in, step graphs from the prompt to the run's end (a
        graph's padding rows need slots too, so its width is added). Sessions are kept."""
        def runner_warm(runner, prefill, steps, trees=()):
            if prompt is None:
                runner.warm(prefill + steps, trees)
                return
            widest = max([t for _, t in steps] + list(trees))
            if prefill:  # a draft that shares the target's cache prefills nothing
                runner.warm_prefill(prompt - 1)
            runner.warm(steps, trees, start=prompt - 1, reach=prompt + new + widest)

        prefill = [(C.PREFILL, t) for t in self.manifest.target.prefill_tokens()]
        steps = self.target.use_steps([1] + ([gamma + 1] if proposer != "none" else []))
        trees = self.target.use_trees([tree] if tree and proposer != "none" else [])
        runner_warm(self.target, prefill, [(C.STEP, t) for t in steps], trees)
        if proposer == "draft" and self.draft_shares_cache:
            runner_warm(self.draft, [], [(C.STEP, t) for t in self.draft.use_steps([1])])  # no prefill, no catch-up
        elif proposer == "draft":
            prefill = [(C.PREFILL, t) for t in self.manifest.draft.prefill_tokens()]
            runner_warm(self.draft, prefill, [(C.STEP, t) for t in self.draft.use_steps([1, 2])])
        if (self.target.sessions, self.draft.sessions if self.draft else 0) != self._sessions_seen:
            self.backend.release_raw_weights()  # new sessions packed their weights: the raw pages can go
            self._sessions_seen = (self.target.sessions, self.draft.sessions if self.draft else 0)

    def _max_drafts(self, wanted: int) -> int:
        """The most drafts (<= wanted) whose verify step fits a graph and the free cache slots."""
        for k in range(wanted, 0, -1):
            if self.target.step_graph_for(k + 1) is not None:
                return k
        return 0

    # -- the loop ------------------------------------------------------------------------------------
    def stream(self, prompt_ids, max_new_tokens: int = 128, proposer: str | None = None, gamma: int = 4,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               stop_ids: list[int] | None = None, stats: Stats | None = None,
               ngram: tuple[int, int] = NGRAM_SIZES, adaptive: bool = True, reuse: bool = False,
               tree: int = 0, min_new_tokens: int = 0, repetition_penalty: float = 1.0,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               min_p: float = 0.0, logprobs: int | None = None,
               logprobs_out: list[TokenLogprob] | None = None,
               logit_bias: dict[int, float] | None = None,
               stop: str | list[str] | TextStream | None = None) -> Iterator[list[int]]:
        """Yield the tokens each round commits (after stop/limit cuts). Fills `stats` if given.

        `tree` T > 0 verifies token trees of up to T-1 nodes in the bundle's tree graph T (export --tree): the
        proposer's chain of up to gamma drafts plus alternatives (runtime/tree.py); a round whose proposer
        found no alternative verifies its chain as usual. With `adaptive`, rounds use trees only while tree
        rounds commit more tokens per second than chain rounds (draft_length.TreeChoice).

        `proposer` None: the bundle's draft model when it has one, else prompt lookup (ngram), as the CLI.

        `adaptive` lets the draft length follow acceptance (see draft_length.py); gamma is its ceiling.
        `reuse` keeps the cached prefix that the last generation (or a restored session) shares with this
        prompt and prefills only the rest; the output is the same as without it (runtime/session.py).

        `min_new_tokens` holds the stop ids back (probability 0) until the output has that many tokens, as
        HF's `min_new_tokens`; benchmarks use it to make every run exactly max_new_tokens long.

        `repetition_penalty` (HF's: > 1 discourages every token of the prompt and output), `presence_penalty`
        and `frequency_penalty` (OpenAI's, in [-2, 2], over the output) change the target's law; speculation
        stays exact for the penalized law (runtime/penalties.py), as it does with `logit_bias` (OpenAI's: token id
        -> a number in [-100, 100] added to its logit, before the penalties). `top_k`, `top_p` and `min_p` filter the
        target's and the draft's distributions alike (sampling.probs_from_logits).

        `logprobs` N (0..20): append each committed token's TokenLogprob (its log-probability and the N most
        likely tokens', from the raw row that chose it: runtime/logprobs.py) to `logprobs_out`, a round's
        entries before its tokens are yielded.

        `stop`: strings that end the output where its text first contains one (OpenAI's `stop`; needs the
        bundle's tokenizer), after the token that completes it, as plain decode would end it: a speculative
        round's tokens past it are dropped (runtime/stop_strings.py). As stop ids are held back, a stop string
        counts only when completed by a token after the first min_new_tokens. `generate` returns the text before
        the string. A TextStream passed as `stop` (runtime/text_stream.py) is fed every token and shows the
        caller the text as it grows."""
        params, penalties = sampling_settings(self.target.dims.vocab_size, temperature, top_k, top_p, min_p,
                                              repetition_penalty, presence_penalty, frequency_penalty, logit_bias)
        prompt = token_ids(prompt_ids)
        if proposer is None:
            proposer = "draft" if self.draft is not None else "ngram"
        self._validate(prompt, max_new_tokens, proposer, gamma, tree)
        check_min_new_tokens(min_new_tokens)
        check_seed(seed)
        check_logprobs(logprobs)
        if logprobs is not None and not isinstance(logprobs_out, list):
            raise GenerationError("logprobs needs logprobs_out, a list to append each token's logprobs to")
        # a TextStream given as `stop` (generate, the CLI) is the caller's view of the output's text
        stop_strings = stop if isinstance(stop, TextStream) else stop_strings_for(self.tokenizer, stop, min_new_tokens)
        stop = stop_token_set(stop_ids, self.eos_ids)
        ngram = check_ngram(ngram)
        stats = stats if stats is not None else Stats()
        stats.proposer, stats.gamma, stats.prompt_tokens = proposer, gamma if proposer != "none" else 0, len(prompt)
        tree = tree if proposer != "none" else 0
        stats.tree = tree
        penalty = None if penalties.off else PenaltyState(penalties, self.target.dims.vocab_size, prompt)
        sampler = Sampler(params, np.random.default_rng(seed), self.target.dims.vocab_size, penalty)
        drafter = self._proposer(proposer, ngram, adaptive)
        length = DraftLength(gamma if proposer != "none" else 0, adaptive, shrink=proposer == "draft")
        choice = TreeChoice(adaptive)
        target = self.target
        graph_before = target.graph_seconds + (self.draft.graph_seconds if self.draft else 0.0)

        self.warm(proposer, gamma, tree, prompt=len(prompt), new=max_new_tokens)
        stats.start()
        if not reuse:
            target.reset()
        stats.reused_tokens = target.prefill_reusing(prompt[:-1])
        drafter.start(prompt, reuse)
        stats.prefill_ms = stats.ms_since_start()
        graph_after_prefill = target.graph_seconds + (self.draft.graph_seconds if self.draft else 0.0)
        context = list(prompt)
        emitted = 0
        reason = ""
        clean = True  # the caches hold exactly what the loop committed (false while a round runs)
        try:
            while not reason:
                if target.step_graph_for(1) is None:  # no free slot (two-row decode: none for its padding row)
                    reason = "context_full"
                    break
                clean = False
                t0 = time.perf_counter()
                k = self._max_drafts(min(length.next(), max_new_tokens - emitted - 1))
                as_tree = bool(tree and k and target.tree_graph_for(tree) is not None and choice.use_tree())
                sampler.hold_back(emitted, min_new_tokens, stop)
                if as_tree:
                    proposal = drafter.propose_tree(context, k, tree - 1, sampler)
                else:
                    proposal = drafter.propose(context, k, sampler)
                # The verify step computes its graph's padding rows anyway (two-row decode's second row, a
                # short chain padded into T=gamma+1): guesses there (prompt lookup's) cost nothing, and
                # DraftLength does not see them.
                if emitted < min_new_tokens:  # a held-back stop id ends what can be accepted
                    proposal = proposal.emittable(emitted, min_new_tokens, stop)
                proposed = len(proposal.tokens)
                if proposal.parents is None and proposal.draft_probs is None:
                    room = min(target.padding_rows(1 + proposed), max_new_tokens - emitted - 1 - proposed)
                    guesses = drafter.guesses(context + proposal.tokens, room) if room > 0 else []
                    if guesses:
                        proposal = Proposal(proposal.tokens + guesses, None)
                        if emitted < min_new_tokens:
                            proposal = proposal.emittable(emitted, min_new_tokens, stop)
                t1 = time.perf_counter()
                base = target.cache.used
                if proposal.parents is None:  # a chain
                    logits = target.run([context[-1]] + proposal.tokens)  # [k+1, V]
                    raw = logits.copy() if logprobs is not None else None  # row j chose the j-th new token
                    if penalty is not None:
                        logits = penalty.apply(logits, [proposal.tokens[:j] for j in range(len(logits))])
                    if emitted < min_new_tokens:  # row j chooses new token emitted + j
                        logits = hold_back(logits, emitted + np.arange(len(logits)), min_new_tokens, stop)
                    t2 = time.perf_counter()
                    if params.greedy:
                        n_accepted, next_token = accept_greedy(np.asarray(proposal.tokens, np.int64), logits)
                    else:
                        p = probs_from_logits(logits, params)
                        n_accepted, next_token = accept_sampling(np.asarray(proposal.tokens, np.int64),
                                                                 proposal.draft_probs, p, sampler.rng)
                    target.cache.set_length(base + 1 + n_accepted)
                    drafter.commit(n_accepted, next_token)
                    length.update(proposed, min(n_accepted, proposed))
                    accepted, depth = proposal.tokens[:n_accepted], len(proposal.tokens)
                else:
                    hold = (emitted, min_new_tokens, stop)
                    accepted, next_token, depth, raw = self._verify_tree(
                        proposal, context[-1], base, params, sampler, drafter, length, stats, hold, penalty,
                        keep_raw=logprobs is not None)
                    t2 = time.perf_counter()
                new, reason = cut_round(accepted + [int(next_token)], emitted, max_new_tokens, stop, stop_strings)
                stats.spare_proposed += len(proposal.tokens) - proposed
                stats.spare_accepted += max(0, len(new) - 1 - proposed)
                if tree and k:  # what this kind of round was worth (proposing and verifying)
                    choice.update(as_tree, len(new), time.perf_counter() - t0)
                context += new
                emitted += len(new)
                if penalty is not None:
                    penalty.commit(new)
                if raw is not None:
                    logprobs_out += token_logprobs(raw[:len(new)], new, logprobs)
                stats.record_round(len(proposal.tokens), len(new) - 1, depth)
                stats.record_tokens(len(new))
                stats.draft_ms += (t1 - t0) * 1e3
                stats.verify_ms += (t2 - t1) * 1e3
                stats.commit_ms += (time.perf_counter() - t2) * 1e3
                clean = True
                yield new
        finally:  # also when the consumer stops early (a client gone): the cache stays reusable
            self._keep_history(context[:-1] if clean else None, drafter)
            if clean and self.output_history is not None:
                self.output_history.add(context[len(prompt):])
            graph_after = target.graph_seconds + (self.draft.graph_seconds if self.draft else 0.0)
            stats.graph_ms = (graph_after - graph_before) * 1e3
            stats.decode_graph_ms = (graph_after - graph_after_prefill) * 1e3
            stats.finish(reason or ("cancelled" if clean else "error"))

    def _verify_tree(self, proposal, pending: int, base: int, params, sampler, drafter, length, stats, hold,
                     penalty: PenaltyState | None, keep_raw: bool = False):
        """One verify step over a token tree (spine plus leaves, runtime/tree.py); commit the accepted path.
        hold = (tokens emitted so far, min_new_tokens, stop ids). Returns (accepted tokens, next token, the
        tree's depth, and with keep_raw the raw rows that chose them, else None)."""
        tokens, parents = proposal.tokens, proposal.parents
        layout = TreeLayout.build(pending, tokens, parents)
        logits = self.target.run_tree(layout)  # [N+1, V]
        raw = logits.copy() if keep_raw else None
        if penalty is not None:
            logits = penalty.apply(logits, layout.prefixes())
        emitted, min_new_tokens, stop = hold
        if emitted < min_new_tokens:  # row r chooses new token emitted + depth(r)
            logits = hold_back(logits, emitted + layout.depth, min_new_tokens, stop)
        if params.greedy:
            path, next_token = accept_tree_greedy(tokens, parents, logits)
        else:
            path, next_token = accept_tree(tokens, parents, probs_from_logits(logits, params), proposal.draft_probs,
                                           sampler.rng)
        self.target.commit_tree(base, path)
        spine = spine_length(parents)
        off_chain = bool(path) and path[-1] >= spine
        on_chain = len(path) - off_chain
        if off_chain:
            drafter.commit(on_chain, next_token, leaf=tokens[path[-1]])
        else:
            drafter.commit(on_chain, next_token)
        length.update(spine, on_chain)
        stats.tree_rounds += 1
        stats.tree_nodes += len(tokens)
        stats.off_chain_accepted += off_chain
        chose = [0] + [i + 1 for i in path]  # the root's row chose the first token, node i's row the next
        return [tokens[i] for i in path], next_token, int(layout.depth.max()), None if raw is None else raw[chose]

    def _keep_history(self, committed: list[int] | None, drafter) -> None:
        """Record what the caches hold after a generation, for the next prefill to reuse (None: unknown)."""
        runners = [self.target] + ([self.draft] if isinstance(drafter, DraftModelProposer) else [])
        for runner in runners:
            if committed is None:
                runner.history = []
            else:
                runner.keep_history(committed)

    def generate(self, prompt_ids, max_new_tokens: int = 128, proposer: str | None = None, gamma: int = 4,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop_ids: list[int] | None = None, ngram: tuple[int, int] = NGRAM_SIZES,
                 adaptive: bool = True, reuse: bool = False, tree: int = 0,
                 min_new_tokens: int = 0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, min_p: float = 0.0, logprobs: int | None = None,
                 logit_bias: dict[int, float] | None = None, stop: str | list[str] | None = None) -> GenerationResult:
        stats = Stats()
        stop_strings = stop_strings_for(self.tokenizer, stop, min_new_tokens)
        tokens: list[int] = []
        entries: list[TokenLogprob] | None = [] if logprobs is not None else None
        for new in self.stream(prompt_ids, max_new_tokens, proposer, gamma, temperature, top_k, top_p, seed,
                               stop_ids, stats=stats, ngram=ngram, adaptive=adaptive, reuse=reuse, tree=tree,
                               min_new_tokens=min_new_tokens, repetition_penalty=repetition_penalty,
                               presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                               min_p=min_p, logprobs=logprobs, logprobs_out=entries, logit_bias=logit_bias,
                               stop=stop_strings):
            tokens += new
        return GenerationResult(list(map(int, prompt_ids)), tokens, stats,
                                output_text(self.tokenizer, tokens, stop_strings), entries)


def check_request(prompts: list[list[int]], dims: C.ModelDims, max_new_tokens: int) -> None:
    """Refuse prompts the graphs cannot run (one prompt: "the prompt"; several: "the prompt i")."""
    S, V = dims.context, dims.vocab_size
    for i, prompt in enumerate(prompts):
        which = "" if len(prompts) == 1 else f" {i}"
        if len(prompt) == 0:
            raise GenerationError(f"the prompt{which} is empty")
        if len(prompt) >= S:
            raise GenerationError(f"the prompt{which} has {len(prompt)} tokens; the bundle's context holds {S}, "
                                  "so prompts must be shorter than that")
        bad = [t for t in prompt if not 0 <= int(t) < V]
        if bad:
            raise GenerationError(f"prompt{which} token id {bad[0]} is outside the vocabulary (0..{V - 1})")
    if not is_int(max_new_tokens):
        raise GenerationError(f"max_new_tokens must be an int, not {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be at least 1, not {max_new_tokens}")


def token_ids(prompt_ids, which: str = "") -> list[int]:
    """A prompt as a list of ints; a string (text where ids belong) or a non-integer id is a GenerationError
    (int() would read "12" as a token and truncate 1.5 to 1)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise GenerationError(f"the prompt{which} must be token ids, not text: encode it with the generator's "
                              "tokenizer (tokenizer.encode or apply_chat_template)")
    try:
        ids = list(prompt_ids)
    except TypeError:
        raise GenerationError(f"the prompt{which} must be a list of token ids, not {prompt_ids!r}") from None
    bad = [t for t in ids if not is_int(t)]
    if bad:
        raise GenerationError(f"the prompt{which} must be integer token ids; it holds {bad[0]!r}")
    return [int(t) for t in ids]


def stop_token_set(stop_ids, default: list[int]) -> set[int]:
    """The ids that end a generation: `default` (the bundle's EOS ids) for None, else a list of token ids
    (a string would quietly be a set of characters that no token equals)."""
    if stop_ids is None:
        return set(default)
    ids = [] if isinstance(stop_ids, (str, bytes)) else _iterable(stop_ids, "stop_ids")
    if isinstance(stop_ids, (str, bytes)) or not all(is_int(t) for t in ids):
        raise GenerationError(f"stop_ids must be a list of token ids (or None: the bundle's EOS), not {stop_ids!r}")
    return {int(t) for t in ids}


def check_ngram(ngram) -> tuple[int, int]:
    """Prompt lookup's suffix lengths (n_min, n_max), 1 <= n_min <= n_max."""
    pair = list(_iterable(ngram, "ngram"))
    if len(pair) != 2 or not all(is_int(n) for n in pair) or not 1 <= pair[0] <= pair[1]:
        raise GenerationError(f"ngram must be (n_min, n_max) with 1 <= n_min <= n_max, not {ngram!r}")
    return int(pair[0]), int(pair[1])


def _iterable(value, name: str):
    try:
        return list(value)
    except TypeError:
        raise GenerationError(f"{name} must be a list, not {value!r}") from None


def check_min_new_tokens(min_new_tokens) -> None:
    if not is_int(min_new_tokens) or min_new_tokens < 0:
        raise GenerationError(f"min_new_tokens must be an int >= 0 (0 = off), not {min_new_tokens!r}")


def check_seed(seed) -> None:
    """None (fresh entropy) or an int >= 0, which numpy's generators take; a negative one raised deep inside
    numpy."""
    if seed is not None and (not is_int(seed) or seed < 0):
        raise GenerationError(f"seed must be an int >= 0 (or left out), not {seed!r}")


def check_speculation(manifest: Manifest, has_draft: bool, proposer: str, gamma: int) -> None:
    """The proposer exists, 'draft' has a draft model to run, and gamma has a verify graph (GenerationError if
    not). One check for a generator, a batch generator and the server's defaults and requests."""
    check_proposer(has_draft, proposer)
    if proposer != "none":
        check_gamma(manifest, gamma)


def check_proposer(has_draft: bool, proposer: str) -> None:
    if proposer not in PROPOSERS:
        raise GenerationError(f"unknown proposer {proposer!r}; choose one of {', '.join(PROPOSERS)}")
    if proposer == "draft" and not has_draft:
        raise GenerationError("proposer 'draft' needs a bundle with a draft model (export with --draft or "
                              "--draft-layers), or use --proposer ngram")


def check_gamma(manifest: Manifest, gamma: int) -> None:
    """A draft length needs the target's verify graph T = gamma + 1."""
    if not is_int(gamma):
        raise GenerationError(f"gamma must be an int, not {gamma!r}")
    verify = [t - 1 for t in manifest.target.step_tokens() if t > 1]
    if gamma < 1:
        raise GenerationError(f"gamma (drafts per round) must be at least 1, not {gamma}; exported gammas: "
                              f"{', '.join(map(str, verify)) or 'none'}")
    if gamma not in verify:
        raise GenerationError(f"gamma {gamma} has no verify graph (T={gamma + 1}) in this bundle; "
                              f"exported gammas: {', '.join(map(str, verify)) or 'none'}")


def shares_target_cache(manifest: Manifest) -> bool:
    draft, target = manifest.draft, manifest.target
    return draft.layers_of == "target" and SharedKVCache.compatible(draft.dims, target.dims, draft.buckets(),
                                                                     target.buckets())


def check_vocab(manifest: Manifest) -> None:
    """A draft must speak the target's vocabulary; the exporter recorded how that was established."""
    draft = manifest.draft
    if draft is None:
        return
    vocab = manifest.vocab
    recorded = (vocab.get("target"), vocab.get("draft"))
    if not vocab.get("match") or recorded != (manifest.target.dims.vocab_size, draft.dims.vocab_size):
        raise BundleError(f"draft and target vocabularies do not match (manifest vocab record {vocab}, model "
                          f"vocab sizes {manifest.target.dims.vocab_size} and {draft.dims.vocab_size})")
