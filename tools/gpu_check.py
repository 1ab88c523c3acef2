"""A GPU backend against the CPU on the same bundles: what to run when a machine with an NVIDIA GPU and
onnxruntime-gpu is at hand. The development machine has neither, so none of this is a unit test.

  python -m specedge.tools.gpu_check BUNDLE [BUNDLE ...] --backends cuda,tensorrt --json gpu.json

For each bundle and backend it reports:
* exact rows: every T-token graph's rows against one-token decode, run on that backend (tools/exact_rows.py).
  Greedy speculation equals plain decode only where this is 0.0 (or where no near tie meets a difference);
* the one-token step's logits on the backend against the cpu backend's, from the same random cache;
* plain greedy tokens on the backend against the cpu backend's;
* each speculative configuration's greedy tokens against the backend's own plain tokens, with the drafts
  proposed and accepted (a path that never drafted would prove nothing);
* tokens/s of every configuration on the cpu backend and on this one, measured in this one process.
A backend that cannot load a graph is reported with onnxruntime's first line, and the others still run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ..graphs import contract as C
from ..runtime.backends import create_backend
from ..runtime.generator import Generator
from .exact_rows import GraphDriver, max_abs_diff, check_model_rows, one_token_steps


def step_logits_diff(bundle: str, model, backend_name: str, seed: int = 0) -> float:
    """Largest |logit difference| of the smallest bucket's one-token step, backend against cpu, same inputs."""
    decode = min(one_token_steps(model).items())[1]
    outputs = []
    for name in ("cpu", backend_name):
        driver = GraphDriver(bundle, model, create_backend(name, threads=None), seed)
        try:
            keys, values = driver.fresh_cache(decode.context, decode.context // 2)
            tokens = driver.rng.integers(0, model.dims.vocab_size, (model.dims.batch, 1))
            outputs.append(driver.run(decode, keys, values, tokens, decode.context // 2))
        finally:
            driver.close()
            driver.backend.close()
    return max_abs_diff({C.LOGITS: outputs[0][C.LOGITS]}, {C.LOGITS: outputs[1][C.LOGITS]})


def configurations(gen: Generator, gamma: int) -> list[tuple[str, int, int]]:
    """(proposer, gamma, tree) this bundle can run: plain, prompt lookup, its draft if it has one, and prompt
    lookup trees on its largest tree graph if it has tree graphs."""
    runs = [("none", 0, 0), ("ngram", gamma, 0)]
    if gen.draft is not None:
        runs.append(("draft", gamma, 0))
    trees = gen.target.entry.tree_tokens()
    if trees:
        runs.append(("ngram", gamma, max(trees)))
    return runs


def timed_runs(bundle: str, backend: str, prompt: list[int], new_tokens: int, gamma: int) -> dict:
    gen = Generator.load(bundle, backend=backend)
    try:
        runs = {}
        for proposer, g, tree in configurations(gen, gamma):
            gen.generate(prompt, max_new_tokens=8, proposer=proposer, gamma=max(g, 1), tree=tree)  # sessions
            started = time.perf_counter()
            r = gen.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, proposer=proposer,
                             gamma=max(g, 1), adaptive=False, tree=tree)
            seconds = time.perf_counter() - started
            name = f"{proposer} g={g}" + (f" tree={tree}" if tree else "")
            runs[name] = {"tokens": r.tokens, "tok_s": len(r.tokens) / seconds, "proposed": r.stats.proposed,
                          "accepted": r.stats.accepted, "rounds": r.stats.rounds}
        return runs
    finally:
        gen.close()


def check(bundle: str, backend: str, prompt: list[int], new_tokens: int, gamma: int, cpu_runs: dict) -> dict:
    """`cpu_runs`: the cpu backend's timed runs by bundle, filled on first use, so that checking several
    backends on one bundle runs the CPU reference once."""
    from ..graphs.manifest import load_manifest

    out: dict = {"bundle": bundle, "backend": backend}
    manifest = load_manifest(bundle)
    try:
        out["exact_rows"] = {}
        for name, model in manifest.models.items():
            engine = create_backend(backend, threads=None)
            try:
                rows = check_model_rows(bundle, model, engine)
            finally:
                engine.close()
            out["exact_rows"][name] = {r.graph.file: r.max_diff for r in rows}
            out[f"{name}_step_logits_max_diff_vs_cpu"] = step_logits_diff(bundle, model, backend)
        if bundle not in cpu_runs:
            cpu_runs[bundle] = timed_runs(bundle, "cpu", prompt, new_tokens, gamma)
        cpu = cpu_runs[bundle]
        gpu = timed_runs(bundle, backend, prompt, new_tokens, gamma)
    except Exception as e:  # a provider that cannot take the bundle: report it, go on with the next
        out["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return out
    plain_cpu, plain_gpu = cpu["none g=0"]["tokens"], gpu["none g=0"]["tokens"]
    out["plain_equals_cpu_plain"] = plain_gpu == plain_cpu
    out["plain_first_difference"] = next((i for i, (a, b) in enumerate(zip(plain_gpu, plain_cpu)) if a != b), None)
    out["runs"] = {}
    for key, run in gpu.items():
        out["runs"][key] = {"equals_own_plain": run["tokens"] == plain_gpu, "proposed": run["proposed"],
                            "accepted": run["accepted"], "rounds": run["rounds"],
                            "tok_s": round(run["tok_s"], 1), "cpu_tok_s": round(cpu[key]["tok_s"], 1),
                            "cpu_equals_cpu_plain": cpu[key]["tokens"] == plain_cpu}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundles", nargs="+")
    p.add_argument("--backends", default="cuda,tensorrt", help="comma-separated backends to hold against cpu")
    p.add_argument("--prompt-ids", default="", help="comma-separated prompt ids (default: a repeated pattern, "
                   "so that prompt lookup has matches to draft from)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--json", help="write the results here as well")
    a = p.parse_args(argv)
    prompt = [int(t) for t in a.prompt_ids.split(",")] if a.prompt_ids else list(range(5, 21)) * 3
    results, cpu_runs = [], {}
    for bundle in a.bundles:
        for backend in a.backends.split(","):
            result = check(bundle, backend, prompt, a.new_tokens, a.gamma, cpu_runs)
            results.append(result)
            print(json.dumps(result), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv, "onnxruntime": _ort_version(), "results": results}, f, indent=1)
    return 0


def _ort_version() -> str:
    import onnxruntime

    return f"{onnxruntime.__version__} {onnxruntime.get_available_providers()}"


if __name__ == "__main__":
    sys.exit(main())
