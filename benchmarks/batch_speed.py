"""Batch throughput: prompts through a --batch B bundle (B at a time; with --limit above B the next prompt takes
the first row freed) against the same prompts one at a time through a --batch 1 bundle of the same model,
interleaved in one process (repeat -> proposer -> batch 1, batch B); every row's tokens are checked equal.

    python benchmarks/batch_speed.py BUNDLE_B1 BUNDLE_BN [--prompts tools/prompts/suite.jsonl] [--limit 4]
        [--max-new-tokens 128] [--proposers none,ngram] [--gamma 4] [--repeats 3] [--threads 2] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

from specedge.runtime.batch import BatchGenerator
from specedge.runtime.generator import Generator


def batch_parser(prompts: str) -> argparse.ArgumentParser:
    """The options of the scripts that compare a batch-1 bundle with a batch-B one (also lone_row.py)."""
    p = argparse.ArgumentParser()
    p.add_argument("one")
    p.add_argument("many")
    p.add_argument("--prompts", default=prompts)
    p.add_argument("--limit", type=int, default=None, help="prompts (default: the bundle's batch)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--proposers", default="none,ngram")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    return p


def main() -> int:
    p = batch_parser("tools/prompts/suite.jsonl")
    p.add_argument("--kind", default=None, help="only prompts of this kind (grounded/open)")
    a = p.parse_args()
    g1 = Generator.load(a.one, threads=a.threads)
    gb = BatchGenerator.load(a.many, threads=a.threads)
    items = [json.loads(line) for line in open(a.prompts)]
    items = [i for i in items if a.kind is None or i.get("kind") == a.kind][: a.limit or gb.batch]
    prompts = [g1.tokenizer.apply_chat_template(i["messages"]) for i in items]
    rows = []
    proposers = a.proposers.split(",")
    for proposer in proposers:  # one untimed run each first: sessions are created on first use
        g1.generate(prompts[0], 4, proposer=proposer, gamma=a.gamma, min_new_tokens=4)
        gb.generate_batch(prompts, 4, proposer=proposer, gamma=a.gamma, min_new_tokens=4)
    t1 = {q: [] for q in proposers}
    tb = {q: [] for q in proposers}
    identical = dict.fromkeys(proposers, True)
    for _ in range(a.repeats):  # repeat -> proposer: drift on a shared machine hits every configuration alike
        for proposer in proposers:
            began = time.perf_counter()
            singles = [g1.generate(q, a.max_new_tokens, proposer=proposer, gamma=a.gamma,
                                   min_new_tokens=a.max_new_tokens).tokens for q in prompts]
            t1[proposer].append(time.perf_counter() - began)
            began = time.perf_counter()
            batch = gb.generate_batch(prompts, a.max_new_tokens, proposer=proposer, gamma=a.gamma,
                                      min_new_tokens=a.max_new_tokens)
            tb[proposer].append(time.perf_counter() - began)
            identical[proposer] &= [r.tokens for r in batch] == singles
    tokens = len(prompts) * a.max_new_tokens
    for proposer in proposers:
        one, many = tokens / np.median(t1[proposer]), tokens / np.median(tb[proposer])
        rows.append({"proposer": proposer, "gamma": a.gamma if proposer != "none" else 0, "prompts": len(prompts),
                     "batch1_tok_s": round(one, 1), "batch_tok_s": round(many, 1), "ratio": round(many / one, 2),
                     "identical": identical[proposer]})
    plain = next((r["batch_tok_s"] for r in rows if r["proposer"] == "none"), None)
    for r in rows:
        r["vs_batch_plain"] = round(r["batch_tok_s"] / plain, 2) if plain else None
    print(f"| proposer | prompts | batch 1, one after another (tok/s) | batch {gb.batch} (tok/s) | ratio | "
          f"vs batch {gb.batch} plain | identical |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        name = r["proposer"] + (f" g={r['gamma']}" if r["gamma"] else "")
        print(f"| {name} | {r['prompts']} | {r['batch1_tok_s']} | {r['batch_tok_s']} | {r['ratio']:.2f}x | "
              f"{r['vs_batch_plain']}x | {r['identical']} |")
    note = (f"{platform.processor() or platform.machine()}, threads {a.threads}, {a.max_new_tokens} new tokens per "
            f"prompt, end to end (prefill included), median of {a.repeats}")
    print(note)
    if a.json:
        json.dump({"argv": sys.argv[1:], "rows": rows, "note": note}, open(a.json, "w"), indent=1)
    g1.close()
    gb.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
