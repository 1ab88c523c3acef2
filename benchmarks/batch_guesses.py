"""Batched prompt lookup with and without guesses in the batch step's padding rows (runtime/batch.py,
BatchRunner._add_guesses): a row whose chain is shorter than the step's widest row's, or that proposed nothing,
pads to the step's T, and a greedy prompt-lookup row now puts guesses there. The same --batch B bundle in two
generators, plain decode and prompt lookup interleaved in one process, every row checked against plain decode.

    python benchmarks/batch_guesses.py BUNDLE [--prompts tools/prompts/short_edits.jsonl] [--limit 16]
        [--max-new-tokens 128] [--gamma 4] [--proposers ngram,draft] [--repeats 2] [--threads 2] [--json OUT]

All prompts go through the B rows as a queue (continuous batching: the next prompt takes the first row freed),
EOS held back so every row runs max_new_tokens. The "without" generator's rows make no guesses, a benchmark's
switch, not a runtime option.
"""
from __future__ import annotations

import time

from padding_guesses import FIELDS, guess_configs, guesses_parser, report

from specedge.runtime.batch import BatchGenerator
from specedge.tools.bench import load_prompts


def main() -> None:
    p = guesses_parser(__doc__)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()

    gens = {"without": BatchGenerator.load(a.bundle, threads=a.threads),
            "with": BatchGenerator.load(a.bundle, threads=a.threads)}
    gens["without"].runner._add_guesses = lambda drafts, feeds, lone: None
    ids = [gens["with"].tokenizer.apply_chat_template(q["messages"]) for q in load_prompts(a.prompts)[: a.limit]]
    configs = guess_configs(a)
    keys = [(name, config) for config, _ in configs for name in gens]
    for gen in gens.values():  # sessions are made on first use: one untimed run each
        for _, proposer in configs:
            gen.generate_batch(ids[: gen.batch], 4, proposer=proposer, gamma=a.gamma, min_new_tokens=4)
    seconds = {k: [] for k in keys}
    same = dict.fromkeys(keys, True)
    counts = {k: dict.fromkeys(FIELDS, 0) for k in keys}
    plain = None
    for _ in range(a.repeats):  # repeat -> configuration: drift on a shared machine hits every one alike
        for config, proposer in configs:
            for name, gen in gens.items():
                began = time.perf_counter()
                results = gen.generate_batch(ids, a.max_new_tokens, proposer=proposer, gamma=a.gamma,
                                             min_new_tokens=a.max_new_tokens)
                seconds[(name, config)].append(time.perf_counter() - began)
                tokens = [r.tokens for r in results]
                plain = tokens if plain is None else plain
                same[(name, config)] &= tokens == plain
                for field in FIELDS:
                    counts[(name, config)][field] = sum(getattr(r.stats, field) for r in results)
    total = len(ids) * a.max_new_tokens
    report(a, keys, {k: total / min(v) for k, v in seconds.items()}, f"best of {a.repeats}", same, counts,
           f"batch {gens['with'].batch}, {a.max_new_tokens} new tokens, {len(ids)} prompts; target plan "
           f"{gens['with'].target.plan}")
    for gen in gens.values():
        gen.close()


if __name__ == "__main__":
    main()
