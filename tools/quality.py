"""`python -m specedge.tools.quality`: what quantization costs, measured teacher-forced on a fixed text.

    python -m specedge.tools.quality REF_BUNDLE [BUNDLE ...] [--peer ort-genai-int4|ort-genai|llama.cpp --gguf PATH]
        [--text benchmarks/quality/text.txt] [--window 512] [--threads 2] [--json OUT] [--cache-dir DIR]

The text (benchmarks/quality/text.txt: prose and Python, about 7,400 SmolLM2 tokens) is tokenized once and
cut into consecutive windows of `--window` tokens (the last one may be shorter). Every window starts from an
empty cache; each of its tokens but the first is predicted from the window's tokens before it. So every
model sees exactly the same contexts, and a window never needs more than its own length of cache.

Our bundles run through our own runtime: the target's step graphs (`ModelRunner.run`) fed the window in
chunks of the largest step graph, so the logits are the ones speculative verification sees. Row j of a
chunk's logits predicts the token after chunk token j. Peers run their own model file:

* `ort-genai-int4` (and `ort-genai`, its fp32 export): ORT GenAI's model builder output for the same GGUF
  (tools/peers.py builds and caches it), run with onnxruntime's Python API, one forward per window with an
  empty past, which gives the logits of every position at once.
* `llama.cpp`: the GGUF file itself as llama.cpp runs it (llama-cpp-python, every position's logits), one
  eval per window from an empty cache.

Per model: positions scored, perplexity (exp of the mean negative log-likelihood, log-softmax in float64),
top-1 accuracy against the text's actual next token, and top-1 agreement with the first model given (the
reference, normally the float32 bundle): the share of positions where both argmaxes (np.argmax: lowest id on
ties) are equal. Greedy decoding emits exactly that argmax, so agreement is the share of positions at which
a quantized model would have continued as the reference does. The argmax arrays go into --json, with the
agreement of every pair.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import SpecedgeError, exit_status

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TEXT = os.path.join("benchmarks", "quality", "text.txt")
DEFAULT_WINDOW = 512
# Peer name -> ORT GenAI builder precision (tools/peers.py build_ort_genai_model).
PEER_PRECISIONS = {"ort-genai-int4": "int4", "ort-genai": "fp32"}
PEERS = [*PEER_PRECISIONS, "llama.cpp"]


class QualityError(SpecedgeError):
    pass


@dataclass
class Scores:
    name: str
    kind: str  # "bundle" or "peer"
    path: str
    weights: str  # what the model's weights are, in words
    nll: np.ndarray  # float64 [positions]: -log p(actual next token)
    argmax: np.ndarray  # int64 [positions]
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def positions(self) -> int:
        return int(self.nll.size)

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll.mean()))


# -- text and windows --------------------------------------------------------------------------------------
def read_text(path: str) -> str:
    if not os.path.isfile(path):
        raise QualityError(f"text file not found: {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise QualityError(f"{path} is empty")
    return text


def windows(ids: list[int], window: int) -> list[list[int]]:
    """Consecutive windows of `window` tokens; a last window shorter than 2 tokens predicts nothing and is dropped."""
    out = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in out if len(w) >= 2]


def score_rows(logits: np.ndarray, targets) -> tuple[np.ndarray, np.ndarray]:
    """(negative log-likelihood of each target in float64, argmax of each row with lowest id on ties)."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))
    t = np.asarray(targets, dtype=np.int64)
    return lse - x[np.arange(len(t)), t], np.argmax(logits, axis=1).astype(np.int64)


# -- our bundles -------------------------------------------------------------------------------------------
def _describe_bundle(manifest) -> str:
    q = manifest.target.quant
    if not q:
        return manifest.target.dims.dtype
    smooth = f", smoothed (alpha {q['smooth']})" if q.get("smooth") else ""
    if q.get("rows"):
        return (f"int8 per column, activations int8 per row (MatMulInteger), head too{smooth}, "
                f"embed int8 b{q['block']}")
    offsets = " + offsets" if q.get("offsets") else ""
    return f"int{q['bits']} b{q['block']}{offsets}{smooth}, head int{q['head_bits']}, embed {q.get('embed', 'int8')}"


def load_bundle(path: str, threads: int, backend: str):
    from ..runtime.generator import Generator

    if not os.path.isdir(path):
        raise QualityError(f"bundle not found: {path}")
    gen = Generator.load(path, backend=backend, threads=threads)
    if gen.tokenizer is None:
        gen.close()
        raise QualityError(f"{path}: the bundle has no tokenizer (or the tokenizers package is missing: "
                           "pip install 'specedge[text]')")
    return gen


