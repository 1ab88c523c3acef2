"""The Llama-family decoder step as a static ONNX graph.

One definition covers LlamaForCausalLM (SmolLM2, TinyLlama, Llama 2/3), MistralForCausalLM (sliding-window
attention as a mask), Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (per-head q/k RMSNorm) and
Phi3ForCausalLM (partial rotary): RMSNorm, RoPE read from tables by position, grouped-query attention over the
masked past plus the step's own tokens, SwiGLU MLP, tied or untied LM head.

Shape of the work, chosen for runtimes that want static shapes and plain ops (see shared/design.md §7):
* q, k, v come from one fused MatMul and gate/up from another: fewer, larger weight reads.
* GQA reshapes the queries to [B, H_kv, T*rep, D] instead of repeating K/V per query head.
* Every node counts on a CPU (a few microseconds each, ~30 layers): T=1 graphs use Reshape where a
  Transpose would only move a size-1 axis, and outputs are produced under their contract names directly.
* Position-consistent attention: every row attends over the cache slots in slot order and then its own
  token, so a T-token verify step computes each row bit for bit like one-token decode (the exactness of
  greedy speculation rests on it; see build_step_graph). A one-token step reads the past buffers as they
  are; a T > 1 step scatters its few scores and value rows into copies at their future slots.
* One additive float mask is built per step and shared by all layers; masks are made with Where on float
  constants, never by casting bool to float.
* The attention scale is folded into the query weights at export, and cos/sin come from tables in the
  weights file (no Sin/Cos ops at run time, same values for every step graph).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from . import contract as C
from .builder import GraphBuilder
from .manifest import WeightRef
from .quant import (Blocks, PackedInt4, QuantSpec, block_sums, quantize_blocks, quantize_offset_blocks, relative_error,
                    smoothing_factors)

FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # fused qkv_proj and gate_up_proj (split by the source), partial rotary
    "GemmaForCausalLM": "gemma",  # GeLU, RMSNorm by 1 + weight, embeddings times sqrt(hidden)
    "Gemma2ForCausalLM": "gemma2",  # and norms after attention and MLP, soft-capped scores and logits
    "Gemma3ForCausalLM": "gemma3",  # and q/k norms, a RoPE base of its own in the sliding layers
}
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
# freq_factors: a GGUF's rope_freqs
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope", "freq_factors")


# Node labels (GraphBuilder.op): the residual stream's adds and the RMSNorm statistics. SmolLM2's residual stream
# holds a few channels near 2.5e4 next to values near 1, which no single 16-bit scale can hold, so the
# qnn-qdq16 flavour leaves these nodes in float (fp16 on the HTP).
RESIDUAL, NORM = "residual", "norm"


class UnsupportedModel(ValueError):
    """The model is outside what this family definition can express."""


@dataclass(frozen=True)
class LlamaConfig:
    family: str  # llama | mistral | qwen2 | qwen3 | phi3 | gemma | gemma2 | gemma3
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    max_position_embeddings: int = 0
    sliding_window: int | None = None  # a query at position p sees keys at positions > p - sliding_window
    sliding_layers: tuple[int, ...] | None = None  # the layers that slide (None: all, with sliding_window set)
    partial_rotary_factor: float = 1.0  # RoPE turns the first rotary_dim dimensions of each head (Phi-4-mini: 0.75)
    # Gemma: the activation of the gated MLP, RMSNorm weights stored as (1 + w) by the export, the embedding's
    # scale, the query scale (query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5), norms after the attention
    # and MLP outputs too (Gemma 2/3), tanh soft caps of the attention scores and the logits, and the RoPE base
    # of the sliding layers (Gemma 3; the others use rope_theta and rope_scaling).
    activation: str = "silu"
    norm_offset: bool = False
    embed_scale: float | None = None
    query_scale: float | None = None
    sandwich_norms: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_local_theta: float | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # as transformers rounds it

    def slides(self, layer: int) -> bool:
        return self.sliding_window is not None and (self.sliding_layers is None or layer in self.sliding_layers)

    def dims(self, context: int, batch: int, dtype: str, num_layers: int | None = None) -> C.ModelDims:
        return C.ModelDims(
            num_layers=num_layers or self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, hidden_size=self.hidden_size, vocab_size=self.vocab_size,
            context=context, batch=batch, dtype=dtype,
        )

    def check(self, context: int) -> None:
        """Refuse what the graph cannot express exactly, with a message naming the reason."""
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 2 or self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise UnsupportedModel(f"head_dim {self.head_dim} with partial_rotary_factor {self.partial_rotary_factor}: "
                                   f"RoPE needs an even number of rotated dimensions, at most head_dim")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModel(f"sliding_window {self.sliding_window} must be at least 1")
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModel(f"activation {self.activation} is not supported ({', '.join(ACTIVATIONS)})")
        rope_inv_freq(self, context)  # raises on unsupported rope scaling
        scaling = dict(self.rope_scaling or {})
        stretch = scaling.get("factor", 1.0) if scaling.get("rope_type", scaling.get("type")) == "linear" else 1.0
        trained = int(self.max_position_embeddings * stretch)  # 0: the source does not say
        if trained and context > trained:
            # Positions past it were never trained: the output degrades while the KV buffers grow with --context.
            raise UnsupportedModel(f"--context {context} is longer than the {trained} positions the model was "
                                   f"trained for (max_position_embeddings); export with --context <= {trained}")


def rope_inv_freq(cfg: LlamaConfig, context: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rotary_dim/2] (float32, as transformers computes them) and the cos/sin scale."""
    d = cfg.rotary_dim
    inv = (1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))).astype(np.float32)
    scaling = dict(cfg.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if kind == "dynamic":
        # Dynamic NTK only changes the frequencies once the sequence outgrows the trained length; a static
        # context that never does is plain RoPE.
        limit = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
        if context > limit:
            raise UnsupportedModel(f"rope_scaling 'dynamic' changes with length beyond {limit} positions; export with --context <= {limit}")
        return inv, 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn(cfg, scaling, d)
    if kind == "longrope":
        return _longrope(cfg, scaling, d, context)
    if kind == "freq_factors":
        # llama.cpp's rope_freqs: each frequency divided by its factor (how its converter stores "llama3" scaling)
        factors = np.asarray(scaling["factors"], np.float32)
        if factors.shape != inv.shape or not np.all(np.isfinite(factors) & (factors > 0)):
            raise UnsupportedModel(f"rope_freqs has {factors.size} factors for a head_dim of {d} (expected {d // 2} "
                                   f"positive ones)")
        return (inv / factors).astype(np.float32), 1.0
    raise UnsupportedModel(f"rope_scaling type '{kind}' is not supported (supported: {', '.join(ROPE_TYPES)})")


def _yarn(cfg: LlamaConfig, scaling: dict, d: int) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), static as transformers applies it:
    frequencies that turn fewer than beta_slow times over the original context are interpolated (divided by
    the factor), those that turn more than beta_fast times are kept, with a linear ramp between; cos and sin are
    scaled by the attention factor 0.1 ln(s) + 1 (eq. 21). Float32 as transformers computes it."""
    factor = scaling.get("factor") or cfg.max_position_embeddings / scaling["original_max_position_embeddings"]
    old = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times over `old`
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    kept = (1 - ramp).astype(np.float32)  # 1: the frequency as trained, 0: interpolated
    powers = np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    inv = (1 / (np.float32(factor) * powers)) * (1 - kept) + (1 / powers) * kept
    return inv.astype(np.float32), float(attention)


def _longrope(cfg: LlamaConfig, scaling: dict, d: int, context: int) -> tuple[np.ndarray, float]:
    """LongRoPE (Phi-3's 128k models) as transformers applies it: per-frequency factors, the short ones while the
    sequence stays within original_max_position_embeddings, the long ones past it for the whole sequence (keys
    already cached keep their old rotation). A static graph can only be the first: --context <= original. The
    cos/sin scale is sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings / original."""
    original = scaling.get("original_max_position_embeddings")
    if not original:
        raise UnsupportedModel("rope_scaling 'longrope' without original_max_position_embeddings")
    if context > original:
        raise UnsupportedModel(f"rope_scaling 'longrope' switches to its long factors past {original} positions; "
                               f"export with --context <= {original}")
    short = np.asarray(scaling["short_factor"], np.float32)
    if short.shape != (d // 2,):
        raise UnsupportedModel(f"longrope has {short.size} short factors for {d} rotated dimensions")
    factor = scaling.get("factor") or cfg.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    powers = np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d))
    return (1.0 / (short * powers)).astype(np.float32), float(attention)


def rope_tables(cfg: LlamaConfig, context: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin tables [context, D], one row per position.

    rotate_half(x) = concat(-x2, x1), so x*cos + rotate_half(x)*sin = x*cos + swap_halves(x)*[-sin, sin]: the
    sign lives in the table, and the step graph's rotation matrix holds these signed values off its diagonal.
    Angles are float32 products like transformers', cos/sin are rounded from float64.
    """
    inv, scale = rope_inv_freq(cfg, context)
    angles = np.arange(context, dtype=np.float32)[:, None] * inv[None, :]  # float32 products, as in torch
    angles = np.concatenate([angles, angles], axis=1).astype(np.float64)
    half = cfg.rotary_dim // 2
    sign = np.concatenate([-np.ones(half), np.ones(half)])
    cos = (np.cos(angles) * scale).astype(np.float32)
    sin = (np.sin(angles) * scale * sign).astype(np.float32)
    passed = cfg.head_dim - cfg.rotary_dim  # partial rotary: the last dimensions pass unturned (cos 1, sin 0)
    if passed:
        cos = np.concatenate([cos, np.ones((context, passed), np.float32)], axis=1)
        sin = np.concatenate([sin, np.zeros((context, passed), np.float32)], axis=1)
    return cos, sin


# -- weights ------------------------------------------------------------------------------------------
MATRICES = ("qkv", "o", "gate_up", "down")  # the per-layer MatMul weights, stored [in, out]
# The float head runs as HEAD_PARTS Gemms over row ranges of its [V, hidden] table, which the weights index
# names as aliases of those bytes (head_parts). Why: onnxruntime prepacks a Gemm weight in every new session
# before it finds the same packed bytes in the shared container, so creating a session briefly holds one
# more packed copy of its largest weight. Whole, SmolLM2's tied head is 113 MB, and that transient was the
# peak RSS of a float32 run; in 4 parts it is 28 MB.
HEAD_PARTS = 4


def head_parts(cfg: LlamaConfig, refs: dict[str, WeightRef]) -> dict[str, WeightRef]:
    """The weights index entries of the float head's parts: aliases of row ranges of the [V, hidden] table
    ("embed" when tied, else "lm_head"), no bytes of their own. Ranges start at multiples of 64 rows."""
    table = refs["embed" if cfg.tie_word_embeddings else "lm_head"]
    rows, row_bytes = table.shape[0], table.length // table.shape[0]
    bounds = sorted({min(rows, -(-rows * i // HEAD_PARTS // 64) * 64) for i in range(HEAD_PARTS + 1)})
    return {f"{table.name}.rows{a}": WeightRef(f"{table.name}.rows{a}", table.dtype, (b - a,) + tuple(table.shape[1:]),
                                               table.offset + a * row_bytes, (b - a) * row_bytes)
            for a, b in zip(bounds, bounds[1:])}


def weight_names(cfg: LlamaConfig, quant: QuantSpec | None = None, matmul_head: bool = False) -> list[str]:
    """Every tensor of the weights file, in the order graph_weights yields them."""
    def matrix(name):
        return [name] if quant is None else [name + ".q", name + ".scale"]

    names = ["rope.cos", "rope.sin"] + (["rope_local.cos", "rope_local.sin"] if cfg.rope_local_theta else [])
    names += matrix("embed")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names.append(p + "attn_norm")
        names += matrix(p + "qkv")
        if cfg.attention_bias:
            names.append(p + "qkv_bias")
        if cfg.qk_norm:
            names.append(p + "qk_norm")
        names += matrix(p + "o") + ([p + "attn_out_norm"] if cfg.sandwich_norms else []) + [p + "mlp_norm"]
        names += matrix(p + "gate_up") + matrix(p + "down") + ([p + "mlp_out_norm"] if cfg.sandwich_norms else [])
    names.append("norm")
    if quant is not None or not cfg.tie_word_embeddings or matmul_head:
        names += matrix("lm_head")  # quantized bundles always store the head as a MatMul weight of its own
    return names


@dataclass
class QuantReport:
    """What quantizing a model did to each weight: copied block for block, or requantized with an error."""

    native: list[str] = field(default_factory=list)
    requantized: dict[str, float] = field(default_factory=dict)  # name -> ||W - deq(q)|| / ||W||
    smoothed: list[str] = field(default_factory=list)  # products stored with input factors (graphs/quant.py)

    def to_json(self) -> dict:
        errs = list(self.requantized.values())
        return {"native": len(self.native), "requantized": len(errs), "smoothed": len(self.smoothed),
                "relative_error_mean": round(float(np.mean(errs)), 6) if errs else 0.0,
                "relative_error_max": round(float(np.max(errs)), 6) if errs else 0.0,
                "worst": max(self.requantized, key=self.requantized.get) if errs else None}


def copies_as_stored(b: Blocks | None, quant: QuantSpec, bits: int, offsets: bool) -> bool:
    """Whether a source tensor's blocks (GGUF Q4_0/Q5_0/Q8_0, Q4_1/Q5_1/Q4_K/Q5_K with `offsets`) are a bundle
    weight of `bits` as they are. A source's int4 (or 5-bit) blocks fit int8 exactly (same ints, same scales), and
    a block fits the smaller blocks that divide it (its scale repeated): neither loses anything."""
    return b is not None and b.bits <= bits and b.block % quant.block == 0 and (offsets or b.offset is None)


def product_scheme(quant: QuantSpec, name: str) -> tuple[bool, bool]:
    """(offsets, rows) for weight `name` (graphs/quant.py): the offset scheme's offsets are the layer weights'
    only, and the rows scheme's one scale per output column is every product's but the embedding's."""
    return quant.offsets and name not in ("embed", "lm_head"), quant.rows and name != "embed"


def source_blocks(quant: QuantSpec, native: Callable[[str], Blocks | None] | None, name: str,
                  parts: list[tuple[str, np.float32]], bits: int) -> list[Blocks] | None:
    """The source's own blocks of each part of product `name` when the bundle stores them as they are (every
    part's blocks fit; never for the rows scheme, whose single scale per column no source stores), else None."""
    offsets, rows = product_scheme(quant, name)
    if native is None or rows:
        return None
    found = [native(n) for n, _ in parts]
    return found if all(copies_as_stored(b, quant, bits, offsets) for b in found) else None


def layer_products(cfg: LlamaConfig, i: int, q_factor: np.float32 = np.float32(1)
                   ) -> dict[str, list[tuple[str, np.float32]]]:
    """Layer i's weight products, bundle name -> its parts (transformers name, factor), stacked along the output:
    q/k/v and gate/up fused. `q_factor` multiplies the queries (the 1/sqrt(D) graph_weights folds into them)."""
    p, a, m, one = f"layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", np.float32(1)
    return {p + "qkv": [(a + "q_proj.weight", q_factor), (a + "k_proj.weight", one), (a + "v_proj.weight", one)],
            p + "o": [(a + "o_proj.weight", one)],
            p + "gate_up": [(m + "gate_proj.weight", one), (m + "up_proj.weight", one)],
            p + "down": [(m + "down_proj.weight", one)]}


def head_weight(cfg: LlamaConfig) -> str:
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


def keeps_source_blocks(quant: QuantSpec, native: Callable[[str], Blocks | None] | None, name: str,
                        parts: list[tuple[str, np.float32]], bits: int) -> bool:
    """Whether a smoothed bundle keeps product `name` as the source stores it, unsmoothed: for 4-bit weights only.
    Requantizing a smoothed int4 product costs its weights ~8% relative error (SmolLM2's Q4_1 -> int4: 70% top-1
    agreement with float32 where the copied blocks give 96%), while int8's own rounding is ~0.5% and smoothing
    wins there: SmolLM2's Q8_0 head kept as stored gave 96.71% in an int8 bundle, smoothed and requantized 97.21%
    (benchmarks/quality/README.md)."""
    return bits == 4 and source_blocks(quant, native, name, parts, bits) is not None


def keeps_every_product(cfg: LlamaConfig, quant: QuantSpec, native: Callable[[str], Blocks | None] | None) -> bool:
    """Whether a smoothed bundle would keep every weight product (each layer's and the head) as the source
    stores it (e.g. int4 with an int4 head from a GGUF all in Q4_0): then nothing would be smoothed."""
    products = [(name, parts, quant.bits) for i in range(cfg.num_layers) for name, parts in
                layer_products(cfg, i).items()] + [("lm_head", [(head_weight(cfg), np.float32(1))], quant.head_bits)]
    return all(keeps_source_blocks(quant, native, *product) for product in products)


def _abs_max_rows(w: np.ndarray, rows: int = 4096) -> np.ndarray:
    """max |w[:, k]| over the rows of w [out, in], `rows` at a time (an |w| copy of a tied head is 113 MB)."""
    return np.max([np.abs(w[r:r + rows]).max(axis=0) for r in range(0, w.shape[0], rows)], axis=0)


def graph_weights(cfg: LlamaConfig, context: int, dtype: str, hf: Callable[[str], np.ndarray],
                  quant: QuantSpec | None = None, native: Callable[[str], Blocks | None] | None = None,
                  report: QuantReport | None = None, matmul_head: bool = False,
                  act_ranges: dict[str, np.ndarray] | None = None, alpha: float | None = None,
                  keep_native: bool = False) -> Iterator[tuple[str, np.ndarray | PackedInt4]]:
    """Yield the graph's tensors, one at a time, from HF-named float32 tensors.

    `hf(name)` returns a tensor by its transformers name (e.g. "model.layers.0.self_attn.q_proj.weight").
    MatMul weights are stored [in, out] (x @ W), q/k/v and gate/up fused; the float head keeps [V, hidden] so
    a tied head and the embedding are one tensor (Gemm with transB reads it).

    With `quant`, every MatMul weight W becomes W.q (int8 or int4 [in, out]) and W.scale (float32 blocks along
    `in`), the embedding becomes embed.q (int8 [V, hidden]) and embed.scale (blocks along hidden), and the head
    is a MatMul weight "lm_head" [hidden, V] of its own (see graphs/quant.py). `native(name)` may return a
    source tensor that already is such blocks (GGUF Q4_0, Q8_0...: copies_as_stored), used as it is when its bits
    and block match; everything else is requantized from float, and `report` records which and the error introduced.

    `act_ranges` (export/smooth.py: each product's largest input per channel, by weight name) smooths the
    products with SmoothQuant's `alpha` (default quant.smooth), folded into the norms and projections that
    make their inputs (graphs/quant.py); the float model's function is unchanged. The head is smoothed when it
    is a MatMul weight of its own (quantized, or `matmul_head`). With `keep_native`, a 4-bit product whose
    source blocks the bundle can store as they are gets no input factors (they would mean requantizing it:
    keeps_source_blocks): it stays the source's own, only its output columns may be divided (its scales, the
    ints unchanged).
    """
    np_dtype = np.dtype(dtype)
    scale = np.float32(cfg.query_scale if cfg.query_scale is not None else 1.0 / math.sqrt(cfg.head_dim))
    report = report if report is not None else QuantReport()

    def norm(name: str) -> np.ndarray:  # Gemma's RMSNorm scales by 1 + weight (in float32, as transformers)
        w = hf(name)
        return w + np.float32(1) if cfg.norm_offset else w

    alpha = (quant.smooth if quant is not None else 0.0) if alpha is None else alpha
    smoothing = act_ranges is not None and alpha > 0
    into, out_of = {}, {}  # weight name -> factors its input rows are multiplied by / output columns divided by

    # A weight is read as float32 [out, in]; the largest (a tied head: V x hidden) is copied as few times as the
    # products allow: the export's peak memory is a few copies of it.
    def in_range(parts: list[tuple[str, np.float32]]) -> np.ndarray:  # [in]: largest |W[k, :]| over the parts
        # |f| * max|w| is max|f * w| to the bit: rounding a product by a positive scale keeps the order
        return np.max([_abs_max_rows(hf(n)) * abs(f) for n, f in parts], axis=0)

    def smoothed(name: str, parts: list[tuple[str, np.float32]]) -> np.ndarray:
        """W = concat(factor * hf(part)).T [in, out], C order, its rows times its input factors and its columns
        divided by its output factors."""
        mats = [hf(n) if f == 1 else hf(n) * f for n, f in parts]
        w = mats[0] if len(mats) == 1 else np.concatenate(mats, axis=0)
        del mats
        w = np.array(w.T, dtype=np.float32, order="C")  # a copy of its own: scaled in place below
        if name in into:
            w *= into[name][:, None]
        if name in out_of:
            w /= out_of[name][None, :]
        return w

    def smooths(name: str, parts: list[tuple[str, np.float32]], bits: int | None = None) -> bool:
        """Whether product `name` gets input factors (and if so, `report` records it)."""
        if not smoothing:
            return False
        if keep_native and quant is not None and keeps_source_blocks(quant, native, name, parts, bits or quant.bits):
            return False
        report.smoothed.append(name)
        return True

    def blocks(name: str, parts: list[tuple[str, np.float32]], bits: int) -> Blocks:
        """W = concat(factor * hf(part)).T [in, out] as quantized blocks, natively when the source has them."""
        offsets, rows = product_scheme(quant, name)
        found = None if name in into else source_blocks(quant, native, name, parts, bits)
        if found is not None:
            found = [b.split(quant.block) for b in found]
            for b in found:
                b.bits = bits
            for b, (_, factor) in zip(found, parts):
                if factor != 1:  # the ints stay as the source stored them
                    b.scale = (b.scale * factor).astype(np.float32)
                    b.offset = None if b.offset is None else (b.offset * factor).astype(np.float32)
            report.native.append(name)
            out = Blocks.concat(found)
            if name in out_of:  # W[:, j] / g_j is q[:, j] * (scale[:, j] / g_j): the ints stay the source's
                out.scale = (out.scale / out_of[name][None, :]).astype(np.float32)
                out.offset = None if out.offset is None else (out.offset / out_of[name][None, :]).astype(np.float32)
            if offsets and out.offset is None:
                out.offset = np.zeros_like(out.scale)
            return out
        w = smoothed(name, parts)
        if offsets:
            q, scale, offset = quantize_offset_blocks(w, bits, quant.block)
            out = Blocks(q, scale, bits, quant.block, offset)
        elif rows:
            out = Blocks(*quantize_blocks(w, bits, w.shape[0]), bits, w.shape[0])
        else:  # the head keeps plain round-to-nearest: a least-squares scale clips its outliers (quantize_blocks)
            out = Blocks(*quantize_blocks(w, bits, quant.block, search=name != "lm_head"), bits, quant.block)
        report.requantized[name] = relative_error(w, out)
        return out

    def stored(name: str, b: Blocks, transpose: bool = False):
        q, s = (b.q.T, b.scale.T) if transpose else (b.q, b.scale)
        q, s = np.ascontiguousarray(q), np.ascontiguousarray(s)
        yield name + ".q", PackedInt4.from_values(q) if b.bits == 4 else q
        yield name + ".scale", s
        if b.offset is not None:
            yield name + ".offset", np.ascontiguousarray(b.offset)

    def matrix(name: str, parts: list[tuple[str, np.float32]], bits: int | None = None):
        if quant is None:
            yield name, smoothed(name, parts).astype(np_dtype, copy=False)
        else:
            yield from stored(name, blocks(name, parts, bits or quant.bits))

    one = np.float32(1)
    cos, sin = rope_tables(cfg, context)
    yield "rope.cos", cos.astype(np_dtype)
    yield "rope.sin", sin.astype(np_dtype)
    if cfg.rope_local_theta:
        cos, sin = rope_tables(replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None), context)
        yield "rope_local.cos", cos.astype(np_dtype)
        yield "rope_local.sin", sin.astype(np_dtype)
    embed = "model.embed_tokens.weight"
    if quant is None:
        yield "embed", hf(embed).astype(np_dtype, copy=False)
    else:  # [V, hidden] rows for Gather: the head's layout transposed, blocks along hidden
        yield from stored("embed", blocks("embed", [(embed, one)], 8), transpose=True)
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for i in range(cfg.num_layers):
        p, a = f"layers.{i}.", f"model.layers.{i}.self_attn."
        # fold 1/sqrt(D) into the queries (RMSNorm would undo it in Qwen3: folded into its q_norm there)
        q_factor = one if cfg.qk_norm else scale
        products = layer_products(cfg, i, q_factor)
        qkv, o, gate_up, down = (products[p + n] for n in ("qkv", "o", "gate_up", "down"))
        # every factor of the layer first: the norms and q/k/v come before the products they feed
        if smooths(p + "qkv", qkv):
            into[p + "qkv"] = smoothing_factors(act_ranges[p + "qkv"], in_range(qkv), alpha)
        if smooths(p + "gate_up", gate_up):
            into[p + "gate_up"] = smoothing_factors(act_ranges[p + "gate_up"], in_range(gate_up), alpha)
        if smooths(p + "down", down):
            into[p + "down"] = smoothing_factors(act_ranges[p + "down"], in_range(down), alpha)
            out_of[p + "gate_up"] = np.concatenate([np.ones(cfg.intermediate_size, np.float32), into[p + "down"]])
        if smooths(p + "o", o):
            # o's input channel h*D + d is value channel (h // rep)*D + d: one factor per kv head's channel
            grouped = [r.reshape(Hkv, H // Hkv, D).max(axis=1) for r in (act_ranges[p + "o"], in_range(o))]
            per_kv = smoothing_factors(*grouped, alpha)  # [Hkv, D]
            into[p + "o"] = np.repeat(per_kv[:, None, :], H // Hkv, axis=1).reshape(H * D)
            out_of[p + "qkv"] = np.concatenate([np.ones((H + Hkv) * D, np.float32), per_kv.reshape(-1)])
        attn_norm = norm(f"model.layers.{i}.input_layernorm.weight")
        yield p + "attn_norm", (attn_norm / into[p + "qkv"] if p + "qkv" in into else attn_norm).astype(np_dtype)
        yield from matrix(p + "qkv", qkv)
        if cfg.attention_bias:
            qb = hf(a + "q_proj.bias") * q_factor
            bias = np.concatenate([qb, hf(a + "k_proj.bias"), hf(a + "v_proj.bias")])
            yield p + "qkv_bias", (bias / out_of[p + "qkv"] if p + "qkv" in out_of else bias).astype(np_dtype)
        if cfg.qk_norm:
            qn = norm(a + "q_norm.weight") * scale
            kn = norm(a + "k_norm.weight")
            rows = [qn] * cfg.num_heads + [kn] * cfg.num_kv_heads
            yield p + "qk_norm", np.stack(rows).astype(np_dtype)  # [H + H_kv, D]
        yield from matrix(p + "o", o)
        layer = f"model.layers.{i}."
        if cfg.sandwich_norms:  # Gemma 2/3: post_attention_layernorm normalizes the attention's output
            yield p + "attn_out_norm", norm(layer + "post_attention_layernorm.weight").astype(np_dtype)
            mlp_norm = norm(layer + "pre_feedforward_layernorm.weight")
        else:
            mlp_norm = norm(layer + "post_attention_layernorm.weight")
        yield p + "mlp_norm", (mlp_norm / into[p + "gate_up"] if p + "gate_up" in into else mlp_norm).astype(np_dtype)
        yield from matrix(p + "gate_up", gate_up)
        yield from matrix(p + "down", down)
        if cfg.sandwich_norms:
            yield p + "mlp_out_norm", norm(layer + "post_feedforward_layernorm.weight").astype(np_dtype)
    head = head_weight(cfg)
    final_norm = norm("model.norm.weight")
    # the head is smoothed as a MatMul weight of its own only: a float Gemm head reads the embedding table itself
    if (quant is not None or matmul_head) and smooths("lm_head", [(head, one)], quant and quant.head_bits):
        into["lm_head"] = smoothing_factors(act_ranges["lm_head"], in_range([(head, one)]), alpha)
        final_norm = final_norm / into["lm_head"]
    yield "norm", final_norm.astype(np_dtype)
    if quant is not None:
        yield from matrix("lm_head", [(head, one)], quant.head_bits)
    elif matmul_head:  # a MatMul weight [hidden, V] of its own, tied or not (see build_step_graph)
        yield from matrix("lm_head", [(head, one)])
    elif not cfg.tie_word_embeddings:
        yield "lm_head", hf(head).astype(np_dtype)


# -- the step graph -----------------------------------------------------------------------------------
def _rms_norm(g: GraphBuilder, x: str, weight: str, eps: float, dtype: str, scaled: bool = False,
              shape: tuple[int, ...] | None = None) -> str:
    """`shape`: x's shape (static), which the scaled norm needs."""
    if scaled:
        return _scaled_rms_norm(g, x, weight, eps, dtype, shape)
    # Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul: the pattern ORT fuses into one SimplifiedLayerNorm. The
    # statistics are labelled NORM (the qnn-qdq16 flavour keeps them in float, see export/qdq.py).
    square = g.op("Pow", x, g.const(2.0, dtype), label=NORM)
    if g.opset >= 18:  # axes became an input at opset 18
        var = g.op("ReduceMean", square, g.ints(-1), keepdims=1, label=NORM)
    else:
        var = g.op("ReduceMean", square, axes=[-1], keepdims=1, label=NORM)
    rms = g.op("Sqrt", g.op("Add", var, g.const(eps, dtype), label=NORM), label=NORM)
    return g.op("Mul", g.op("Div", x, rms, label=NORM), weight)


def _softcap(g: GraphBuilder, x: str, cap: float, dtype: str, name: str | None = None) -> str:
    """cap * tanh(x / cap), as transformers computes Gemma 2's soft caps."""
    c = g.const(cap, dtype)
    return g.op("Mul", g.op("Tanh", g.op("Div", x, c)), c, name=name)


def _activation(g: GraphBuilder, x: str, kind: str, dtype: str) -> str:
    """The gated MLP's activation: SiLU (x * sigmoid(x)), GeLU's tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x +
    0.044715 x^3))) or exact GeLU 0.5 x (1 + erf(x / sqrt(2))), in opset 17's ops."""
    if kind == "silu":
        return g.op("Mul", x, g.op("Sigmoid", x))
    if kind == "gelu_tanh":
        cube = g.op("Mul", g.op("Mul", x, x), x)
        inner = g.op("Mul", g.op("Add", x, g.op("Mul", cube, g.const(0.044715, dtype))),
                     g.const(math.sqrt(2 / math.pi), dtype))
        gate = g.op("Add", g.op("Tanh", inner), g.const(1.0, dtype))
    else:
        gate = g.op("Add", g.op("Erf", g.op("Div", x, g.const(math.sqrt(2.0), dtype))), g.const(1.0, dtype))
    return g.op("Mul", g.op("Mul", x, g.const(0.5, dtype)), gate)


def _scaled_rms_norm(g: GraphBuilder, x: str, weight: str, eps: float, dtype: str, shape: tuple[int, ...]) -> str:
    """RMSNorm that never squares a large number: x / (m * sqrt(mean((x/m)^2) + eps/m/m)) with m = max|x| per row,
    the same value in exact arithmetic. For fp16 compute (Qualcomm's HTP): real residual streams reach |x| ~ 2.5e4
    (SmolLM2), whose square overflows fp16 (max 65504) and turns the plain norm's output into zeros.
    Every division is by sqrt(m) or by sqrt(m) * rms, never by m: the HTP divides by multiplying with the
    reciprocal, and 1/m for m above 16384 is an fp16 subnormal, which it flushes to zero (SmolLM2's rows with the
    massive activation came out as zeros); 1/sqrt(m) is a normal fp16 number for any finite m.
    m is expanded to x's whole `shape` before anything divides by it: the emulated HTP computes the reciprocal
    of a per-row statistic ([rows, 1]) differently for a row of a T-token step than for a one-token step (1e-3
    to 1.6e-2 apart on a 576-wide row, rows 1..8 of 9), and element by element over a full-width tensor the
    same way at every T (bit for bit at T = 2..64), which exact speculation on the HTP needs."""
    if g.opset >= 18:
        peak = g.op("ReduceMax", g.op("Abs", x, label=NORM), g.ints(-1), keepdims=1, label=NORM)
    else:
        peak = g.op("ReduceMax", g.op("Abs", x, label=NORM), axes=[-1], keepdims=1, label=NORM)
    peak = g.op("Add", peak, g.const(1e-3, dtype), label=NORM)  # a row of zeros stays zeros, not NaN
    peak = g.op("Expand", peak, g.ints(*shape), label=NORM)
    root = g.op("Sqrt", peak, label=NORM)
    half = g.op("Div", x, root, label=NORM)  # x / sqrt(m), |.| <= sqrt(m)
    y = g.op("Div", half, root, label=NORM)  # x / m, in [-1, 1]
    if g.opset >= 18:
        var = g.op("ReduceMean", g.op("Mul", y, y, label=NORM), g.ints(-1), keepdims=1, label=NORM)  # in [1/D, 1]
    else:
        var = g.op("ReduceMean", g.op("Mul", y, y, label=NORM), axes=[-1], keepdims=1, label=NORM)
    # eps/m^2 as (eps/m)/m: m^2 overflows fp16 for m > 255, and the HTP's eps/inf is not 0 (a one-token step of
    # SmolLM2 got a norm 20x off from it).
    tiny = g.op("Div", g.op("Div", g.const(eps, dtype), peak, label=NORM), peak, label=NORM)
    rms = g.op("Sqrt", g.op("Add", var, tiny, label=NORM), label=NORM)
    return g.op("Mul", g.op("Div", half, g.op("Mul", root, rms, label=NORM), label=NORM), weight)


def build_step_graph(cfg: LlamaConfig, dims: C.ModelDims, tokens: int, role: str, g: GraphBuilder,
                     step_mask: bool = False, context: int | None = None, quant: QuantSpec | None = None,
                     scaled_norm: bool = False, mask_value: float | None = None, same_ops: bool = False,
                     matmul_head: bool = False, taps: dict[str, str] | None = None) -> str:
    """Fill `g` with the step graph for T = `tokens` over a past of `context` slots (a bucket <= dims.context;
    role: contract.PREFILL or contract.STEP). `quant` picks the weight-only quantized flavour: the same graph,
    with each weight product reading DequantizeLinear(W.q, W.scale) and the embedding dequantized per row.
    `scaled_norm` (the qnn-fp16 flavour) computes every RMSNorm without overflowing fp16 (_scaled_rms_norm).
    `mask_value`: the additive mask's value for hidden slots (default: the dtype's most negative number); a
    quantized flavour needs one near the scores' own range, as the masked scores share their scale.
    `same_ops`: build a one-token step with the T > 1 ops too (scatter at slot cache_len), so every step graph of
    a model has the same nodes under the same names; the QDQ flavour gives each tensor one scale across them, and
    a verify row then computes exactly like a decode step (what exact greedy speculation needs). The QNN fp16
    flavour uses it too: on the HTP a one-token step built with other ops (heads-first layout, no scatter)
    rounded differently (SmolLM2: a 5-token step's logits up to 0.1 away from one-token steps'; equal with it).
    `matmul_head`: the LM head is a MatMul weight `lm_head` [hidden, V] of its own even when tied (the QDQ
    flavour: the HTP places a per-channel quantized MatMul, not a Gemm over the transposed embedding table
    whose dequantized copy the embedding's Gather also reads).
    `taps`: filled with weight name -> a value holding the largest |input| per input channel of that weight's
    product over the step's rows (export/smooth.py calibrates with it; the caller makes them graph outputs).
    Returns the value of the residual stream after the last layer, [B*T, E] (export/smooth.py carries it from
    one layer's graph to the next)."""
    B, T, S = dims.batch, tokens, context or dims.context
    H, Hkv, D, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    rep = H // Hkv
    dt = dims.dtype
    multi = T > 1 or same_ops  # the T > 1 ops
    neg = float(np.finfo(np.dtype(dt)).min) if mask_value is None else float(mask_value)  # finite: garbage + neg stays hugely negative

    specs = {s.name: s for s in C.step_inputs(dims, T, step_mask, S)}
    input_ids, position_ids, cache_len = (g.input(specs[n]) for n in (C.INPUT_IDS, C.POSITION_IDS, C.CACHE_LEN))
    pasts = [(g.input(specs[C.past_key(i)]), g.input(specs[C.past_value(i)])) for i in range(dims.num_layers)]
    out_specs = {s.name: s for s in C.step_outputs(dims, T, role)}

    # Attention rows: query head h = kv*rep + r of step token t reads kv head kv (transformers' repeat_kv
    # order) and sits at row t*rep + r of a [B, H_kv, T*rep, D] block, so each kv head is one plain MatMul.
    # For T = 1 every layout change below is a Reshape, never a Transpose.
    def to_rows(q):  # [B, T, H, D] (or [B, H, 1, D]: the same order) -> [B, Hkv, T*rep, D]
        if multi:
            q = g.op("Transpose", g.op("Reshape", q, g.ints(B, T, Hkv, rep, D)), perm=[0, 2, 1, 3, 4])
        return g.op("Reshape", q, g.ints(B, Hkv, T * rep, D))

    def from_rows(x):  # [B, Hkv, T*rep, D] -> [B*T, H*D]
        if multi:
            x = g.op("Transpose", g.op("Reshape", x, g.ints(B, Hkv, T, rep, D)), perm=[0, 2, 1, 3, 4])
        return g.op("Reshape", x, g.ints(B * T, H * D))

    sums = {}  # K -> the block-sum matrix S; input x -> x @ S (the offsets' low-rank term, once per input)
    if quant is not None and quant.rows:
        inv127, tiny = g.const(np.float32(1 / 127), "float32"), g.const(np.finfo(np.float32).tiny, "float32")
        u128 = g.const(np.uint8(128))

    # [*rows, in=k] @ [in, out]; MatMul beat Gemm in place, at 1 and 9 rows
    def linear(x, weight, name=None, k=None, rows=(B * T,)):
        if taps is not None:
            taps[weight] = g.op("ReduceMax", g.op("Abs", x), g.ints(*range(len(rows))), keepdims=0)
        if quant is None:
            return g.op("MatMul", x, g.weight(weight), name=name)
        if quant.rows:  # integer product of x quantized per row (graphs/quant.py); a zero row gets scale FLT_MIN
            scale = g.op("Max", g.op("Mul", g.op("ReduceMax", g.op("Abs", x), g.ints(-1), keepdims=1), inv127), tiny)
            width = g.weights[weight + ".q"].shape[0]  # a block of one row's whole width
            zero = g.const(np.full((*rows, 1), 128, np.uint8))  # the scale's shape, as blocked QuantizeLinear wants
            xq = g.op("QuantizeLinear", x, scale, zero, axis=-1, block_size=width)  # uint8 round(x / s) + 128
            acc = g.op("MatMulInteger", xq, g.weight(weight + ".q"), u128)
            return g.op("Mul", g.op("Mul", g.op("Cast", acc, to=1), g.weight(weight + ".scale")), scale, name=name)
        # Standard-domain weight-only quantization; onnxruntime fuses the pair into MatMulNBits.
        w = g.op("DequantizeLinear", g.weight(weight + ".q"), g.weight(weight + ".scale"), axis=0,
                 block_size=quant.block)
        if not (quant.offsets and k):
            return g.op("MatMul", x, w, name=name)
        if k not in sums:
            sums[k] = g.const(block_sums(k, quant.block))
        if x not in sums:  # [B*T, K/block]: each block of the input summed (graphs/quant.py)
            sums[x] = g.op("MatMul", x, sums[k])
        # One Gemm adds the offsets' product to the main one (C): a node fewer than MatMul + Add, at every T.
        return g.op("Gemm", sums[x], g.weight(weight + ".offset"), g.op("MatMul", x, w), name=name)

    def embedding(ids):  # [B, T] -> [B*T, E]
        if quant is None:
            return g.op("Reshape", g.op("Gather", g.weight("embed"), ids, axis=0), g.ints(B * T, E))
        rows = g.op("Gather", g.weight("embed.q"), ids, axis=0)  # int8 [B, T, E]
        scales = g.op("Gather", g.weight("embed.scale"), ids, axis=0)  # [B, T, E/block]
        # The Reshape is the dequantized rows' only reader: onnxruntime gives every reader of a DequantizeLinear
        # a copy of it, and two copies feeding the first RMSNorm would keep it from fusing into one kernel.
        x = g.op("DequantizeLinear", rows, scales, axis=2, block_size=quant.block)
        return g.op("Reshape", x, g.ints(B * T, E))

    def per_head(x, name):  # [B, T, Hkv, D] -> [B, Hkv, T, D], the contract's new K/V layout
        if multi:
            return g.op("Transpose", x, perm=[0, 2, 1, 3], name=name)
        return g.op("Reshape", x, g.ints(B, Hkv, T, D), name=name)

    # Attention is position-consistent: the query at cache slot p reduces over the same vector, in the same
    # order, whether it runs in a one-token decode step or as row i of a T-token verify step (p = cache_len
    # + i). Each row attends over S+1 columns: the S cache slots in slot order, then itself. A T > 1 step puts
    # its own tokens' scores and values at their future slots cache_len + j (ScatterElements), so row i sees
    # tokens 0..i-1 of the step exactly where a later decode step finds them in the cache, and its own token
    # in the last column, where a decode step has it. Summing the same terms in another order (past, then
    # step) changes the last bits, and int8 activations turn that into different greedy tokens. Needs
    # cache_len + T <= S. One additive mask per step, [B, 1, T*rep, S+1], shared by every layer.
    zero, minus = g.const(0.0, dt), g.const(neg, dt)
    slots = g.const(np.arange(S, dtype=np.int64).reshape(1, 1, S))
    length = g.op("Reshape", cache_len, g.ints(B, 1, 1))
    # A chain built with same_ops takes the tree graphs' route with a constant causal step mask: the same nodes
    # under the same names as a tree graph of its T, so the QDQ flavour's one range per tensor name holds for
    # tree rows too (a tree row then computes exactly like a decode step on the HTP).
    scattered = step_mask or same_ops
    if not multi or scattered:
        slot_ok = g.op("Less", slots, length)  # [B, 1, S]: the past only
    else:  # row i also sees the step's tokens 0..i-1 at slots cache_len .. cache_len+i-1
        slot_ok = g.op("Less", slots, g.op("Add", length, g.const(np.arange(T, dtype=np.int64).reshape(1, T, 1))))
    slot_mask = g.op("Expand", g.op("Where", slot_ok, zero, minus), g.ints(B, T, S))  # [B, T, S]
    if scattered:  # row i sees step token j != i iff step_mask[i, j], at slot cache_len + j
        visible = g.input(specs[C.STEP_MASK]) if step_mask else g.const(np.tril(np.ones((B, T, T), dtype=bool)))
        seen = g.op("And", visible, g.const(~np.eye(T, dtype=bool)))
        at_slots = g.op("Expand", g.op("Add", length, g.const(np.arange(T, dtype=np.int64).reshape(1, 1, T))),
                        g.ints(B, T, T))
        slot_mask = g.op("ScatterElements", slot_mask, at_slots, g.op("Where", seen, zero, minus), axis=2)

    def attention_mask(slot_mask):  # [B, T, S] -> [B, 1, T*rep, S+1]: the own column always visible
        mask = g.op("Concat", slot_mask, g.const(np.zeros((B, T, 1), dtype=dt)), axis=-1)  # [B, T, S+1]
        if rep > 1:
            mask = g.op("Expand", g.op("Unsqueeze", mask, g.ints(2)), g.ints(B, T, rep, S + 1))
        return g.op("Reshape", mask, g.ints(B, 1, T * rep, S + 1))

    masks = {False: attention_mask(slot_mask)}  # slides -> mask
    # Sliding-window layers (Mistral, Qwen2/3 with use_sliding_window): a query at position p also hides the slots
    # at p - window and before, and a tree's step tokens an ancestor that far up (positions are depths there).
    # Positions below the bucket never reach back a whole window when window >= S: those buckets need nothing.
    window = cfg.sliding_window if cfg.sliding_window is not None and cfg.sliding_window < S else None
    if window is not None and any(cfg.slides(i) for i in range(dims.num_layers)):
        positions = g.op("Unsqueeze", position_ids, g.ints(2))  # [B, T, 1]
        far = g.op("Not", g.op("Greater", slots, g.op("Sub", positions, g.const(np.int64(window)))))  # [B, T, S]
        windowed = g.op("Where", far, minus, slot_mask)
        if scattered:  # the step's own tokens sit at slots cache_len + j, whatever their positions
            apart = g.op("Sub", positions, g.op("Reshape", position_ids, g.ints(B, 1, T)))  # [B, T, T]: p_i - p_j
            near = g.op("Less", apart, g.const(np.int64(window)))
            windowed = g.op("ScatterElements", windowed, at_slots, g.op("Where", g.op("And", seen, near), zero, minus),
                            axis=2)
        masks[True] = attention_mask(windowed)
    # A T > 1 step puts its values at their slots with ScatterND (whole D-rows: the same copy of the past as
    # ScatterElements, 4x faster at T=64 in isolation). A wide step (prefill) does the same with its keys and
    # scores every slot in one product, the same dot products: scattering T*rep scores per slot into the
    # scores costs more than copying D-wide key rows once T*rep > D. A narrow step (verify) keeps the score
    # scatter, cheaper than a copy of the past keys there (batch 4, T=2: 1.09x the step time with the key
    # scatter, one measurement within about 5% noise).
    # The QNN flavours keep the element scatters the HTP was validated with.
    slot_scatter = multi and not (same_ops or scaled_norm)
    key_scatter = slot_scatter and T * rep > D
    if multi:  # where the step's scores, values and own entries go (shared by every layer)
        length4 = g.op("Reshape", cache_len, g.ints(B, 1, 1, 1))
        at_slot = g.op("Add", length4, g.const(np.arange(T, dtype=np.int64).reshape(1, 1, T, 1)))  # [B, 1, T, 1]
        if slot_scatter:  # [B, Hkv, T, 3]: (row, kv head, slot of step token t)
            grid = np.stack(np.meshgrid(np.arange(B), np.arange(Hkv), np.arange(T), indexing="ij"), -1)[..., :2]
            step_slots = g.op("Concat", g.const(grid.astype(np.int64)),
                              g.op("Expand", at_slot, g.ints(B, Hkv, T, 1)), axis=-1)
        else:
            step_rows = g.op("Expand", at_slot, g.ints(B, Hkv, T, D))  # [B, Hkv, T, D]: slot of step token t's value row
        if not key_scatter:
            step_cols = g.op("Expand", g.op("Add", length4, g.const(np.arange(T, dtype=np.int64).reshape(1, 1, 1, T))),
                             g.ints(B, Hkv, T * rep, T))  # [B, Hkv, T*rep, T]: slot of step token j
        own_col = g.const(np.broadcast_to(np.repeat(np.arange(T, dtype=np.int64), rep).reshape(1, 1, T * rep, 1),
                                          (B, Hkv, T * rep, 1)).copy())  # row t*rep + r -> step token t

    # RoPE as one MatMul per layer: x @ R_p, where R_p [D, D] holds cos_p on the diagonal and the signed sin_p
    # where rotate_half takes its input (output i < D/2 reads x[i + D/2], output i >= D/2 reads x[i - D/2]).
    # R [B, T, D, D] is built once per step from the tables at the step's positions and broadcast over heads;
    # each output sums two nonzero products, the same way at every T (`specedge check` verifies the rows).
    half = cfg.rotary_dim // 2  # partial rotary: rotate_half pairs within the rotated dimensions only
    swap = np.zeros((D, D), dtype=dt)
    swap[np.arange(half) + half, np.arange(half)] = 1
    swap[np.arange(half), np.arange(half) + half] = 1

    def rotation_from(table):  # "rope" or "rope_local" (Gemma 3's sliding layers) -> R [B, T, D, D]
        cos = g.op("Unsqueeze", g.op("Gather", g.weight(table + ".cos"), position_ids, axis=0), g.ints(2))
        sin = g.op("Unsqueeze", g.op("Gather", g.weight(table + ".sin"), position_ids, axis=0), g.ints(2))
        return g.op("Add", g.op("Mul", g.const(np.eye(D, dtype=dt)), cos), g.op("Mul", g.const(swap), sin))

    rotations = {False: rotation_from("rope")}  # local -> R
    if cfg.rope_local_theta:
        rotations[True] = rotation_from("rope_local")
    # The rotation's MatMul must see the same rows at every T: all heads of one token, one [heads, D] x [D, D]
    # product. A T > 1 step has that layout ([B, T, heads, D]); a one-token step of batch 1 may put the heads
    # first, [1, heads, 1, D], the contract's K/V layout (no Reshape per output), which onnxruntime folds into
    # the same product. With B > 1 it would run one-row products per head instead, which round differently.
    heads_first = not multi and B == 1

    # The residual stream is 2-D, [B*T, E]: every weight product is a plain 2-D MatMul or Gemm.
    x = embedding(input_ids)
    if cfg.embed_scale is not None:  # Gemma: times sqrt(hidden), rounded to the weights' dtype as transformers does
        x = g.op("Mul", x, g.const(float(np.dtype(dt).type(cfg.embed_scale)), dt))
    for i, (past_k, past_v) in enumerate(pasts):
        p = f"layers.{i}."
        h = _rms_norm(g, x, g.weight(p + "attn_norm"), cfg.rms_norm_eps, dt, scaled_norm, (B * T, E))
        qkv = linear(h, p + "qkv", k=E)
        if cfg.attention_bias:
            qkv = g.op("Add", qkv, g.weight(p + "qkv_bias"))
        qk_norm = g.weight(p + "qk_norm") if cfg.qk_norm else None
        if not heads_first:  # [B, T, heads, D]; the new K/V are transposed into the contract's layout
            qkv, heads = g.op("Reshape", qkv, g.ints(B, T, H + 2 * Hkv, D)), 2
            kv_names = (None, None)
        else:  # [1, heads, 1, D] is the contract's K/V layout already, so the Splits write the outputs
            qkv, heads = g.op("Reshape", qkv, g.ints(B, H + 2 * Hkv, 1, D)), 1
            kv_names = (C.new_key(i), C.new_value(i))
            qk_norm = qk_norm and g.op("Reshape", qk_norm, g.ints(H + Hkv, 1, D))
        qk, v = g.op("Split", qkv, g.ints(H + Hkv, Hkv), axis=heads, outputs=2, name=(None, kv_names[1]))
        if cfg.qk_norm:  # q and k get the norm and RoPE together
            qk = _rms_norm(g, qk, qk_norm, cfg.rms_norm_eps, dt, scaled_norm,
                           (B, H + Hkv, 1, D) if heads_first else (B, T, H + Hkv, D))
        qk = g.op("MatMul", qk, rotations[bool(cfg.rope_local_theta) and cfg.slides(i)])
        q, k = g.op("Split", qk, g.ints(H, Hkv), axis=heads, outputs=2, name=(None, kv_names[0]))
        new_k = k if heads_first else per_head(k, C.new_key(i))  # [B, Hkv, T, D]
        new_v = v if heads_first else per_head(v, C.new_value(i))
        g.declare_output(out_specs[C.new_key(i)])
        g.declare_output(out_specs[C.new_value(i)])

        q = to_rows(q)
        scores_step = g.op("MatMul", q, g.op("Transpose", new_k, perm=[0, 1, 3, 2]))  # [B, Hkv, T*rep, T]
        keys = g.op("ScatterND", past_k, step_slots, new_k) if key_scatter else past_k  # [B, Hkv, S, D]
        scores_slots = g.op("MatMul", q, g.op("Transpose", keys, perm=[0, 1, 3, 2]))  # [B, Hkv, T*rep, S]
        if not multi:  # the step's only token is each row's own: [past | self] is already the slot order
            scores_own, values = scores_step, past_v
        else:
            if not key_scatter:
                scores_slots = g.op("ScatterElements", scores_slots, step_cols, scores_step, axis=3)
            scores_own = g.op("GatherElements", scores_step, own_col, axis=3)  # [B, Hkv, T*rep, 1]
            values = (g.op("ScatterND", past_v, step_slots, new_v) if slot_scatter
                      else g.op("ScatterElements", past_v, step_rows, new_v, axis=2))  # [B, Hkv, S, D]
        mask = masks[window is not None and cfg.slides(i)]
        scores = g.op("Concat", scores_slots, scores_own, axis=-1)  # [B, Hkv, T*rep, S+1]
        if cfg.attn_softcap is not None:  # Gemma 2: cap * tanh(score / cap), each score alone
            scores = _softcap(g, scores, cfg.attn_softcap, dt)
        scores = g.op("Add", scores, mask)
        probs_slots, probs_own = g.op("Split", g.op("Softmax", scores, axis=-1), g.ints(S, 1), axis=-1, outputs=2)
        if not multi:  # [rep, 1] @ [1, D]: one product per element, the same rounding as the Mul below
            own = g.op("MatMul", probs_own, new_v)
        else:
            own = g.op("Mul", g.op("Reshape", probs_own, g.ints(B, Hkv, T, rep, 1)),
                       g.op("Unsqueeze", new_v, g.ints(3)))  # [B, Hkv, T, rep, D]: row t*rep + r times value t
            own = g.op("Reshape", own, g.ints(B, Hkv, T * rep, D))
        attn = g.op("Add", g.op("MatMul", probs_slots, values), own)
        out = linear(from_rows(attn), p + "o", k=H * D)
        if cfg.sandwich_norms:  # Gemma 2/3 normalize what each block adds to the residual stream
            out = _rms_norm(g, out, g.weight(p + "attn_out_norm"), cfg.rms_norm_eps, dt, scaled_norm, (B * T, E))
        x = g.op("Add", x, out, label=RESIDUAL)

        h = _rms_norm(g, x, g.weight(p + "mlp_norm"), cfg.rms_norm_eps, dt, scaled_norm, (B * T, E))
        gate, up = g.op("Split", linear(h, p + "gate_up", k=E), axis=-1, outputs=2)
        act = g.op("Mul", _activation(g, gate, cfg.activation, dt), up)
        out = linear(act, p + "down", k=cfg.intermediate_size)
        if cfg.sandwich_norms:
            out = _rms_norm(g, out, g.weight(p + "mlp_out_norm"), cfg.rms_norm_eps, dt, scaled_norm, (B * T, E))
        x = g.op("Add", x, out, label=RESIDUAL)

    if role == C.STEP:
        h = _rms_norm(g, x, g.weight("norm"), cfg.rms_norm_eps, dt, scaled_norm, (B * T, E))
        # the contract's float32 logits: named here, else by a Cast, after the soft cap if any
        name = C.LOGITS if dt == "float32" and cfg.final_softcap is None else None
        if quant is not None or matmul_head:  # [B, T, E] in, [B, T, V] out: reshaping h costs less than the logits
            logits = linear(g.op("Reshape", h, g.ints(B, T, E)), "lm_head", name=name, rows=(B, T))
        else:  # a Gemm per part of the [V, hidden] table (HEAD_PARTS), each logit the same dot product as whole
            parts = [g.op("Gemm", h, g.weight(part), transB=1) for part in head_parts(cfg, g.weights)]
            logits = parts[0] if len(parts) == 1 else g.op("Concat", *parts, axis=-1)
            logits = g.op("Reshape", logits, g.ints(B, T, dims.vocab_size), name=name)
        if cfg.final_softcap is not None:
            logits = _softcap(g, logits, cfg.final_softcap, dt, name=C.LOGITS if dt == "float32" else None)
        if dt != "float32":
            g.op("Cast", logits, to=1, name=C.LOGITS)
        g.declare_output(out_specs[C.LOGITS])
    return x
