"""Calibration for a smoothed quantized bundle: the largest |input| per channel of every weight product, measured by
running the model itself (the float32 step graph graphs/llama.py builds, with a tap at each product's input,
one layer at a time) over calibration prompts. graphs/quant.py says what the ranges are for.

The prompts' token ids are concatenated and cut into windows of WINDOW tokens, each run as one step from an
empty cache (positions 0..WINDOW-1): the ranges are maxima over every position of every window.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace

import numpy as np
import onnx

from ..errors import ExportError
from ..graphs import contract as C
from ..graphs import llama
from ..graphs.builder import GraphBuilder
from ..graphs.quant import QUANT_IR_VERSION, QUANT_OPSET
from ..runtime.backends import trim_heap
from .weights import write_weights

WINDOW = 256  # tokens per calibration step
DEFAULT_COUNT = 64  # calibration prompts (the prompt suite has 37: all of them, about 6,000 tokens)
EMBED, FIRST_LAYER = "model.embed_tokens.weight", "model.layers.0."  # transformers' names


def calibration_windows(prompts: list[list[int]], window: int = WINDOW) -> list[list[int]]:
    """The prompts' ids end to end, cut into windows of `window` (the remainder dropped, unless it is all)."""
    ids = [t for p in prompts for t in p]
    if len(ids) <= window:
        return [ids]
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def activation_ranges(cfg: llama.LlamaConfig, tensor, windows: list[list[int]]) -> dict[str, np.ndarray]:
    """Weight name -> [K] float32, the largest |x[:, k]| of that product's input x over `windows` (each a list
    of token ids, all of one length). `tensor(name)` gives the float32 weights by transformers name.

    The model runs one layer at a time: a graph for the embedding, then one per layer (graphs/llama.py's step
    graph built for one layer) whose embedding table is the residual stream entering that layer, one row per
    calibration token, and which returns the stream leaving it. So calibrating holds one layer's float32
    weights at a time, not a float32 copy of the whole model (SmolLM2: the calibration's peak RSS 1.25 GB ->
    0.57 GB, the same ranges; a 7B model's float32 copy would be 28 GB)."""
    T = len(windows[0])
    if any(len(w) != T for w in windows):
        raise ValueError("calibration windows must all have one length")
    rows = np.arange(len(windows) * T, dtype=np.int64).reshape(len(windows), T)  # window w's token t: row w*T + t
    # Layer i alone, as layer 0 of a model whose embedding table is the carried residual stream (no embedding
    # scale, no separate head: a STEP graph's head reads that table, and only the head's input is tapped).
    one_layer = replace(cfg, num_layers=1, embed_scale=None, tie_word_embeddings=True, vocab_size=rows.size)
    ranges: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix="specedge-calibration-") as tmp:
        _, stream = _run(tmp, replace(cfg, num_layers=0, tie_word_embeddings=True), tensor,
                         np.array(windows, np.int64), C.PREFILL)
        for i in range(cfg.num_layers):
            layer_cfg = replace(one_layer, sliding_layers=None if cfg.sliding_layers is None
                                else (0,) if cfg.slides(i) else ())

            def layer_tensor(name: str, i: int = i, stream: np.ndarray = stream) -> np.ndarray:
                if name == EMBED:
                    return stream
                if name.startswith(FIRST_LAYER):
                    return tensor(f"model.layers.{i}." + name[len(FIRST_LAYER):])
                return tensor(name)

            last = i == cfg.num_layers - 1
            found, stream = _run(tmp, layer_cfg, layer_tensor, rows, C.STEP if last else C.PREFILL)
            for name, r in found.items():
                ranges[f"layers.{i}." + name[len("layers.0."):] if name.startswith("layers.0.") else name] = r
    if any(not np.all(np.isfinite(r)) for r in ranges.values()):
        raise ExportError("calibration found activations that are not finite: the model overflows float32 on the "
                          "calibration prompts")
    return ranges


def _run(tmp: str, cfg: llama.LlamaConfig, tensor, ids: np.ndarray, role: str
         ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """`cfg`'s float32 step graph (`role`; a STEP graph also has the head's tap) run on each row of ids [W, T]
    from an empty cache: each tap's maximum over every row, and the residual stream after the graph's last
    layer, [W*T, E]."""
    import onnxruntime as ort

    W, T = ids.shape
    dims = cfg.dims(T, 1, "float32")
    folder = tempfile.mkdtemp(dir=tmp)
    head = role == C.STEP
    refs = write_weights(os.path.join(folder, "calibration.weights.bin"),
                         llama.graph_weights(cfg, T, "float32", tensor, matmul_head=head))
    g = GraphBuilder("calibration", refs, "calibration.weights.bin", opset=QUANT_OPSET, ir_version=QUANT_IR_VERSION)
    taps: dict[str, str] = {}
    residual = llama.build_step_graph(cfg, dims, T, role, g, matmul_head=head, taps=taps)
    for weight, value in taps.items():
        g.declare_output(C.TensorSpec(value, "float32", (refs[weight].shape[0],)))
    g.declare_output(C.TensorSpec(residual, "float32", (T, cfg.hidden_size)))
    path = os.path.join(folder, "calibration.onnx")
    onnx.save(g.build(), path)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the embedding's graph leaves the layers' constants unused: no warning for that
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = list(taps)
    found: dict[str, np.ndarray] = {}
    stream = np.empty((W * T, cfg.hidden_size), np.float32)
    for w in range(W):
        feed = {spec.name: np.zeros(spec.shape, spec.dtype) for spec in C.step_inputs(dims, T, False, T)}
        feed[C.INPUT_IDS][0] = ids[w]
        feed[C.POSITION_IDS][0] = np.arange(T)
        *got, stream[w * T:(w + 1) * T] = session.run([taps[n] for n in names] + [residual], feed)
        for n, r in zip(names, got):
            found[n] = r if n not in found else np.maximum(found[n], r)
    del session
    shutil.rmtree(folder)
    trim_heap()  # the session's buffers, freed but kept by glibc: returned before the next layer's graph
    return found, stream
