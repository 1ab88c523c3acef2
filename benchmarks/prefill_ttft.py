"""Time to first token of bundles of one model that differ in their prefill graphs (`--prefill-chunk`, graph
changes, context buckets), interleaved in one process: every prompt runs on each bundle in turn (the order
alternating per prompt and repeat), so machine drift hits them alike. Plain decode of 4 tokens by default;
the output tokens are checked equal across bundles.

    python benchmarks/prefill_ttft.py BUNDLE [BUNDLE ...]
        [--prompts tools/prompts/suite.jsonl,tools/prompts/short_edits.jsonl] [--kind grounded] [--repeats 2]
        [--threads 2] [--new-tokens 4] [--proposer none]

Prints each bundle's summed median TTFT over the prompts, its ratio to the first bundle, and the sums by
prompt length (under 128, 128-255, 256 and more tokens). With more new tokens (EOS held back until then) it
also prints each bundle's end-to-end and decode tokens/s (summed times, so long prompts weigh more), which
compares whole runs of bundles that differ in their step graphs or buckets.
"""
from __future__ import annotations

import argparse
import statistics

from specedge.runtime.generator import Generator
from specedge.tools.bench import load_prompts

BANDS = ((0, 128), (128, 256), (256, None))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("bundles", nargs="+")
    p.add_argument("--prompts", default="tools/prompts/suite.jsonl,tools/prompts/short_edits.jsonl")
    p.add_argument("--kind", default="grounded", help="only prompts of this kind (empty: all)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--proposer", default="none", choices=["none", "ngram"], help="ngram runs with gamma 4")
    a = p.parse_args()
    gens = {b: Generator.load(b, threads=a.threads) for b in a.bundles}
    items = [i for f in a.prompts.split(",") for i in load_prompts(f) if not a.kind or i["kind"] == a.kind]
    prompts = [gens[a.bundles[0]].tokenizer.apply_chat_template(i["messages"]) for i in items]
    for gen in gens.values():  # untimed: sessions of the buckets these prompts reach are created on first use
        for ids in sorted(prompts, key=len)[-3:]:
            gen.generate(ids, 2, proposer="none", min_new_tokens=2)
    ttft = {b: [[] for _ in prompts] for b in a.bundles}
    tokens = {b: [None] * len(prompts) for b in a.bundles}
    total_ms, new_tokens = {b: 0.0 for b in a.bundles}, {b: 0 for b in a.bundles}  # summed over every run
    for r in range(a.repeats):
        for i, ids in enumerate(prompts):
            for b in a.bundles if (i + r) % 2 == 0 else a.bundles[::-1]:
                out = gens[b].generate(ids, a.new_tokens, proposer=a.proposer, gamma=4, min_new_tokens=a.new_tokens)
                tokens[b][i] = out.tokens
                ttft[b][i].append(out.stats.ttft_ms)
                total_ms[b] += out.stats.total_ms
                new_tokens[b] += out.stats.new_tokens
    median = {b: [statistics.median(t) for t in ttft[b]] for b in a.bundles}
    first = a.bundles[0]
    for b in a.bundles:
        same = sum(tokens[b][i] == tokens[first][i] for i in range(len(prompts)))
        print(f"{b}: TTFT {sum(median[b]):.0f} ms summed over {len(prompts)} prompts, "
              f"{sum(median[b]) / sum(median[first]):.3f}x {first}, tokens identical {same}/{len(prompts)}")
    if a.new_tokens > 4:  # after the first token: each run's time past its TTFT, and its tokens but the first
        runs = a.repeats * len(prompts)
        decode_ms = {b: total_ms[b] - sum(map(sum, ttft[b])) for b in a.bundles}
        for b in a.bundles:
            print(f"{b}: {a.proposer}, {new_tokens[b] * 1e3 / total_ms[b]:.1f} tok/s end to end "
                  f"({total_ms[first] / total_ms[b]:.3f}x {first}), {(new_tokens[b] - runs) * 1e3 / decode_ms[b]:.1f} "
                  f"tok/s after the first token ({decode_ms[first] / decode_ms[b]:.3f}x)")
    for lo, hi in BANDS:
        band = [i for i, ids in enumerate(prompts) if len(ids) >= lo and (hi is None or len(ids) < hi)]
        sums = "  ".join(f"{b} {sum(median[b][i] for i in band):.0f} ms" for b in a.bundles)
        print(f"prompts of {lo}{f'-{hi - 1}' if hi else '+'} tokens ({len(band)}): {sums}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
