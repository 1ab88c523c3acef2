"""The old and the new prompt lookup, interleaved per prompt in one process (every output checked against the
recorded plain output).

    python benchmarks/ngram/ab.py BUNDLE out.pkl GAMMA    # out.pkl from replay.py on the same bundle"""
import pickle
import sys

import numpy as np

import specedge.runtime.proposers as P
from specedge.runtime.generator import Generator

bundle, recorded, gamma = sys.argv[1], sys.argv[2], int(sys.argv[3])
gen = Generator.load(bundle, backend="cpu", threads=2)
new_chain, rows = P.ngram_chain, []
for pid, (group, prompt, out) in pickle.load(open(recorded, "rb")).items():
    r = {}
    for name in ("old", "new") if len(rows) % 2 == 0 else ("new", "old"):
        P.ngram_chain = new_chain if name == "new" else (lambda c, k, a, b: P.ngram_lookup(c, k, a, b))
        res = gen.generate(prompt, max_new_tokens=128, min_new_tokens=128, proposer="ngram", gamma=gamma,
                           ngram=P.NGRAM_SIZES if name == "new" else (2, 4))
        assert list(res.tokens) == out, (pid, name)
        r[name] = (res.stats.rounds, res.stats.tokens_per_s, res.stats.decode_tokens_per_s)
    rows.append((pid, group, r))
for group in ("grounded", "short", "open"):
    g = [x for x in rows if x[1] == group]
    for i, label in ((0, "rounds"), (1, "tokens/s"), (2, "decode tokens/s")):
        old, new = np.array([x[2]["old"][i] for x in g]), np.array([x[2]["new"][i] for x in g])
        print(f"{group:9s} {label:16s} old {old.mean():7.2f} new {new.mean():7.2f} new/old {np.mean(new / old):.3f}")
