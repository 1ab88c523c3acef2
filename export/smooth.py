"""Calibration for a smoothed quantized bundle: the largest |input| per channel of every weight product, measured by
running the model itself (the float32 step graph graphs/llama.py builds, with a tap at each product's input)
over calibration prompts. graphs/quant.py says what the ranges are for.

The prompts' token ids are concatenated and cut into windows of WINDOW tokens, each run as one step from an
empty cache (positions 0..WINDOW-1): the ranges are maxima over every position of every window.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx

from ..errors import ExportError
from ..graphs import contract as C
from ..graphs import llama
from ..graphs.builder import GraphBuilder
from ..graphs.quant import QUANT_IR_VERSION, QUANT_OPSET
from .weights import write_weights

WINDOW = 256  # tokens per calibration step
DEFAULT_COUNT = 64  # calibration prompts (the prompt suite has 37: all of them, about 6,000 tokens)


def calibration_windows(prompts: list[list[int]], window: int = WINDOW) -> list[list[int]]:
    """The prompts' ids end to end, cut into windows of `window` (the remainder dropped, unless it is all)."""
    ids = [t for p in prompts for t in p]
    if len(ids) <= window:
        return [ids]
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]


def activation_ranges(cfg: llama.LlamaConfig, tensor, windows: list[list[int]]) -> dict[str, np.ndarray]:
    """Weight name -> [K] float32, the largest |x[:, k]| of that product's input x over `windows` (each a list
    of token ids, all of one length). `tensor(name)` gives the float32 weights by transformers name."""
    import onnxruntime as ort

    T = len(windows[0])
    if any(len(w) != T for w in windows):
        raise ValueError("calibration windows must all have one length")
    dims = cfg.dims(T, 1, "float32")
    with tempfile.TemporaryDirectory(prefix="specedge-calibration-") as tmp:
        refs = write_weights(os.path.join(tmp, "calibration.weights.bin"),
                             llama.graph_weights(cfg, T, "float32", tensor, matmul_head=True))
        g = GraphBuilder("calibration", refs, "calibration.weights.bin", opset=QUANT_OPSET, ir_version=QUANT_IR_VERSION)
        taps: dict[str, str] = {}
        llama.build_step_graph(cfg, dims, T, C.STEP, g, matmul_head=True, taps=taps)
        for weight, value in taps.items():
            g.declare_output(C.TensorSpec(value, "float32", (refs[weight].shape[0],)))
        path = os.path.join(tmp, "calibration.onnx")
        onnx.save(g.build(), path)
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = list(taps)
        ranges: dict[str, np.ndarray] = {}
        for ids in windows:
            feed = {spec.name: np.zeros(spec.shape, spec.dtype) for spec in C.step_inputs(dims, T, False, T)}
            feed[C.INPUT_IDS][0] = ids
            feed[C.POSITION_IDS][0] = np.arange(T)
            got = session.run([taps[w] for w in names], feed)
            for w, r in zip(names, got):
                ranges[w] = r if w not in ranges else np.maximum(ranges[w], r)
    if any(not np.all(np.isfinite(r)) for r in ranges.values()):
        raise ExportError("calibration found activations that are not finite: the model overflows float32 on the "
                          "calibration prompts")
    return ranges
