"""Where does a step graph spend its time? Runs graphs of a bundle under onnxruntime's profiler and prints
the time per op type (and the top nodes), for a given cache fill.

    python -m specedge.tools.profile_graph BUNDLE [--model target] [--tokens 1,5,64] [--cache-len 600]
        [--runs 20] [--threads 2]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import numpy as np

from ..graphs import contract as C
from ..graphs.manifest import load_manifest, read_index, weights_index_file


def step_session(bundle: str, model: str, tokens: int, cache_len: int, threads: int, context: int | None = None,
                 profile_prefix: str | None = None):
    """An onnxruntime session on one step graph of a bundle (the bundle's session config, its weights mapped
    from the weights file) and feeds for a cache of `cache_len` entries. Returns (session, feeds, graph file,
    keep): `keep` holds the weight buffers the session reads, which must outlive it."""
    import onnxruntime as ort

    from ..runtime.backends import map_weights

    m = load_manifest(bundle).models[model]
    context = context or m.dims.context
    graph = next(g for g in m.batch_graphs if g.tokens == tokens and g.context == context)
    mapped, weights = map_weights(os.path.join(bundle, m.weights),
                                  read_index(os.path.join(bundle, weights_index_file(m.weights))))
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    for key, value in m.session_config.items():
        so.add_session_config_entry(key, value)
    # int4 tensors (PackedInt4) have no numpy dtype: onnxruntime reads those from the weights file itself.
    values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in weights.items() if isinstance(a, np.ndarray)}
    for n, v in values.items():
        so.add_initializer(n, v)
    sess = ort.InferenceSession(os.path.join(bundle, graph.file), so, providers=["CPUExecutionProvider"])
    feeds = {s.name: np.zeros(s.shape, s.dtype) for s in C.step_inputs(m.dims, tokens, graph.step_mask, context)}
    feeds[C.CACHE_LEN][:] = cache_len
    feeds[C.POSITION_IDS][:] = np.arange(cache_len, cache_len + tokens)
    return sess, feeds, graph.file, (mapped, weights, values)


def profile(bundle: str, model: str, tokens: int, cache_len: int, runs: int, threads: int,
            context: int | None = None) -> None:
    sess, feeds, file, _keep = step_session(bundle, model, tokens, cache_len, threads, context,
                                            profile_prefix=os.path.join(tempfile.mkdtemp(), "profile"))
    for _ in range(3):
        sess.run(None, feeds)
    began = time.perf_counter()
    for _ in range(runs):
        sess.run(None, feeds)
    wall = (time.perf_counter() - began) / runs * 1e3
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    by_type, by_node = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"].get("op_name", "?")
            by_type[op] += e["dur"]
            by_node[e["name"][:-len("_kernel_time")]] += e["dur"]
    total = sum(by_type.values())
    n = runs + 3
    print(f"{file}: {wall:.2f} ms per run (wall), {total / n / 1e3:.2f} ms in kernels, cache_len {cache_len}")
    for op, us in by_type.most_common(14):
        print(f"  {op:28s} {us / n / 1e3:7.3f} ms  {us / total:6.1%}")
    print("  top nodes:", ", ".join(f"{k} {v / n / 1e3:.2f}" for k, v in by_node.most_common(6)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--model", default="target")
    p.add_argument("--tokens", default="1,5,9,64")
    p.add_argument("--cache-len", type=int, default=600)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=None, help="context bucket (default: the full context)")
    a = p.parse_args()
    for t in (int(x) for x in a.tokens.split(",")):
        profile(a.bundle, a.model, t, a.cache_len, a.runs, a.threads, a.context)


if __name__ == "__main__":
    main()
