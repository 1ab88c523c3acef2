"""Does a SmoothQuant alpha chosen per product beat one alpha for all? Simulated in torch (quality_sim.py's fake
quantization, float LM head), on SmolLM2's GGUF weights.

    python benchmarks/w8a8/alpha_search_sim.py --tokenizer BUNDLE/tokenizer/tokenizer.json [--block 32]

For each product the bundle smooths with one factor vector (q/k/v together, gate/up together, down, and o with
one factor per kv head's channel), the alpha in {none, 0, 0.1, ..., 1} with the least squared error of the
product's output, int8 weights and int8 activations in blocks of `--block` (what MatMulNBits computes at
accuracy level 4) against float32, over 2,048 input rows sampled from the prompt suite (the export's
calibration text). Then the teacher-forced top-1 agreement with float32 over benchmarks/quality/text.txt for:
unsmoothed, alpha 0.5 everywhere (the export's default), and the searched alphas.
"""
from __future__ import annotations

import os
import sys
from collections import Counter

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality_sim as S  # noqa: E402

ALPHAS = [None] + [round(a, 1) for a in np.arange(0.0, 1.01, 0.1)]  # None: no smoothing
ROWS = 2048


def product_inputs(model, wins, rng) -> dict:
    """(layer, first linear of a product) -> ROWS of its input, sampled over `wins`."""
    found = {}
    S.each_input(model, wins, lambda key, x: found.setdefault(key, []).append(x),
                 ("q_proj", "o_proj", "gate_proj", "down_proj"))
    out = {}
    for key, xs in found.items():
        x = torch.cat(xs)
        out[key] = x[torch.from_numpy(np.sort(rng.choice(x.shape[0], min(ROWS, x.shape[0]), replace=False)))]
    return out


def searched_factors(model, stats, inputs, block: int) -> tuple[dict, dict]:
    """Per product the factors (None: unsmoothed) whose fake-quantized output is closest to float32."""
    cfg = model.config
    Hkv, rep, D = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim

    def best(x, w, a_range, w_range, expand=lambda f: f):
        ref, scores = x @ w.T, []
        for alpha in ALPHAS:
            f = None if alpha is None else expand(
                (a_range.clamp_min(1e-5) ** alpha / w_range.clamp_min(1e-5) ** (1 - alpha)).clamp_min(1e-5))
            xs, ws = (x, w) if f is None else (x / f, w * f)
            y = S.fake_quant(xs, -1, block) @ S.fake_quant(ws, 1, block).T
            scores.append((float(((y - ref) ** 2).sum()), alpha, f))
        return min(scores, key=lambda s: s[0])[1:]

    factors, alphas = {}, {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            at, mlp = layer.self_attn, layer.mlp
            w = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
            alphas[(i, "qkv")], f = best(inputs[(i, "q_proj")], w, stats[(i, "q_proj")], w.abs().amax(0))
            factors.update({(i, n): f for n in ("q_proj", "k_proj", "v_proj")})
            w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            alphas[(i, "gate_up")], f = best(inputs[(i, "gate_proj")], w, stats[(i, "gate_proj")], w.abs().amax(0))
            factors.update({(i, n): f for n in ("gate_proj", "up_proj")})
            w = mlp.down_proj.weight
            alphas[(i, "down")], factors[(i, "down_proj")] = best(inputs[(i, "down_proj")], w,
                                                                  stats[(i, "down_proj")], w.abs().amax(0))
            w = at.o_proj.weight
            alphas[(i, "o")], factors[(i, "o_proj")] = best(
                inputs[(i, "o_proj")], w, stats[(i, "o_proj")].reshape(Hkv, rep, D).amax(1),
                w.abs().amax(0).reshape(Hkv, rep, D).amax(1),
                expand=lambda f: f[:, None, :].expand(Hkv, rep, D).reshape(-1))
    return factors, alphas


def agreement(gguf: str, factors: dict | None, block: int, wins, ref) -> float:
    model = S.load_model(gguf)
    for i, parent, name in S.linears(model):
        lin = getattr(parent, name)
        f = factors[(i, name)] if factors else None
        q = S.QuantLinear(lin, "b32", f"b{block}", f)
        q.w = S.fake_quant(lin.weight.data * (f if f is not None else 1), 1, block)
        setattr(parent, name, q)
    return 100 * float((S.argmaxes(model, wins) == ref).mean())


def main() -> int:
    a, gguf = S.parse_args(__doc__, "--block", 32)
    wins = S.windows(a.tokenizer, 15)
    base = S.load_model(gguf)
    ref = S.argmaxes(base, wins)
    calib = S.suite_windows(a.tokenizer)
    stats = S.act_absmax(base, calib)
    factors, alphas = searched_factors(base, stats, product_inputs(base, calib, np.random.default_rng(0)), a.block)
    for group in ("qkv", "o", "gate_up", "down"):
        print(group, "alphas chosen:", dict(Counter(str(v) for (_, g), v in alphas.items() if g == group)))
    print(f"{len(ref)} positions, int8 weights and activations in blocks of {a.block}, float head")
    for label, f in (("unsmoothed", None), ("alpha 0.5", S.folded_smoothing(stats, base, 0.5)), ("searched", factors)):
        print(f"{label:12s} top-1 agreement with float32 {agreement(gguf, f, a.block, wins, ref):.2f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
