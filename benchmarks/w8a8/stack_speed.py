"""Weight products of a SmolLM2-sized model as onnxruntime runs them: int4 MatMulNBits (today's quantized
bundles) against int8 weights with per-row int8 activations through the standard MatMulInteger.

    python benchmarks/w8a8/stack_speed.py [--threads 2] [--rounds 3]

One graph per scheme (and today's int8 layout, MatMulNBits with 8-bit blocks of 32) chains the 120 products
of SmolLM2's 30 blocks (qkv 576x960, o 576x576, gate_up
576x3072, down 1536x576; random weights, so 93 MB of int8 or 47 MB of int4 stream from memory as in a real
step; no attention, norms or head). Rows M = 1 (decode), 2..17 (verify) and 64 (a prefill chunk); the best
of `--rounds` interleaved rounds. Also checked:

* rows: an M-row run computes every row bit for bit as M one-row runs (what exact speculation needs).
  MatMulInteger's sums are integers, so its rows are exact by construction on any kernel; a float scale per
  row and per column is applied after it, one product per element;
* one block's four int8 products against the same products computed in float64 from the integers.

int8 activations: per row r, s_r = max|x_r| / 127 and x_q = round(x / s_r) + 128 as uint8 (zero point 128:
onnxruntime's fast x86 kernels take uint8 x int8), then MatMulInteger(x_q, W_q, 128) * s_r * s_w[column].
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

E, I, LAYERS = 576, 1536, 30
SHAPES = [(E, 960), (E, E), (E, 2 * I), (I, E)]  # qkv, o, gate_up, down: [K, N]
NEXT_K = {0: E, 1: E, 2: I, 3: E}  # each product's output is cut to the next one's input width


def build(kind: str, threads: int, rng, layers: int = LAYERS) -> tuple[ort.InferenceSession, list]:
    nodes, inits, ref = [], [], []
    x = "x"
    for layer in range(layers):
        for j, (K, N) in enumerate(SHAPES):
            w, y = f"w{layer}_{j}", f"y{layer}_{j}"
            if kind == "int4":
                q = rng.integers(1, 16, (N, K)).astype(np.uint8)  # q - 8 in -7..7: no common drift along the chain
                scale = ((0.9 + 0.2 * rng.random(N * K // 32)) / (4.6 * np.sqrt(K))).astype(np.float32)
                inits += [numpy_helper.from_array((q[:, 0::2] | (q[:, 1::2] << 4)).reshape(N, K // 32, 16), w),
                          numpy_helper.from_array(scale, w + "s")]
                nodes.append(helper.make_node("MatMulNBits", [x, w, w + "s"], [y], domain="com.microsoft", K=K, N=N,
                                              bits=4, block_size=32, accuracy_level=4))
            elif kind == "int8-nbits":  # today's --quant int8: uint8 with the implied zero point 128
                q = rng.integers(1, 256, (N, K)).astype(np.uint8)
                scale = ((0.9 + 0.2 * rng.random(N * K // 32)) / (73 * np.sqrt(K))).astype(np.float32)
                inits += [numpy_helper.from_array(q.reshape(N, K // 32, 32), w),
                          numpy_helper.from_array(scale, w + "s")]
                nodes.append(helper.make_node("MatMulNBits", [x, w, w + "s"], [y], domain="com.microsoft", K=K, N=N,
                                              bits=8, block_size=32, accuracy_level=4))
            else:
                wq = rng.integers(-127, 128, (K, N)).astype(np.int8)
                # scales that keep the activations' size along the chain (a weight's spread is about 73 levels)
                ws = ((0.9 + 0.2 * rng.random((1, N))) / (73 * np.sqrt(K))).astype(np.float32)
                ref.append((wq, ws))
                inits += [numpy_helper.from_array(wq, w), numpy_helper.from_array(ws, w + "s")]
                nodes += [helper.make_node("Abs", [x], [w + "_a"]),
                          helper.make_node("ReduceMax", [w + "_a", "axis1"], [w + "_m"], keepdims=1),
                          helper.make_node("Mul", [w + "_m", "inv127"], [w + "_sr"]),  # [M, 1]
                          helper.make_node("Div", [x, w + "_sr"], [w + "_d"]),
                          helper.make_node("Round", [w + "_d"], [w + "_r"]),
                          helper.make_node("Add", [w + "_r", "f128"], [w + "_u"]),
                          helper.make_node("Cast", [w + "_u"], [w + "_q"], to=TensorProto.UINT8),
                          helper.make_node("MatMulInteger", [w + "_q", w, "u128"], [w + "_i"]),
                          helper.make_node("Cast", [w + "_i"], [w + "_f"], to=TensorProto.FLOAT),
                          helper.make_node("Mul", [w + "_f", w + "s"], [w + "_fs"]),
                          helper.make_node("Mul", [w + "_fs", w + "_sr"], [y])]
            if N != NEXT_K[j]:
                nodes.append(helper.make_node("Slice", [y, "zero", f"end{NEXT_K[j]}", "axis1"], [y + "_cut"]))
                y += "_cut"
            x = y
    inits += [numpy_helper.from_array(np.array([1], np.int64), "axis1"),
              numpy_helper.from_array(np.array([0], np.int64), "zero"),
              numpy_helper.from_array(np.array([E], np.int64), f"end{E}"),
              numpy_helper.from_array(np.array([I], np.int64), f"end{I}"),
              numpy_helper.from_array(np.array(1 / 127, np.float32), "inv127"),
              numpy_helper.from_array(np.array(128, np.float32), "f128"),
              numpy_helper.from_array(np.array(128, np.uint8), "u128")]
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", E])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", E])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]), ref


def reference(x: np.ndarray, ref: list) -> np.ndarray:
    """The int8 chain in float64 from the same integers (its activations quantized as the graph does)."""
    for j, (wq, ws) in enumerate(ref):
        x32 = x.astype(np.float32)
        sr = np.abs(x32).max(1, keepdims=True) * np.float32(1 / 127)
        q = np.rint(x32 / sr)
        x = (q.astype(np.float64) @ wq.astype(np.float64)) * ws * sr
        x = x[:, :NEXT_K[j % 4]]
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    sessions = {kind: build(kind, a.threads, rng) for kind in ("int4", "int8-nbits", "int8")}
    x9 = rng.standard_normal((9, E)).astype(np.float32)
    for kind, (s, _) in sessions.items():
        rows = np.concatenate([s.run(None, {"x": x9[i:i + 1]})[0] for i in range(9)])
        same = np.array_equal(rows, s.run(None, {"x": x9})[0])
        print(f"{kind}: a 9-row run equals nine one-row runs bit for bit: {same}")
    block, ref = build("int8", a.threads, rng, layers=1)
    got, want = block.run(None, {"x": x9})[0], reference(x9, ref)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"int8, one block: largest relative error against float64 {err:.1e}")
    print("| M | int4 MatMulNBits ms | int8 MatMulNBits ms | int8 MatMulInteger ms | MatMulInteger / int4 |\n"
          "|---|---|---|---|---|")
    for M in (1, 2, 3, 5, 9, 17, 64):
        x = rng.standard_normal((M, E)).astype(np.float32)
        best = {}
        for _ in range(a.rounds):
            for kind, (s, _) in sessions.items():
                for _ in range(3):
                    s.run(None, {"x": x})
                n = 30 if M < 64 else 8
                t = time.perf_counter()
                for _ in range(n):
                    s.run(None, {"x": x})
                best[kind] = min(best.get(kind, 1e9), (time.perf_counter() - t) / n * 1e3)
        print(f"| {M} | {best['int4']:.2f} | {best['int8-nbits']:.2f} | {best['int8']:.2f} | "
              f"{best['int8'] / best['int4']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
