"""Prompt lookup with and without guesses in the verify graph's padding rows (runtime/proposers.py, guesses): the
same bundle in two generators, plain decode and prompt lookup interleaved in one process, each output checked
against plain decode.

    python benchmarks/padding_guesses.py BUNDLE [--prompts tools/prompts/short_edits.jsonl] [--limit 16]
        [--max-new-tokens 128] [--gamma 4] [--proposers ngram,draft] [--threads 2] [--json OUT]

Padding rows are the rows of the step graph a round runs past its tokens: two-row decode's second row in a round
that proposes nothing (kernel_probe.row_plan: int4 in blocks of 32 on an AVX2-only CPU), and the rows after a
chain shorter than gamma, padded into T=gamma+1 (any bundle). The "without" generator's target reports no
padding rows, a benchmark's switch, not a runtime option.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from specedge.runtime.generator import Generator
from specedge.runtime.model import ModelRunner
from specedge.tools.bench import load_prompts


# Stats fields a with/without run adds up (also batch_guesses.py's)
FIELDS = ("rounds", "proposed", "accepted", "spare_proposed", "spare_accepted")


class _NoPaddingRows(ModelRunner):
    def padding_rows(self, n: int, sizes: list[int] | None = None) -> int:
        return 0


def guesses_parser(doc: str) -> argparse.ArgumentParser:
    """The options of the with/without-guesses scripts (also batch_guesses.py)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--prompts", default="tools/prompts/short_edits.jsonl")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--proposers", default="ngram", help="comma-separated, after plain decode: ngram, draft")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="OUT")
    return p


def guess_configs(a) -> list[tuple[str, str]]:
    """(name, proposer): plain decode, then each of --proposers."""
    return [("plain", "none")] + [(f"{p} g={a.gamma}", p) for p in a.proposers.split(",")]


def main() -> None:
    a = guesses_parser(__doc__).parse_args()

    gens = {"without": Generator.load(a.bundle, threads=a.threads), "with": Generator.load(a.bundle, threads=a.threads)}
    gens["without"].target.__class__ = _NoPaddingRows
    prompts = load_prompts(a.prompts)[: a.limit]
    ids = [gens["with"].tokenizer.apply_chat_template(q["messages"]) for q in prompts]
    configs = guess_configs(a)
    keys = [(name, config) for config, _ in configs for name in gens]
    speeds = {k: [] for k in keys}
    same = dict.fromkeys(keys, 0)
    counts = {k: dict.fromkeys(FIELDS, 0) for k in keys}
    for prompt in ids:
        plain = None
        for config, proposer in configs:
            for name, gen in gens.items():
                started = time.perf_counter()
                out = gen.generate(prompt, a.max_new_tokens, proposer=proposer, gamma=a.gamma, stop_ids=[])
                speeds[(name, config)].append(len(out.tokens) / (time.perf_counter() - started))
                plain = out.tokens if plain is None else plain
                same[(name, config)] += out.tokens == plain
                for field in counts[(name, config)]:
                    counts[(name, config)][field] += getattr(out.stats, field)
    report(a, keys, {k: statistics.median(v) for k, v in speeds.items()}, "median",
           {k: f"{n}/{len(ids)}" for k, n in same.items()}, counts,
           f"{a.max_new_tokens} new tokens, {len(ids)} prompts; target plan {gens['with'].target.plan}")
    for gen in gens.values():
        gen.close()


def report(a, keys, speeds: dict, how: str, identical: dict, counts: dict, setup: str) -> None:
    """The table (ratios against the "without" generator's plain decode) and the JSON of a with/without run
    (also batch_guesses.py's)."""
    base = speeds[keys[0]]
    rows = []
    print(f"| guesses | configuration | tokens/s ({how}) | vs plain | identical to plain | rounds | drafts accepted / "
          "proposed | guesses accepted / made |")
    print("|---|---|---|---|---|---|---|---|")
    for key in keys:
        speed, c = speeds[key], counts[key]
        rows.append({"guesses": key[0], "config": key[1], "tokens_per_s": speed, "identical": identical[key], **c})
        print(f"| {key[0]} | {key[1]} | {speed:.1f} | {speed / base:.2f}x | {identical[key]} | {c['rounds']} | "
              f"{c['accepted']} / {c['proposed']} | {c['spare_accepted']} / {c['spare_proposed']} |")
    print(f"{platform.processor() or platform.machine()}, threads {a.threads}, {setup}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bundle": a.bundle, "prompts": a.prompts, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
