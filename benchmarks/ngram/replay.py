"""Prompt lookup variants replayed offline on plain greedy outputs (greedy speculation commits exactly those
tokens, so how many of each proposal the target accepts can be counted without running the model).

    python benchmarks/ngram/replay.py BUNDLE out.pkl      # record plain outputs of the suite + short edits
    python benchmarks/ngram/replay.py --replay out.pkl    # tokens per round for each variant, k = 4, 8, 16

The speed-up column is a cost model (a round with drafts costs 1.15 / 1.26 / 1.45 decode steps at k = 4 / 8 /
16, float32 on 2 cores), not a measurement; ab.py measures."""
import json
import pickle
import sys

import numpy as np

from specedge.runtime.proposers import ngram_chain, ngram_lookup

SUITES = ("tools/prompts/suite.jsonl", "tools/prompts/short_edits.jsonl")


def record(bundle: str, path: str) -> None:
    from specedge.runtime.generator import Generator
    gen = Generator.load(bundle, backend="cpu", threads=2)
    out = {}
    for f in SUITES:
        for line in open(f):
            p = json.loads(line)
            ids = gen.tokenizer.apply_chat_template(p["messages"])
            r = gen.generate(ids, max_new_tokens=128, proposer="none", min_new_tokens=128)
            out[p["id"]] = ("short" if f.endswith("short_edits.jsonl") else p["kind"], list(ids), list(r.tokens))
    pickle.dump(out, open(path, "wb"))


def replay(data: dict, propose, k: int, draft_cost: float) -> dict:
    res = {}
    for pid, (group, prompt, out) in data.items():
        i, rounds, cost = 0, 0, 0.0
        while i < len(out):
            drafts = propose(np.asarray(prompt + out[:i], dtype=np.int64), k)
            a = 0
            while a < len(drafts) and i + a < len(out) and drafts[a] == out[i + a]:
                a += 1
            rounds, cost, i = rounds + 1, cost + (draft_cost if drafts else 1.0), i + a + 1
        res[pid] = (group, len(out) / rounds, len(out) / cost)
    return res


VARIANTS = {
    "suffixes 4..2": lambda c, k: ngram_lookup(c, k, 2, 4),
    "suffixes 8..2": lambda c, k: ngram_lookup(c, k, 2, 8),
    "suffixes 4..2, chained": lambda c, k: ngram_chain(c, k, 2, 4),
    "suffixes 8..2, chained": lambda c, k: ngram_chain(c, k, 2, 8),
    "suffixes 8..1, chained": lambda c, k: ngram_chain(c, k, 1, 8),
}

if __name__ == "__main__":
    if sys.argv[1] != "--replay":
        record(sys.argv[1], sys.argv[2])
        sys.exit()
    data = pickle.load(open(sys.argv[2], "rb"))
    for k, cost in ((4, 1.15), (8, 1.26), (16, 1.45)):
        for name, f in VARIANTS.items():
            r = replay(data, f, k, cost)
            cells = []
            for group in ("grounded", "short", "open"):
                rows = [v for v in r.values() if v[0] == group]
                cells.append(f"{group} {np.mean([v[1] for v in rows]):.2f} tok/round, model {np.mean([v[2] for v in rows]):.2f}x")
            print(f"k={k:2d} {name:24s} " + " | ".join(cells))