def eval_bundle(gen, name: str, wins: list[list[int]]) -> Scores:
    runner = gen.target
    runner.use_steps(None)
    chunk = max(runner.entry.step_tokens())
    nlls, tops = [], []
    began = time.perf_counter()
    for win in wins:
        runner.reset()
        feed, targets = win[:-1], win[1:]
        for s in range(0, len(feed), chunk):
            part = feed[s:s + chunk]
            logits = runner.run(part)  # a view, valid until the next run: score it now
            nll, top = score_rows(logits, targets[s:s + len(part)])
            nlls.append(nll)
            tops.append(top)
    seconds = time.perf_counter() - began
    runner.reset()
    return Scores(name, "bundle", os.path.abspath(gen.bundle_dir), _describe_bundle(gen.manifest),
                  np.concatenate(nlls), np.concatenate(tops), seconds,
                  {"step_tokens": chunk, "quant": gen.manifest.target.quant})


# -- ORT GenAI peers ---------------------------------------------------------------------------------------
_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
               "tensor(int32)": np.int32}


def eval_ort_genai(name: str, gguf: str, wins: list[list[int]], threads: int, cache_dir: str) -> Scores:
    """ORT GenAI's builder output for the GGUF, run by onnxruntime directly: one forward per window, empty past."""
    import onnxruntime as ort

    from .peers import PeerUnavailable, build_ort_genai_model

    precision = PEER_PRECISIONS[name]
    try:
        model_dir = build_ort_genai_model(gguf, cache_dir, precision=precision)
    except PeerUnavailable as e:
        raise QualityError(f"--peer {name}: {e}") from None
    with open(os.path.join(model_dir, "genai_config.json")) as f:
        decoder = json.load(f)["model"]["decoder"]
    head_size, kv_heads = int(decoder["head_size"]), int(decoder["num_key_value_heads"])
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(os.path.join(model_dir, decoder["filename"]), options,
                                   providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    known = {"input_ids", "attention_mask", "position_ids"}
    pasts = [n for n in inputs if n.startswith("past_key_values.")]
    odd = set(inputs) - known - set(pasts)
    if odd:
        raise QualityError(f"--peer {name}: the ORT GenAI model has inputs this tool does not feed: {sorted(odd)}")
    nlls, tops = [], []
    began = time.perf_counter()
    for win in wins:
        feed, targets = np.asarray(win[:-1]), win[1:]
        n = len(feed)
        values = {"input_ids": feed[None, :], "attention_mask": np.ones((1, n)), "position_ids": np.arange(n)[None, :]}
        run_inputs = {k: v.astype(_ORT_DTYPES[inputs[k].type]) for k, v in values.items() if k in inputs}
        for p in pasts:
            run_inputs[p] = np.zeros((1, kv_heads, 0, head_size), _ORT_DTYPES[inputs[p].type])
        logits = session.run(["logits"], run_inputs)[0][0]
        nll, top = score_rows(logits, targets)
        nlls.append(nll)
        tops.append(top)
    seconds = time.perf_counter() - began
    with open(os.path.join(model_dir, "specedge-peer.json")) as f:
        built = json.load(f)
    counts = _ort_quant_summary(os.path.join(model_dir, decoder["filename"]))
    weights = "fp32" if precision == "fp32" else f"ORT GenAI {precision} ({counts})"
    return Scores(name, "peer", model_dir, weights, np.concatenate(nlls), np.concatenate(tops), seconds,
                  {"builder_args": built.get("builder_args"), "onnxruntime_genai": built.get("onnxruntime_genai")})


def _ort_quant_summary(model_path: str) -> str:
    """The quantized ops of the peer's graph in words, e.g. 'MatMulNBits 4-bit b32 x151, embed 4-bit b32'."""
    try:
        import onnx
        from onnx import helper
    except ImportError:
        return "int4"
    graph = onnx.load(model_path, load_external_data=False).graph
    seen: dict[str, int] = {}
    for node in graph.node:
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            what = "matmuls" if node.op_type == "MatMulNBits" else "embed"
            key = f"{what} {attrs.get('bits', 4)}-bit b{attrs.get('block_size', '?')}"
            seen[key] = seen.get(key, 0) + 1
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in seen.items()) or "no quantized ops"


