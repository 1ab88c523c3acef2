"""How a batch's step-width choice (runtime/draft_length.py, StepWidth) trusts what it measured: prompt lookup
(or --proposers draft) with each width judged on its first round (trust 1, never forgotten: the rule before
2026-12-07) against the default (a width trusted after 3 rounds, capped at a wider width's cost, forgotten after
256 rounds unrun), and plain decode, in one --batch B bundle, interleaved in one process, every row checked
against plain decode.

    python benchmarks/step_width.py BUNDLE [--prompts tools/prompts/short_edits.jsonl] [--limit 16]
        [--max-new-tokens 128] [--gamma 4] [--proposers ngram] [--repeats 3] [--threads 2] [--fresh] [--json OUT]

Each rule keeps one StepWidth through the runs, as a generator (or a server) does across its batches, from a
short untimed run that loads the sessions on; --fresh gives every timed run a new one instead, as a new process
has. All prompts go through the B rows as a queue, EOS held back.
"""
from __future__ import annotations

import json
import platform
import time

import numpy as np
from padding_guesses import guesses_parser

from specedge.runtime.batch import BatchGenerator
from specedge.runtime.draft_length import StepWidth
from specedge.tools.bench import load_prompts

RULES = {"plain": None, "first round": {"trust": 1, "stale": 10 ** 9}, "trusted after 3": {}}


def main() -> None:
    p = guesses_parser(__doc__)  # a batch bundle, prompts, tokens, gamma, threads, --json
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fresh", action="store_true", help="a new StepWidth for every timed run")
    a = p.parse_args()
    if "," in a.proposers:
        p.error("one proposer (--proposers ngram or draft)")

    gen = BatchGenerator.load(a.bundle, threads=a.threads)
    ids = [gen.tokenizer.apply_chat_template(q["messages"]) for q in load_prompts(a.prompts)[: a.limit]]
    gen.runner.warm(a.gamma)
    widths = gen.runner.step_width.widths
    kept = {rule: StepWidth(widths, **(options or {})) for rule, options in RULES.items()}
    for rule, options in RULES.items():  # the sessions' first runs, and what a kept StepWidth learns from them
        gen.runner.step_width = kept[rule]
        gen.generate_batch(ids[: gen.batch], 4, proposer="none" if options is None else a.proposers, gamma=a.gamma,
                           min_new_tokens=4)
    runs = {rule: [] for rule in RULES}  # rule -> [(seconds, drafts proposed, accepted)]
    plain, identical = None, dict.fromkeys(RULES, True)
    for _ in range(a.repeats):  # repeat -> rule: drift on a shared machine hits every rule alike
        for rule, options in RULES.items():
            gen.runner.step_width = StepWidth(widths, **(options or {})) if a.fresh else kept[rule]
            began = time.perf_counter()
            results = gen.generate_batch(ids, a.max_new_tokens, proposer="none" if options is None else a.proposers,
                                         gamma=a.gamma, min_new_tokens=a.max_new_tokens)
            seconds = time.perf_counter() - began
            tokens = [r.tokens for r in results]
            plain = tokens if plain is None else plain
            identical[rule] &= tokens == plain
            runs[rule].append((seconds, sum(r.stats.proposed for r in results),
                               sum(r.stats.accepted for r in results)))
    total = len(ids) * a.max_new_tokens
    base = np.median([total / s for s, _, _ in runs["plain"]])
    rows = []
    print(f"| rule | tokens/s, median of {a.repeats} | vs plain | each run vs plain (same repeat) | drafts proposed "
          "per run | accepted | identical to plain |")
    print("|---|---|---|---|---|---|---|")
    for rule, measured in runs.items():
        speed = np.median([total / s for s, _, _ in measured])
        paired = [p_s / s for (s, _, _), (p_s, _, _) in zip(measured, runs["plain"])]
        rows.append({"rule": rule, "options": RULES[rule], "tokens_per_s": speed, "runs": measured,
                     "identical": identical[rule]})
        print(f"| {rule} | {speed:.1f} | {speed / base:.2f}x | {' '.join(f'{x:.2f}x' for x in paired)} | "
              f"{' '.join(str(n) for _, n, _ in measured)} | {' '.join(str(n) for _, _, n in measured)} | "
              f"{identical[rule]} |")
    print(f"{platform.processor() or platform.machine()}, threads {a.threads}, batch {gen.batch}, {len(ids)} prompts, "
          f"{a.max_new_tokens} new tokens, gamma {a.gamma}, widths {widths}, "
          f"{'a new StepWidth per run' if a.fresh else 'one StepWidth per rule through the runs'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bundle": a.bundle, "prompts": a.prompts, "fresh": a.fresh, "rows": rows}, f, indent=1)
    gen.close()


if __name__ == "__main__":
    main()
