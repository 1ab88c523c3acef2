"""One int4 bundle run under each way of keeping its rows exact on this CPU (runtime/kernel_probe.py, RowPlan):
plain decode and prompt lookup, interleaved in one process, every configuration's tokens checked against plain
decode under the same plan.

Plans (the same bundle, the same weights file; each one its own generator):
  as chosen     what the runtime picks here (kernel_probe.row_plan)
  two-row       each decoded token a T=2 step with a padding row, the bundle's own block (needs a T=2 graph)
  re-blocked    the int4 products loaded in blocks of 16 (runtime/reblock.py), decode at T=1
  as exported   the bundle's own block at T=1: the fastest decode where the one-row kernel differs, and the one
                whose speculation is not exact there (its "identical" column shows what that costs)

    python benchmarks/row_plans.py BUNDLE [--prompts tools/prompts/short_edits.jsonl] [--limit 8]
        [--max-new-tokens 128] [--gamma 4] [--repeats 1] [--threads 2] [--json OUT]

The plans are forced by replacing runtime.model.row_plan while each generator loads: a benchmark's switch, not
a runtime option.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
import warnings

from specedge.runtime import model as model_module
from specedge.runtime.exactness import InexactRowsWarning
from specedge.runtime.generator import Generator
from specedge.runtime.kernel_probe import RowPlan, row_plan
from specedge.tools.bench import load_prompts

PLANS = {"as chosen": None, "two-row": RowPlan(min_rows=2), "re-blocked": RowPlan(int4_block=16),
         "as exported": RowPlan()}


@contextlib.contextmanager
def forced(plan: RowPlan | None):
    if plan is None:
        yield
        return
    model_module.row_plan = lambda *args: plan
    try:
        yield
    finally:
        model_module.row_plan = row_plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--prompts", default="tools/prompts/short_edits.jsonl")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args()
    warnings.simplefilter("ignore", InexactRowsWarning)  # "as exported" is inexact here on purpose

    gens = {}
    for name, plan in PLANS.items():
        with forced(plan):
            gens[name] = Generator.load(a.bundle, threads=a.threads)
    prompts = load_prompts(a.prompts)[: a.limit]
    ids = [gens["as chosen"].tokenizer.apply_chat_template(q["messages"]) for q in prompts]
    configs = [("plain", "none"), (f"ngram g={a.gamma}", "ngram")]
    speeds = {(plan, c): [] for plan in gens for c, _ in configs}
    same = {(plan, c): 0 for plan in gens for c, _ in configs}
    for _ in range(a.repeats):
        for prompt in ids:
            for name, gen in gens.items():
                plain = None
                for config, proposer in configs:
                    started = time.perf_counter()
                    out = gen.generate(prompt, a.max_new_tokens, proposer=proposer, gamma=a.gamma, stop_ids=[])
                    speeds[(name, config)].append(len(out.tokens) / (time.perf_counter() - started))
                    plain = out.tokens if plain is None else plain
                    same[(name, config)] += out.tokens == plain
    runs = a.repeats * len(ids)
    base = statistics.median(speeds[("as chosen", "plain")])
    rows = []
    print(f"{a.bundle}: int4 in blocks of {gens['as chosen'].manifest.target.quant['block']}; chosen here: "
          f"{gens['as chosen'].target.plan}")
    print("| plan | configuration | tokens/s (median) | vs chosen plain | identical to its plain |")
    print("|---|---|---|---|---|")
    for (name, config), values in speeds.items():
        median = statistics.median(values)
        rows.append({"plan": name, "config": config, "tokens_per_s": median, "identical": same[(name, config)],
                     "runs": runs})
        print(f"| {name} | {config} | {median:.1f} | {median / base:.2f}x | {same[(name, config)]}/{runs} |")
    print(f"{platform.processor() or platform.machine()}, threads {a.threads}, {a.max_new_tokens} new tokens, "
          f"{len(ids)} prompts x {a.repeats}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bundle": a.bundle, "rows": rows}, f, indent=1)
    for gen in gens.values():
        gen.close()


if __name__ == "__main__":
    main()