# -- llama.cpp -----------------------------------------------------------------------------------------------
def eval_llama_cpp(gguf: str, wins: list[list[int]], threads: int) -> Scores:
    """llama.cpp on the GGUF itself (its own quantized kernels), every position's logits: one eval per window
    from an empty cache."""
    from .peers import PeerUnavailable, load_llama_cpp

    window = max(len(w) for w in wins)
    try:
        llm = load_llama_cpp(gguf, threads, n_ctx=max(window, 16), logits_all=True)
    except PeerUnavailable as e:
        raise QualityError(f"--peer llama.cpp: {e}") from None
    nlls, tops = [], []
    began = time.perf_counter()
    for win in wins:
        feed, targets = win[:-1], win[1:]
        llm.reset()
        llm.eval(feed)
        nll, top = score_rows(np.array(llm.scores[:len(feed)], np.float32), targets)
        nlls.append(nll)
        tops.append(top)
    seconds = time.perf_counter() - began
    import llama_cpp

    return Scores("llama.cpp", "peer", gguf, f"the GGUF as llama.cpp runs it ({os.path.basename(gguf)})",
                  np.concatenate(nlls), np.concatenate(tops), seconds, {"llama_cpp_python": llama_cpp.__version__})


# -- the report ---------------------------------------------------------------------------------------------
def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float((a == b).mean())


