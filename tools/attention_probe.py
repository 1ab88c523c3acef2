"""Could a fused attention kernel replace the decomposed attention of our step graphs? Measures, on
onnxruntime's CPU provider and SmolLM2's attention shapes, the two things that decide it:

* exactness: are the rows of a T-token call bitwise equal to T one-token calls over the same cache (what
  greedy speculation's exactness rests on; see docs/bundle.md, "position consistency")?
* cost: 30 chained attention calls for one decode token, against our decomposed form (MatMul, Concat,
  Softmax, Split, MatMul) over the same past.

Candidates: onnxruntime's contrib GroupQueryAttention (ORT GenAI's kernel) over a shared past/present
buffer, with and without its rotary; the standard opset-23 Attention with past inputs.

    python -m specedge.tools.attention_probe [--threads 2] [--context 512] [--cache-len 400]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

H, HKV, D, LAYERS = 9, 3, 64, 30  # SmolLM2-135M
REP = H // HKV


def _model(nodes, inputs, outputs, inits, opsets):
    from onnx import helper

    g = helper.make_graph(nodes, "probe", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = 10
    return m.SerializeToString()


def _vi(name, shape, elem=None):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, elem or TensorProto.FLOAT, shape)


def gqa_model(T: int, S: int, layers: int, rotary: bool) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    angles = np.arange(S)[:, None] * inv[None]
    extra = ["cos", "sin"] if rotary else []
    inits = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
             numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")] if rotary else []
    nodes, q = [], "q"
    for layer in range(layers):
        last = layer == layers - 1
        nodes.append(helper.make_node(
            "GroupQueryAttention", [q, "k", "v", "past_k", "past_v", "seqlens_k", "total_len"] + extra,
            [f"y{layer}", "present_k" if last else f"pk{layer}", "present_v" if last else f"pv{layer}"],
            domain="com.microsoft", num_heads=H, kv_num_heads=HKV, do_rotary=int(rotary)))
        q = f"y{layer}"
    inputs = [_vi("q", [1, T, H * D]), _vi("k", [1, T, HKV * D]), _vi("v", [1, T, HKV * D]),
              _vi("past_k", [1, HKV, S, D]), _vi("past_v", [1, HKV, S, D]),
              _vi("seqlens_k", [1], TensorProto.INT32), _vi("total_len", [], TensorProto.INT32)]
    outputs = [_vi(q, [1, T, H * D]), _vi("present_k", [1, HKV, S, D]), _vi("present_v", [1, HKV, S, D])]
    return _model(nodes, inputs, outputs, inits, [("", 21), ("com.microsoft", 1)])


def decomposed_model(S: int, layers: int) -> bytes:
    """Our T=1 attention (graphs/llama.py): scores over the past and over the step's own token, joined,
    masked, softmaxed, split, and applied to past V and own V."""
    from onnx import helper, numpy_helper

    nodes, q = [], "q"
    for layer in range(layers):
        p = f"l{layer}_"
        nodes += [helper.make_node("Transpose", ["past_k"], [p + "kT"], perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", [q, p + "kT"], [p + "s_past"]),
                  helper.make_node("Transpose", ["k"], [p + "nT"], perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", [q, p + "nT"], [p + "s_own"]),
                  helper.make_node("Concat", [p + "s_past", p + "s_own"], [p + "s"], axis=-1),
                  helper.make_node("Add", [p + "s", "mask"], [p + "sm"]),
                  helper.make_node("Softmax", [p + "sm"], [p + "pr"], axis=-1),
                  helper.make_node("Split", [p + "pr", "split"], [p + "p_past", p + "p_own"], axis=-1),
                  helper.make_node("MatMul", [p + "p_past", "past_v"], [p + "a_past"]),
                  helper.make_node("MatMul", [p + "p_own", "v"], [p + "a_own"]),
                  helper.make_node("Add", [p + "a_past", p + "a_own"], [p + "o"])]
        q = p + "o"
    inputs = [_vi("q", [1, HKV, REP, D]), _vi("past_k", [1, HKV, S, D]), _vi("past_v", [1, HKV, S, D]),
              _vi("k", [1, HKV, 1, D]), _vi("v", [1, HKV, 1, D]), _vi("mask", [1, 1, REP, S + 1])]
    inits = [numpy_helper.from_array(np.array([S, 1], np.int64), "split")]
    return _model(nodes, inputs, [_vi(q, [1, HKV, REP, D])], inits, [("", 21)])


def attention23_model(S: int, layers: int) -> bytes:
    from onnx import helper

    nodes, q = [], "q"
    for layer in range(layers):
        nodes.append(helper.make_node("Attention", [q, "k", "v", "mask", "past_k", "past_v"],
                                      [f"y{layer}", f"pk{layer}", f"pv{layer}"], q_num_heads=H, kv_num_heads=HKV))
        q = f"y{layer}"
    inputs = [_vi("q", [1, H, 1, D]), _vi("k", [1, HKV, 1, D]), _vi("v", [1, HKV, 1, D]),
              _vi("mask", [1, 1, 1, S + 1]), _vi("past_k", [1, HKV, S, D]), _vi("past_v", [1, HKV, S, D])]
    return _model(nodes, inputs, [_vi(q, [1, H, 1, D])], [], [("", 23)])


class _Gqa:
    """One GroupQueryAttention session whose present K/V are bound to the past buffers (shared in place)."""

    def __init__(self, T, S, layers, rotary, threads):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = threads, 3
        self.ort, self.T, self.layers = ort, T, layers
        self.session = ort.InferenceSession(gqa_model(T, S, layers, rotary), so, providers=["CPUExecutionProvider"])

    def run(self, start, q, k, v, keys, values, repeats=1):
        ort, io = self.ort, self.session.io_binding()
        kv, vv = ort.OrtValue.ortvalue_from_numpy(keys), ort.OrtValue.ortvalue_from_numpy(values)
        for name, x in (("q", q), ("k", k), ("v", v), ("seqlens_k", np.array([start + self.T - 1], np.int32)),
                        ("total_len", np.array(start + self.T, np.int32))):
            io.bind_cpu_input(name, x)
        io.bind_ortvalue_input("past_k", kv)
        io.bind_ortvalue_input("past_v", vv)
        y = np.empty((1, self.T, H * D), np.float32)
        io.bind_output(f"y{self.layers - 1}", "cpu", 0, np.float32, y.shape, y.ctypes.data)
        io.bind_ortvalue_output("present_k", kv)
        io.bind_ortvalue_output("present_v", vv)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            self.session.run_with_iobinding(io)
            times.append(time.perf_counter() - began)
        return y, float(np.median(times))


def gqa_rows(S, start, rotary, threads, T=9) -> tuple[list[float], bool]:
    """max |row t of one T-token call - the t-th of T one-token calls|, and whether the cache agrees."""
    rng = np.random.default_rng(0)
    keys = np.zeros((1, HKV, S, D), np.float32)
    values = np.zeros_like(keys)
    keys[:, :, :start] = rng.standard_normal((1, HKV, start, D))
    values[:, :, :start] = rng.standard_normal((1, HKV, start, D))
    q = rng.standard_normal((1, T, H * D)).astype(np.float32)
    k = rng.standard_normal((1, T, HKV * D)).astype(np.float32)
    v = rng.standard_normal((1, T, HKV * D)).astype(np.float32)
    one, many = _Gqa(1, S, 1, rotary, threads), _Gqa(T, S, 1, rotary, threads)
    k1, v1 = keys.copy(), values.copy()
    rows = np.concatenate([one.run(start + t, q[:, t:t + 1].copy(), k[:, t:t + 1].copy(), v[:, t:t + 1].copy(),
                                   k1, v1)[0] for t in range(T)], axis=1)
    kt, vt = keys.copy(), values.copy()
    whole = many.run(start, q, k, v, kt, vt)[0]
    return np.abs(whole - rows).max(axis=(0, 2)).tolist(), bool(np.array_equal(k1, kt) and np.array_equal(v1, vt))


def timings(S, start, threads, repeats=30) -> dict[str, float]:
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = threads, 3
    past_k = rng.standard_normal((1, HKV, S, D)).astype(np.float32)
    past_v = rng.standard_normal((1, HKV, S, D)).astype(np.float32)
    k = rng.standard_normal((1, HKV, 1, D)).astype(np.float32)
    v = rng.standard_normal((1, HKV, 1, D)).astype(np.float32)
    q = (rng.standard_normal((1, HKV, REP, D)) * 0.1).astype(np.float32)
    row = np.where(np.arange(S + 1) < start, 0.0, -3e38).astype(np.float32)
    row[S] = 0.0
    out = {}

    def median(session, feeds):
        for _ in range(5):
            session.run(None, feeds)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - began)
        return float(np.median(times))

    dec = ort.InferenceSession(decomposed_model(S, LAYERS), so, providers=["CPUExecutionProvider"])
    out["decomposed (ours)"] = median(dec, {"q": q, "past_k": past_k, "past_v": past_v, "k": k, "v": v,
                                            "mask": np.broadcast_to(row, (1, 1, REP, S + 1)).copy()})
    try:
        att = ort.InferenceSession(attention23_model(S, LAYERS), so, providers=["CPUExecutionProvider"])
        out["Attention-23 (past inputs)"] = median(att, {"q": q.reshape(1, H, 1, D), "k": k, "v": v, "past_k": past_k,
                                                         "past_v": past_v, "mask": row.reshape(1, 1, 1, S + 1)})
    except Exception as e:  # an onnxruntime without opset 23 Attention
        print(f"Attention-23 unavailable: {str(e).splitlines()[0]}")
    for rotary in (False, True):
        g = _Gqa(1, S, LAYERS, rotary, threads)
        keys, values = past_k.copy(), past_v.copy()
        qq = rng.standard_normal((1, 1, H * D)).astype(np.float32)
        kk = k.reshape(1, 1, HKV * D).copy()
        vv = v.reshape(1, 1, HKV * D).copy()
        g.run(start, qq, kk, vv, keys, values, repeats=5)
        out[f"GroupQueryAttention{' + rotary' if rotary else ''} (shared buffer)"] = g.run(
            start, qq, kk, vv, keys, values, repeats=repeats)[1]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specedge.tools.attention_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=512, help="past buffer slots S")
    p.add_argument("--cache-len", type=int, default=400, help="valid past entries")
    a = p.parse_args(argv)
    for rotary in (False, True):
        diffs, cache_ok = gqa_rows(a.context, 100, rotary, a.threads)
        print(f"GroupQueryAttention{' + rotary' if rotary else ''}: T=9 rows vs 9 one-token calls, max |diff| per row: "
              + " ".join(f"{x:.2g}" for x in diffs) + f"; cache written identically: {cache_ok}")
    print(f"cost of {LAYERS} attention calls for one decode token (S={a.context}, cache_len={a.cache_len}, "
          f"{a.threads} threads):")
    for name, seconds in timings(a.context, a.cache_len, a.threads).items():
        print(f"  {name:45s} {seconds * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
