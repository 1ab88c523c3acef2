"""Plain decode of bundles of one model (float32, int8, int4, ...), interleaved in one process, and the peak RSS
of a whole `specedge generate` process for each (loading included).

    python benchmarks/quant_speed.py REFERENCE_BUNDLE BUNDLE [BUNDLE ...] [--prompts tools/prompts/suite.jsonl]
        [--limit 12] [--max-new-tokens 128] [--threads 2] [--json OUT]

Speed: every prompt runs plain greedy decode (`proposer="none"`, EOS ignored, so every run is the same
amount of work) on each bundle in turn, so machine drift hits all alike; the table gives the median tokens/s
per bundle (named by its directory) and its ratio to the first. Memory: one child process per bundle runs the CLI's
`generate` on the first prompt with prompt lookup (gamma 8) and reports its kernel peak RSS (VmHWM) against
the weights file plus the KV buffers it allocated, and, at the end of the run, its private memory (RssAnon)
apart from its file-backed pages (RssFile: clean page cache of the libraries and the weights file).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys
from specedge.runtime.generator import Generator
from specedge.tools.bench import memory_report
gen = Generator.load(sys.argv[1], threads=int(sys.argv[3]))
gen.generate(json.loads(sys.argv[2]), 128, proposer="ngram", gamma=8, stop_ids=[])
print(json.dumps(memory_report(gen)))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", nargs="+", metavar="BUNDLE", help="bundles of one model, the reference (float32) first")
    p.add_argument("--prompts", default="tools/prompts/suite.jsonl")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args()
    if len(a.bundles) < 2:
        p.error("give the reference bundle and at least one more")

    from specedge.runtime.generator import Generator

    names = [os.path.basename(os.path.normpath(b)) for b in a.bundles]
    if len(set(names)) < len(names):
        names = [f"{i}:{n}" for i, n in enumerate(names)]
    gens = [Generator.load(b, threads=a.threads) for b in a.bundles]
    items = [json.loads(line) for line in open(a.prompts)][: a.limit]
    prompts = [gens[0].tokenizer.apply_chat_template(item["messages"]) for item in items]
    for gen in gens:  # sessions of every bucket created and warm before timing (a run loads what it can reach)
        gen.warm("none", 0)
        gen.warm("ngram", 8)  # the memory child's graphs: quantized ones then come from a filled optimized-graph cache
        gen.generate(prompts[0], 8, proposer="none", stop_ids=[])
    rates = {n: [] for n in names}
    for ids in prompts:
        for name, gen in zip(names, gens):
            began = time.perf_counter()
            out = gen.generate(ids, a.max_new_tokens, proposer="none", stop_ids=[])
            rates[name].append(len(out.tokens) / (time.perf_counter() - began))
    for gen in gens:
        gen.close()
    medians = {n: statistics.median(r) for n, r in rates.items()}

    memory = {}
    for name, bundle in zip(names, a.bundles):
        r = subprocess.run([sys.executable, "-c", CHILD, bundle, json.dumps(prompts[0]), str(a.threads)],
                           capture_output=True, text=True, check=True)
        memory[name] = json.loads(r.stdout.strip().splitlines()[-1])

    print(f"plain decode, {len(prompts)} prompts x {a.max_new_tokens} tokens, {a.threads} threads, end to end")
    print(f"| bundle | tok/s (median) | vs {names[0]} | peak RSS MB | weights + KV MB | RSS / (weights + KV) "
          "| at the end: private MB (ratio), file-backed MB |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        m = memory[name]
        base = m["weights_mb"] + m["cache_mb"]
        print(f"| {name} | {medians[name]:.1f} | {medians[name] / medians[names[0]]:.2f}x | {m['peak_rss_mb']:.0f} | "
              f"{base:.0f} | {m['peak_rss_mb'] / base:.2f} | {m['private_mb']:.0f} ({m['private_mb'] / base:.2f}), "
              f"{m['file_backed_mb']:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv, "rates": rates, "medians": medians, "memory": memory}, f, indent=1)


if __name__ == "__main__":
    main()
