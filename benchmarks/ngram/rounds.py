"""Where the rounds of prompt lookup go, and two draft-length rules tried against the default, interleaved per
prompt in one process (every output checked against plain decode).

    python benchmarks/ngram/rounds.py BUNDLE tools/prompts/short_edits.jsonl

Variants: plain decode; ngram g=8 with the adaptive draft length (the default); g=8 fixed; and a fallback that
drafts k1 tokens from the continuation of the last token's most recent earlier occurrence (a 1-token suffix) when
no suffix of 2..8 tokens matches."""
import json
import sys

import specedge.runtime.proposers as P
from specedge.runtime.generator import Generator

bundle, path = sys.argv[1], sys.argv[2]
gen = Generator.load(bundle, backend="cpu", threads=2)
ids = [gen.tokenizer.apply_chat_template(json.loads(line)["messages"]) for line in open(path)]
lookup = P.ngram_chain


def with_fallback(k1: int):
    def chain(context, k, n_min, n_max):
        return lookup(context, k, n_min, n_max) or (lookup(context, min(k, k1), 1, 1) if k1 else [])
    return chain


VARIANTS = {"plain": ("none", True, 0), "g8 adaptive": ("ngram", True, 0), "g8 fixed": ("ngram", False, 0),
            "g8 + 1-token k1=1": ("ngram", True, 1), "g8 + 1-token k1=2": ("ngram", True, 2),
            "g8 + 1-token k1=3": ("ngram", True, 3)}


def run(name, prompt):
    proposer, adaptive, k1 = VARIANTS[name]
    P.ngram_chain = with_fallback(k1)
    return gen.generate(prompt, 128, min_new_tokens=128, proposer=proposer, gamma=8, adaptive=adaptive)


for name in VARIANTS:  # warm-up: sessions of every graph the variants use
    run(name, ids[0])
stats = {name: [] for name in VARIANTS}
for i, prompt in enumerate(ids):
    tokens = {}
    for name in (list(VARIANTS) if i % 2 == 0 else list(VARIANTS)[::-1]):
        r = run(name, prompt)
        stats[name].append(r.stats)
        tokens[name] = r.tokens
    assert all(t == tokens["plain"] for t in tokens.values()), i  # greedy speculation commits plain's tokens
plain_ms = sum(s.total_ms for s in stats["plain"])
step_ms = sum(s.verify_ms for s in stats["plain"]) / sum(s.rounds for s in stats["plain"])
for name, runs in stats.items():
    rounds = sum(s.rounds for s in runs)
    drafting = sum((s.proposed_by_position or [0])[0] for s in runs)
    spent = sum(s.verify_ms for s in runs) - (rounds - drafting) * step_ms  # what the drafting rounds cost
    per = max(drafting, 1)
    print(f"{name:18s} {plain_ms / sum(s.total_ms for s in runs):.3f}x plain, {128 * len(runs) / rounds:.2f} "
          f"tokens/round, {drafting / rounds:.0%} of rounds draft ({sum(s.proposed for s in runs) / per:.1f} drafts, "
          f"{sum(s.accepted for s in runs) / per:.1f} accepted, {spent / per / step_ms:.2f} plain steps each)")
