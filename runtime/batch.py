"""Several sequences at once: one verify step per round for every row of a bundle exported with --batch B.

Each row keeps the loop's invariant (its cache holds every committed token but its pending one) with its own
`cache_len` entry, its own proposal, acceptance, draft length and stop; a round feeds row b
[pending_b, drafts_b...] padded to the step's T, and commits row b by rewriting cache_len[b]. Rows that are
finished (or missing, when there are fewer prompts than B) are idle: they feed nothing and their cache does
not move. Prefill fills all rows in the same steps, chunk by chunk.

Why a row's output equals its batch-1 output: the step graphs compute every row of a step independently,
and each row bit for bit like a one-token step at its slot (docs/bundle.md, position consistency), so the
logits a row sees do not depend on the other rows, on the step's T or on the context bucket. Sampling draws
from a generator per row (seeded seed + b), so a sampled row also repeats its batch-1 run with seed + b, as
long as no row is near the end of the context (the step's T is bounded by the fullest row).

Proposers: `none` and `ngram` (prompt lookup). Draft models are not batched yet.
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import GenerationError
from ..graphs import contract as C
from ..graphs.manifest import load_manifest, read_index, weights_index_file
from .acceptance import accept_greedy, accept_sampling
from .backends import create_backend
from .draft_length import DraftLength
from .generator import GenerationResult, check_gamma, check_request
from .model import ModelRunner
from .proposers import ngram_lookup
from .sampling import SamplingParams, probs_from_logits
from .stats import Stats
from .tokenizer import Tokenizer

BATCH_PROPOSERS = ("ngram", "none")


class BatchGenerator:
    def __init__(self, bundle_dir: str, manifest, backend):
        self.manifest, self.backend = manifest, backend
        self.target = ModelRunner("target", bundle_dir, manifest.target, backend)
        self.batch = manifest.target.dims.batch
        self.tokenizer = Tokenizer.from_bundle(bundle_dir, manifest)
        self.eos_ids = list(manifest.tokenizer.eos_ids)

    @classmethod
    def load(cls, bundle: str, backend: str = "cpu", threads: int | None = None) -> "BatchGenerator":
        manifest = load_manifest(bundle)
        engine = create_backend(backend, threads)
        weights = manifest.target.weights
        engine.add_weights_file(os.path.join(bundle, weights), read_index(os.path.join(bundle, weights_index_file(weights))))
        return cls(bundle, manifest, engine)

    def close(self) -> None:
        self.target.close()
        self.backend.close()

    def _validate(self, prompts, max_new_tokens, proposer, gamma) -> None:
        if not 1 <= len(prompts) <= self.batch:
            raise GenerationError(f"{len(prompts)} prompts for a bundle of batch {self.batch} (export with "
                                  f"--batch N for up to N prompts at once)")
        check_request(prompts, self.target.dims, max_new_tokens)
        if proposer not in BATCH_PROPOSERS:
            raise GenerationError(f"proposer {proposer!r} is not available for batches; choose one of "
                                  f"{', '.join(BATCH_PROPOSERS)}")
        if proposer != "none":
            check_gamma(self.manifest, gamma)

    def generate_batch(self, prompts, max_new_tokens: int = 128, proposer: str = "ngram", gamma: int = 4,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                       stop_ids: list[int] | None = None, ngram: tuple[int, int] = (2, 4),
                       adaptive: bool = True) -> list[GenerationResult]:
        """Generate for up to B prompts in one batch; returns one GenerationResult per prompt, in order."""
        try:
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        except ValueError as e:
            raise GenerationError(str(e)) from None
        prompts = [[int(t) for t in p] for p in prompts]
        self._validate(prompts, max_new_tokens, proposer, gamma)
        stop = set(self.eos_ids if stop_ids is None else stop_ids)
        n, target = len(prompts), self.target
        rngs = [np.random.default_rng(None if seed is None else seed + b) for b in range(n)]
        lengths = [DraftLength(gamma if proposer != "none" else 0, adaptive, shrink=False) for _ in range(n)]
        stats = [Stats() for _ in range(n)]
        steps = target.use_steps([1] + ([gamma + 1] if proposer != "none" else []))
        target.warm([(C.PREFILL, t) for t in self.manifest.target.prefill_tokens()] + [(C.STEP, t) for t in steps])

        for b, s in enumerate(stats):
            s.proposer, s.gamma, s.prompt_tokens = proposer, gamma if proposer != "none" else 0, len(prompts[b])
            s.start()
        target.reset()
        target.prefill_rows([p[:-1] for p in prompts])
        for s in stats:
            s.prefill_ms = s.ms_since_start()
        contexts = [list(p) for p in prompts]
        outputs: list[list[int]] = [[] for _ in range(n)]
        reasons = [""] * n
        capacity = target.cache.capacity
        largest = max(steps)
        while not all(reasons):
            rows: list[list[int]] = [[] for _ in range(self.batch)]
            drafts: list[list[int]] = [[] for _ in range(n)]
            for b in range(n):
                if reasons[b]:
                    continue
                free = capacity - int(target.cache.length[b])
                if free < 1:
                    reasons[b] = "context_full"
                    stats[b].finish(reasons[b])
                    continue
                k = min(lengths[b].next(), max_new_tokens - len(outputs[b]) - 1, largest - 1, free - 1)
                room = capacity - target.cache.used  # a step's T must fit the fullest row too
                while k > 0 and not any(k + 1 <= t <= room for t in steps):
                    k -= 1
                if k > 0:
                    drafts[b] = ngram_lookup(np.asarray(contexts[b]), k, *ngram)
                rows[b] = [contexts[b][-1]] + drafts[b]
            if all(reasons):
                break
            bases = [int(x) for x in target.cache.length[:n]]
            logits = target.run_rows(rows)
            for b in range(n):
                if reasons[b]:
                    continue
                d = drafts[b]
                rows_b = logits[b, :len(d) + 1]
                if params.greedy:
                    accepted, token = accept_greedy(np.asarray(d, np.int64), rows_b)
                else:
                    p = probs_from_logits(rows_b, params)
                    accepted, token = accept_sampling(np.asarray(d, np.int64), None, p, rngs[b])
                target.cache.set_row_length(b, bases[b] + 1 + accepted)
                lengths[b].update(len(d), accepted)
                new = d[:accepted] + [int(token)]
                for i, t in enumerate(new):
                    if t in stop:
                        new, reasons[b] = new[: i + 1], "stop"
                        break
                    if len(outputs[b]) + i + 1 >= max_new_tokens:
                        new, reasons[b] = new[: i + 1], "max_new_tokens"
                        break
                contexts[b] += new
                outputs[b] += new
                stats[b].record_round(len(d), len(new) - 1)
                stats[b].record_tokens(len(new))
                if reasons[b]:
                    stats[b].finish(reasons[b])
        return [GenerationResult(prompts[b], outputs[b], stats[b],
                                 self.tokenizer.decode(outputs[b]) if self.tokenizer else None) for b in range(n)]