def render_table(rows: list[Scores], targets: np.ndarray) -> str:
    ref = rows[0]
    lines = [f"| model | weights | positions | perplexity | top-1 acc (text) | top-1 agreement with {ref.name} | s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        agree = "reference" if r is ref else f"{agreement(r.argmax, ref.argmax):.2%}"
        lines.append(f"| {r.name} | {r.weights} | {r.positions} | {r.perplexity:.3f} | "
                     f"{agreement(r.argmax, targets):.2%} | {agree} | {r.seconds:.0f} |")
    return "\n".join(lines)


def render_pairwise(rows: list[Scores]) -> str:
    lines = ["| top-1 agreement | " + " | ".join(r.name for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for a in rows:
        lines.append(f"| {a.name} | " + " | ".join(f"{agreement(a.argmax, b.argmax):.2%}" for b in rows) + " |")
    return "\n".join(lines)


def _versions() -> dict:
    out = {}
    for module, label in (("onnxruntime", "onnxruntime"), ("onnxruntime_genai", "onnxruntime-genai"),
                          ("numpy", "numpy"), ("tokenizers", "tokenizers")):
        try:
            out[label] = __import__(module).__version__
        except ImportError:
            out[label] = None
    from .. import __version__

    out["specedge"] = __version__
    out["python"] = sys.version.split()[0]
    return out


def write_json(path: str, result: dict, rows: list[Scores]) -> None:
    """Everything, with each argmax array on one line (a list per model, in position order)."""
    result = dict(result)
    result["argmax"] = {r.name: f"@@ARGMAX{i}@@" for i, r in enumerate(rows)}
    text = json.dumps(result, indent=1)
    for i, r in enumerate(rows):
        text = text.replace(f'"@@ARGMAX{i}@@"', json.dumps(r.argmax.tolist(), separators=(",", ":")))
    with open(path, "w") as f:
        f.write(text + "\n")


def _unique_names(paths: list[str]) -> list[str]:
    names = [os.path.basename(os.path.normpath(p)) or p for p in paths]
    if len(set(names)) == len(names):
        return names
    return [os.path.normpath(p) for p in paths]


def run_quality(bundles: list[str], peers: list[str], gguf: str | None, text_path: str, window: int,
                threads: int, cache_dir: str | None, backend: str = "cpu",
                log=None) -> tuple[dict, list[Scores], np.ndarray]:
    """Score every bundle, then every peer, on the same windows; (JSON-ready result, rows, next-token targets)."""
    say = log or (lambda msg: print(msg, file=sys.stderr))
    if not bundles:
        raise QualityError("give at least one bundle (the first one is the reference)")
    for p in peers:
        if p not in PEERS:
            raise QualityError(f"unknown peer {p!r}; --peer takes {', '.join(PEERS)}")
    if window < 2:
        raise QualityError(f"--window must be at least 2, not {window}")
    if threads < 0:
        raise QualityError(f"--threads must be 0 (library default) or more, not {threads}")
    for b in bundles:
        if not os.path.isdir(b):
            raise QualityError(f"bundle not found: {b}")
    text = read_text(text_path)
    names = _unique_names(bundles)

    rows: list[Scores] = []
    ids = None
    wins = None
    reference_source = None
    for name, path in zip(names, bundles):
        gen = load_bundle(path, threads, backend)
        try:
            these = gen.tokenizer.encode(text)
            if ids is None:
                ids, reference_source = these, gen.manifest.export.get("target")
                wins = windows(ids, window)
                if not wins:
                    raise QualityError(f"{text_path} has fewer than 2 tokens")
            elif these != ids:
                raise QualityError(f"{path} tokenizes the text differently from {bundles[0]}: not the same tokenizer")
            if window - 1 > gen.target.dims.context:
                raise QualityError(f"--window {window} does not fit {path}: its context holds "
                                   f"{gen.target.dims.context} tokens (a window of W tokens needs W - 1)")
            say(f"quality: {name} ({len(wins)} windows)")
            rows.append(eval_bundle(gen, name, wins))
        finally:
            gen.close()

    notes = []
    if peers:
        gguf = gguf or _default_gguf(reference_source)
        if gguf is None:
            raise QualityError("--peer needs the GGUF the bundles were exported from: pass --gguf PATH")
        if not os.path.isfile(gguf):
            raise QualityError(f"GGUF not found: {gguf}")
        cache = cache_dir or _default_cache()
        for p in peers:
            say(f"quality: {p} ({len(wins)} windows)")
            rows.append(eval_llama_cpp(gguf, wins, threads) if p == "llama.cpp"
                        else eval_ort_genai(p, gguf, wins, threads, cache))

    targets = np.asarray([t for w in wins for t in w[1:]], np.int64)
    ref = rows[0]
    result = {
        "command": " ".join([os.path.basename(sys.executable), "-m", "specedge.tools.quality", *sys.argv[1:]]),
        "argv": sys.argv[1:],
        "text": text_path, "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "text_tokens": len(ids),
        "window": window, "windows": len(wins), "positions": int(targets.size), "threads": threads,
        "backend": backend, "versions": _versions(), "reference": ref.name,
        "rows": [{"name": r.name, "kind": r.kind, "path": r.path, "weights": r.weights, "positions": r.positions,
                  "mean_nll": float(r.nll.mean()), "perplexity": r.perplexity,
                  "top1_accuracy": agreement(r.argmax, targets),
                  "top1_agreement_with_reference": agreement(r.argmax, ref.argmax),
                  "seconds": round(r.seconds, 2), **r.extra} for r in rows],
        "pairwise_agreement": {a.name: {b.name: agreement(a.argmax, b.argmax) for b in rows} for a in rows},
        "notes": notes,
    }
    return result, rows, targets


def _default_gguf(source: str | None) -> str | None:
    """The embedded SmolLM2 GGUF when the reference bundle was exported from it (as `specedge bench` does)."""
    from .demo import smollm2_gguf

    path = smollm2_gguf()
    return path if path and source == os.path.basename(path) else None


def _default_cache() -> str:
    from .demo import cache_dir

    return os.path.join(cache_dir(), "peers")  # shared with `specedge bench --compare`


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specedge.tools.quality",
                                description="Teacher-forced quality of bundles (and ORT GenAI peers) on a fixed text: "
                                "perplexity, top-1 accuracy and top-1 agreement with the first bundle.")
    p.add_argument("bundles", nargs="+", metavar="BUNDLE",
                   help="bundles; the first is the reference (normally float32)")
    p.add_argument("--peer", action="append", default=[], choices=PEERS,
                   help="also score a peer model of the same GGUF (repeatable): ort-genai-int4, ort-genai, llama.cpp")
    p.add_argument("--gguf", metavar="PATH", help="the GGUF the peers are built from (default: the embedded SmolLM2 "
                   "GGUF when the reference bundle came from it)")
    p.add_argument("--text", default=None, metavar="FILE",
                   help=f"evaluation text (default: {DEFAULT_TEXT} of the repository)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per window (default 512)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--backend", default="cpu", help="our runtime's backend (default cpu)")
    p.add_argument("--json", metavar="OUT", help="write every number, the argmax arrays and the command as JSON")
    p.add_argument("--cache-dir", metavar="DIR", help="where peer models are built and cached "
                   "(default: the specedge cache's peers/, shared with specedge bench --compare)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    text = args.text
    if text is None:
        text = DEFAULT_TEXT if os.path.isfile(DEFAULT_TEXT) else os.path.join(REPO_ROOT, DEFAULT_TEXT)

    def run() -> int:
        result, rows, targets = run_quality(args.bundles, args.peer, args.gguf, text, args.window, args.threads,
                                            args.cache_dir, args.backend)
        print(render_table(rows, targets))
        print()
        print(render_pairwise(rows))
        print(f"\n{result['text_tokens']} text tokens, {result['windows']} windows of up to {args.window}, "
              f"{result['positions']} positions; threads {args.threads}; "
              + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v))
        for note in result["notes"]:
            print(f"note: {note}")
        if args.json:
            write_json(args.json, result, rows)
        return 0

    return exit_status("quality", run)


if __name__ == "__main__":
    sys.exit(main())
