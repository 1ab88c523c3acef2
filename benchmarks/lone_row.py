"""Rows that run alone on a --batch B bundle: through its row step graphs (bundle version 4) against through its
batch step graphs (what a lone row did before), and against a --batch 1 bundle of the same model. One process,
interleaved (repeat -> proposer -> configuration); every configuration's tokens are checked equal.

Configurations, per proposer:
  batch-1 bundle      each prompt alone through the batch-1 bundle (Generator.generate)
  alone, row steps    each prompt alone through the batch bundle (generate_batch([prompt]))
  alone, batch steps  the same with the row step graphs switched off: every step computes all B rows
  together, row steps the prompts as one batch (B at a time); rows that end first leave the others alone
  together, batch steps

    python benchmarks/lone_row.py BUNDLE_B1 BUNDLE_BN [--prompts tools/prompts/short_edits.jsonl] [--limit 4]
        [--max-new-tokens 128] [--proposers none,ngram] [--gamma 4] [--repeats 3] [--threads 2] [--json OUT]
"""
from __future__ import annotations

import contextlib
import json
import platform
import sys
import time

import numpy as np
from batch_speed import batch_parser

from specedge.runtime.batch import BatchGenerator
from specedge.runtime.generator import Generator
from specedge.runtime.model import ModelRunner


@contextlib.contextmanager
def batch_steps_only():
    """Lone rows run in the batch step graphs, as before bundle version 4 (a probe switch, not a runtime option)."""
    real = ModelRunner.row_step_sizes
    ModelRunner.row_step_sizes = property(lambda self: [])
    try:
        yield
    finally:
        ModelRunner.row_step_sizes = real


def main() -> int:
    a = batch_parser("tools/prompts/short_edits.jsonl").parse_args()
    g1 = Generator.load(a.one, threads=a.threads)
    gb = BatchGenerator.load(a.many, threads=a.threads)
    if not gb.target.row_step_sizes:
        sys.exit(f"{a.many} has no row step graphs (bundle version 4, --batch > 1): re-export it")
    items = [json.loads(line) for line in open(a.prompts)][: a.limit or gb.batch]
    prompts = [g1.tokenizer.apply_chat_template(i["messages"]) for i in items]
    n = a.max_new_tokens
    proposers = a.proposers.split(",")

    def run(config: str, proposer: str) -> list[list[int]]:
        kw = dict(proposer=proposer, gamma=a.gamma, min_new_tokens=n)
        if config == "batch-1 bundle":
            return [g1.generate(q, n, **kw).tokens for q in prompts]
        lone = config.startswith("alone")
        with batch_steps_only() if config.endswith("batch steps") else contextlib.nullcontext():
            if lone:
                return [gb.generate_batch([q], n, **kw)[0].tokens for q in prompts]
            return [r.tokens for r in gb.generate_batch(prompts, n, **kw)]

    configs = ["batch-1 bundle", "alone, row steps", "alone, batch steps", "together, row steps",
               "together, batch steps"]
    for proposer in proposers:  # one untimed run each first: sessions are created on first use
        g1.generate(prompts[0], 4, proposer=proposer, gamma=a.gamma, min_new_tokens=4)
        for config in configs[1:]:
            with batch_steps_only() if config.endswith("batch steps") else contextlib.nullcontext():
                gb.generate_batch(prompts[:1] if config.startswith("alone") else prompts, 4, proposer=proposer,
                                  gamma=a.gamma, min_new_tokens=4)
    seconds = {(q, c): [] for q in proposers for c in configs}
    reference, identical = {}, {(q, c): True for q in proposers for c in configs}
    for _ in range(a.repeats):
        for proposer in proposers:
            for config in configs:
                began = time.perf_counter()
                tokens = run(config, proposer)
                seconds[(proposer, config)].append(time.perf_counter() - began)
                reference.setdefault(proposer, tokens)
                identical[(proposer, config)] &= tokens == reference[proposer]
    total = len(prompts) * n
    rows = []
    print(f"{len(prompts)} prompts x {n} tokens, batch {gb.batch}, {a.threads} threads, median of {a.repeats}")
    print(f"{'proposer':8s} {'configuration':24s} {'tok/s':>8s} {'vs alone, batch steps':>22s} identical")
    for proposer in proposers:
        base = total / float(np.median(seconds[(proposer, 'alone, batch steps')]))
        for config in configs:
            rate = total / float(np.median(seconds[(proposer, config)]))
            rows.append({"proposer": proposer, "config": config, "tokens_per_s": rate,
                         "seconds": seconds[(proposer, config)], "identical": identical[(proposer, config)]})
            print(f"{proposer:8s} {config:24s} {rate:8.1f} {rate / base:21.2f}x {identical[(proposer, config)]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"one": a.one, "many": a.many, "prompts": a.prompts, "count": len(prompts), "new_tokens": n,
                       "gamma": a.gamma, "threads": a.threads, "repeats": a.repeats, "batch": gb.batch,
                       "machine": platform.processor() or platform.machine(), "rows": rows}, f, indent=1)
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
