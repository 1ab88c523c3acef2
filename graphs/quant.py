"""Weight-only quantization: the numbers behind `--quant int8|int4`, and how the graph stores them.

Layout (the one onnxruntime, TensorRT and QNN all read): a MatMul weight W [K, N] (x @ W) becomes

    W_q     int8 or int4 [K, N]   signed, symmetric (no zero point): W ~= W_q * scale
    W_scale float32 [K/block, N]  one scale per `block` consecutive input rows of each output column

and the graph computes `MatMul(x, DequantizeLinear(W_q, W_scale, axis=0, block_size=block))`, standard ONNX
at opset 21. onnxruntime rewrites that pair into its MatMulNBits kernel (int4 and, since 1.2x, int8); at
accuracy level 4 (int8 activations, blockwise) that kernel computes every row of an M-row call bitwise like
a one-row call, which is what keeps speculative verification of k rows exactly equal to k one-row decode
steps. At level 1 (float activations) rows differ in the last bits. Which kernel runs depends on the CPU: with
AVX-512 one kernel takes every row count (measured for M = 2..17, int4 and int8, blocks of 32), but on AVX2-only
x86 CPUs a one-row int4 product with blocks of 32 or more has a kernel of its own, whose rows differ from the
multi-row kernel's (in SmolLM2's logits by up to 12 after 30 layers), while int4 blocks of 16 and int8 blocks
of any size take one kernel there too. A block of 32 is two blocks of 16 with the same scale, so the runtime loads
int4 products re-blocked into 16 on such a CPU (runtime/reblock.py: the same weights, exact rows). It asks the
machine it runs on which blocks are alike (runtime/kernel_probe.py).

The embedding table [V, E] is stored int8 in blocks along E (`Gather` of rows and of their scales, then a
blocked `DequantizeLinear` on axis 1): a step reads B*T rows, so its format costs no speed, only bytes.
The LM head (tied or not) is a MatMul weight of its own, [E, V], quantized with `head_bits`. GGUF Q8_0 and
Q4_0 tensors already are such blocks (32 along the input dimension) and are copied without requantizing.

With `offsets` (`--quant-scheme offset`) each layer weight also has a per-block offset, W ~= q * scale +
offset, the layout of GGUF's Q4_1 (a scale and a minimum per block of 32), which an integer zero point cannot
hold (Q4_1's minimum is a float, not a multiple of its scale):

    W_offset float32 [K/block, N]   added to every weight of its block

and the graph adds the offset's product as a low-rank term: x @ W = x @ DequantizeLinear(W_q, W_scale) +
(x @ S) @ W_offset, with S [K, K/block] the constant block-sum matrix (1 where row k is in block b). Q4_1
tensors are copied exactly (q - 8, d, m + 8d), and Q4_K's blocks of 32 (q - 8, d * sc, 8 * d * sc - dmin * mn),
so an int4 bundle of a Q4_1 or Q4_K GGUF is that GGUF's model (up to its other tensors' types);
float tensors get min/max round-to-nearest blocks. The embedding and the head stay symmetric.

With `rows` (`--quant int8 --quant-scheme rows`) the products are integer products instead: each weight (the
head too) is int8 with one scale per output column, W.scale [1, N], and the graph quantizes its input x [M, K]
itself, one scale per row, s_r = max_k |x[r, k]| / 127:

    y = MatMulInteger(uint8(round(x / s_r) + 128), W_q, a_zero_point=128) * W_scale * s_r

A row's integers depend on that row alone and integer sums are exact, so an M-row product computes every row
as a one-row product does, on any kernel and any CPU (MatMulNBits needs its kernels to agree, above). Integer
GEMMs cost little per extra row (onnxruntime's uint8 x int8 kernels: AVX2, AVX-512 VNNI, AMX), so verification
and prefill steps cost far less than MatMulNBits' rows (benchmarks/w8a8/README.md). The price is precision:
one activation scale per row instead of per block of 32 (SmolLM2: about 90% top-1 agreement with float32
against 96%, simulated). The embedding keeps its int8 blocks (`block`).

Both kernels quantize activations (MatMulNBits at level 4 per block of 32, the rows scheme per row), which
loses most where a few input channels are much larger than the rest (outlier channels: their block's or row's
scale leaves the other channels few levels). So a symmetric or rows bundle is smoothed (SmoothQuant, Xiao et
al. 2023) by default: each product's input channel k is divided by a factor f_k and the weight's input row k
multiplied by it, x @ W = (x / f) @ (f * W), with f_k = a_k^alpha / w_k^(1 - alpha) from a_k, the largest
|x[:, k]| over calibration text, and w_k, the largest |W[k, :]|. The division is folded into what produces the
input, so the graph is unchanged and the float model computes the same function: the RMSNorm weight before
q/k/v and before gate/up, the value projection's output columns before the output projection (one factor per
kv head's channel, shared by the query heads that read it), the up projection's output columns before the
down projection (act(gate) * up is linear in up), the final norm before the head. `smooth` records alpha (0:
not smoothed); export/smooth.py measures the a_k. The weights are requantized after smoothing, so by default a
product that a bundle stores as the source's own 4-bit blocks (GGUF Q4_0; the offset scheme's Q4_1) stays
unsmoothed unless smoothing is asked for; 8-bit products are smoothed (graphs/llama.py keeps_source_blocks).

int4 tensors are packed two per byte, element i in byte i//2, the low nibble first (ONNX's order).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import numpy as np

QUANT_MODES = ("none", "int8", "int4")
QUANT_SCHEMES = ("symmetric", "offset", "rows")
BLOCK_SIZES = (16, 32, 64, 128, 256)  # powers of two in 16..256: what MatMulNBits takes
QUANT_OPSET = 21  # DequantizeLinear with block_size and int4 weights
QUANT_IR_VERSION = 10  # the IR that introduced int4
# int4 in blocks of 32: exact with AVX-512 and on ARM cores with the int8 dot product (emulated), where blocks of
# 16 are not; loaded as blocks of 16 on AVX2-only x86 (above). Blocks of 16 agree with float32 on 3 points more
# positions and cost 15% more bytes (benchmarks/quant/README.md, "Re-blocking at load").
DEFAULT_BLOCK = {4: 32, 8: 32}
# SmoothQuant's alpha: SmolLM2, simulated (benchmarks/w8a8/quality_sim.py, float head), calibrated on the prompt
# suite and measured on benchmarks/quality/text.txt, top-1 agreement with float32 by alpha (0: unsmoothed):
# rows 0: 90.0%, 0.4: 92.5%, 0.5: 93.6%, 0.6: 94.0% (bundles, int8 head: 0: 86.9%, 0.35: 90.0%, 0.5: 92.0%,
# 0.65: 92.0%, 0.8: 89.6%); int8 blocks 0: 96.1%, 0.3: 96.8%, 0.5: 97.6%, 0.65: 97.3%, 0.8: 97.5% (bundles in
# blocks of 16: 0.4: 97.3%, 0.5: 97.8%, 0.65: 97.5%); int4 blocks (round to nearest) 0: 67.2%, 0.3: 67.7%, 0.5: 72.9%
DEFAULT_SMOOTH = 0.5
ACCURACY_LEVEL = 4  # onnxruntime's qdq_matmulnbits_accuracy_level the graphs are exact under (see above)
# onnxruntime session settings a quantized graph needs. MatMulAddFusion would turn the o/down projections and
# their residual Add into a float Gemm *before* the DequantizeLinear + MatMul -> MatMulNBits fusion runs,
# leaving those weights dequantized at every step (measured: 63% of a step in DequantizeLinear).
ORT_SESSION_CONFIG = {"session.qdq_matmulnbits_accuracy_level": str(ACCURACY_LEVEL),
                      "optimization.disable_specified_optimizers": "MatMulAddFusion"}


@dataclass(frozen=True)
class QuantSpec:
    """How one model's weights are stored: the named choices the step graph makes for a quantized flavour."""

    bits: int  # 8 or 4, for every layer MatMul
    block: int  # input rows per scale
    head_bits: int  # the LM head's bits (8 or 4)
    embed: str = "int8"  # the embedding table [V, E]: int8 in blocks of `block` along E
    offsets: bool = False  # layer weights have a per-block float offset W.offset (see above)
    rows: bool = False  # int8 products: weights per output column, activations per row, MatMulInteger (see above)
    smooth: float = 0.0  # SmoothQuant's alpha the weights were migrated with (0: none; see above)

    @property
    def scheme(self) -> str:
        return "offset" if self.offsets else "rows" if self.rows else "symmetric"

    @property
    def weight_type(self) -> str:
        return f"int{self.bits}"

    def to_json(self) -> dict:
        scheme = {"offset": "offset: symmetric blocks along K plus a float offset per block (layer weights), no zero "
                            "point",
                  "rows": "rows: int8 weights with one scale per output column (layers and head), int8 activations "
                          "with one scale per row, integer products (MatMulInteger); embedding blocks along E",
                  "symmetric": "symmetric, blockwise along K, no zero point"}[self.scheme]
        return {**asdict(self), "weights": self.weight_type, "scheme": scheme,
                "opset": QUANT_OPSET, "onnxruntime_session_config": dict(ORT_SESSION_CONFIG),
                "targets": targets(self)}

    @classmethod
    def from_json(cls, d: dict) -> "QuantSpec":
        return cls(bits=int(d["bits"]), block=int(d["block"]), head_bits=int(d["head_bits"]),
                   embed=str(d.get("embed", "int8")), offsets=bool(d.get("offsets", False)),
                   rows=bool(d.get("rows", False)), smooth=float(d.get("smooth", 0.0)))


def targets(spec: QuantSpec) -> list[str]:
    """Runtimes whose importers take this layout (symmetric signed blocks, no zero point)."""
    out = ["onnxruntime"]
    if spec.rows:
        return out  # MatMulInteger: onnxruntime's integer GEMMs (TensorRT and QNN read Q/DQ graphs instead)
    if spec.bits == 4 and spec.head_bits == 4 and spec.block in (64, 128):
        out.append("tensorrt")  # TensorRT's int4 weight-only DequantizeLinear takes 64/128 blocks
    if spec.bits == 8 and spec.head_bits == 8:
        out.append("tensorrt")  # int8 weight-only DequantizeLinear (per-block along K)
    return out


def parse_quant(mode: str, block: int | None, head: str | None = None, scheme: str | None = None,
                smooth: float | None = None) -> QuantSpec | None:
    """The spec for `--quant MODE --quant-block N --quant-head H --quant-scheme S --quant-smooth A`; ValueError
    with a one-line message."""
    if mode not in QUANT_MODES:
        raise ValueError(f"--quant must be one of {', '.join(QUANT_MODES)}, not {mode!r}")
    if mode == "none":
        if block is not None or head is not None or scheme is not None or smooth is not None:
            raise ValueError("--quant-block, --quant-head, --quant-scheme and --quant-smooth need --quant int8 or int4")
        return None
    scheme = scheme or "symmetric"
    if scheme not in QUANT_SCHEMES:
        raise ValueError(f"--quant-scheme must be one of {', '.join(QUANT_SCHEMES)}, not {scheme!r}")
    bits = int(mode[3:])
    block = DEFAULT_BLOCK[bits] if block is None else block
    if block not in BLOCK_SIZES:
        raise ValueError(f"--quant-block must be a power of two in 16..256 ({', '.join(map(str, BLOCK_SIZES))}), not {block}")
    head = head or "int8"
    if head not in ("int8", "int4"):
        raise ValueError(f"--quant-head must be int8 or int4, not {head!r}")
    if scheme == "rows" and (bits, head) != (8, "int8"):
        raise ValueError("--quant-scheme rows is int8 only (integer products): use --quant int8 and an int8 head")
    if smooth is not None and scheme == "offset":
        raise ValueError("--quant-smooth does not apply to --quant-scheme offset, which copies the GGUF's Q4_1 blocks "
                         "and offsets as they are")
    smooth = (0.0 if scheme == "offset" else DEFAULT_SMOOTH) if smooth is None else smooth
    if not 0 <= smooth < 1:
        raise ValueError(f"--quant-smooth must be in [0, 1) (0: no smoothing), not {smooth}")
    return QuantSpec(bits=bits, block=block, head_bits=int(head[3:]), offsets=scheme == "offset", rows=scheme == "rows",
                     smooth=float(smooth))


def smoothing_factors(act_range: np.ndarray, weight_range: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant's per input channel factors f = a^alpha / w^(1 - alpha) (see above): `act_range` [K], the
    largest |x[:, k]| seen; `weight_range` [K], the largest |W[k, :]|. Channels never seen or all zero get
    factors from a floor, not 0 or inf."""
    a = np.maximum(act_range.astype(np.float64), 1e-5)
    w = np.maximum(weight_range.astype(np.float64), 1e-5)
    return np.maximum(a ** alpha / w ** (1 - alpha), 1e-5).astype(np.float32)


# -- numerics -----------------------------------------------------------------------------------------
# int4 scales tried per block: amax / c, the grid -8..7. Plain round-to-nearest with amax -> 7 wastes the -8
# level and rounds the many small weights coarsely; picking, per block, the candidate with the least squared
# error lowered SmolLM2's requantization error from 0.102 to 0.085 (mean relative, Q4_1 -> int4 block 32).
INT4_DIVISORS = tuple(np.linspace(6.0, 8.5, 11).astype(np.float32))
# Columns quantized at a time. Blocks run along K, so columns are independent: chunks give the same result,
# and a tied head (V columns) needs temporaries of a chunk's size, not several copies of the whole table.
COLUMNS = 4096


def _by_columns(quantize):
    """quantize(w [K, N], ...) -> arrays [., N], run on chunks of COLUMNS columns and joined."""
    @functools.wraps(quantize)
    def run(w: np.ndarray, *args, **kwargs):
        if w.shape[1] <= COLUMNS:
            return quantize(w, *args, **kwargs)
        parts = [quantize(w[:, j:j + COLUMNS], *args, **kwargs) for j in range(0, w.shape[1], COLUMNS)]
        return tuple(np.concatenate(p, axis=1) for p in zip(*parts))
    return run


@_by_columns
def quantize_blocks(w: np.ndarray, bits: int, block: int, search: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric (no zero point) quantization of W [K, N] in blocks of `block` rows along K.

    Returns (q int8 [K, N], scale float32 [ceil(K/block), N]); W ~= q * scale, scales positive.
    * int8: round to nearest with the block's largest magnitude mapped to 127 (values -127..127).
    * int4: values -8..7; each block's scale is amax / c for the c in INT4_DIVISORS with the least squared
      error, every weight rounded to the nearest grid value (clipped at the ends). `search=False` keeps
      c = 7 (the block's largest magnitude exact): for SmolLM2's int4 LM head the searched scales, which clip
      rare large weights, raised perplexity from 42.7 to 46.9 while lowering the weight error.
    An all-zero block gets scale 1 (any scale represents it exactly). A last block shorter than `block` is
    allowed (ONNX's blocked DequantizeLinear has ceil(K/block) scale rows)."""
    K, N = w.shape
    nb = -(-K // block)
    padded = np.zeros((nb * block, N), np.float32)
    padded[:K] = w
    blocks = padded.reshape(nb, block, N)
    amax = np.abs(blocks).max(axis=1)
    nonzero = amax > 0
    if bits == 8:
        scale = np.where(nonzero, amax / 127, 1.0).astype(np.float32)
        q = np.clip(np.rint(blocks / scale[:, None, :]), -127, 127)
    else:
        scale, best = None, None
        for c in (INT4_DIVISORS if search else (np.float32(7),)):
            s = np.where(nonzero, amax / c, 1.0).astype(np.float32)
            err = ((np.clip(np.rint(blocks / s[:, None, :]), -8, 7) * s[:, None, :] - blocks) ** 2).sum(axis=1)
            if scale is None:
                scale, best = s, err
            else:
                better = err < best
                scale, best = np.where(better, s, scale), np.where(better, err, best)
        q = np.clip(np.rint(blocks / scale[:, None, :]), -8, 7)
    return q.astype(np.int8).reshape(nb * block, N)[:K], scale.astype(np.float32)


@_by_columns
def quantize_offset_blocks(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Min/max quantization of W [K, N] in blocks of `block` rows along K (GGUF Q4_1's rule, any bits):
    per block scale = (max - min) / (2^bits - 1) and W ~= q * scale + offset with q in -2^(bits-1) ..
    2^(bits-1) - 1, offset = min + 2^(bits-1) * scale. Returns (q int8 [K, N], scale, offset [ceil(K/block), N])."""
    K, N = w.shape
    nb = -(-K // block)
    padded = np.zeros((nb * block, N), np.float32)
    padded[:K] = w
    padded[K:] = w[-1:] if K % block else 0  # a short last block: its own values, so its min/max are its own
    blocks = padded.reshape(nb, block, N)
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    half = 2 ** (bits - 1)
    scale = np.where(hi > lo, (hi - lo) / (2 * half - 1), 1.0).astype(np.float32)
    q = np.clip(np.rint((blocks - lo[:, None, :]) / scale[:, None, :]), 0, 2 * half - 1) - half
    offset = (lo + half * scale).astype(np.float32)
    return q.astype(np.int8).reshape(nb * block, N)[:K], scale, offset


def block_sums(K: int, block: int) -> np.ndarray:
    """S [K, ceil(K/block)] float32: x @ S sums each block of x's K inputs (the offsets' low-rank term)."""
    s = np.zeros((K, -(-K // block)), np.float32)
    s[np.arange(K), np.arange(K) // block] = 1
    return s


def dequantize_blocks(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """q [K, N] * scale [ceil(K/block), N], in float32: what DequantizeLinear(axis=0) computes."""
    K = q.shape[0]
    return q.astype(np.float32) * np.repeat(scale, block, axis=0)[:K]


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 values in -8..7 -> ONNX int4 bytes (two per byte, element i in byte i//2, low nibble first)."""
    flat = q.reshape(-1).astype(np.int8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    nibbles = (flat.view(np.uint8) & 0x0F).reshape(-1, 2)
    return (nibbles[:, 0] | (nibbles[:, 1] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of pack_int4: int8 values in -8..7 of `shape`."""
    n = int(np.prod(shape))
    pairs = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)[:n].astype(np.int8)
    return np.where(pairs > 7, pairs - 16, pairs).astype(np.int8).reshape(shape)


def relative_error(w: np.ndarray, blocks: "Blocks") -> float:
    """||W - dequantized|| / ||W|| (Frobenius): the error a quantization introduced into W [K, N]; COLUMNS
    columns at a time."""
    squares = diff = 0.0
    for j in range(0, w.shape[1], COLUMNS):
        cols = slice(j, j + COLUMNS)
        part = Blocks(blocks.q[:, cols], blocks.scale[:, cols], blocks.bits, blocks.block,
                      None if blocks.offset is None else blocks.offset[:, cols])
        squares += float(np.square(w[:, cols], dtype=np.float64).sum())
        diff += float(np.square(w[:, cols] - part.dequantized(), dtype=np.float64).sum())
    return (diff / squares) ** 0.5 if squares else 0.0


@dataclass
class Blocks:
    """A weight already in the ONNX layout: q [K, N] int8 values, scale [K/block, N], and its bits."""

    q: np.ndarray
    scale: np.ndarray
    bits: int
    block: int
    offset: np.ndarray | None = None  # [K/block, N] float32: W = q * scale + offset (GGUF Q4_1), or none

    @staticmethod
    def concat(parts: list["Blocks"]) -> "Blocks":
        """Fuse weights along N (q/k/v, gate/up): blocks run along K, so columns simply sit side by side."""
        offset = None
        if any(p.offset is not None for p in parts):
            offset = np.concatenate([p.offset if p.offset is not None else np.zeros_like(p.scale) for p in parts], axis=1)
        return Blocks(np.concatenate([p.q for p in parts], axis=1), np.concatenate([p.scale for p in parts], axis=1),
                      parts[0].bits, parts[0].block, offset)

    def split(self, block: int) -> "Blocks":
        """The same weights in blocks of `block` (a divisor of this block): each scale and offset repeated."""
        if block == self.block:
            return self
        assert self.block % block == 0, (self.block, block)
        times = self.block // block
        offset = None if self.offset is None else np.repeat(self.offset, times, axis=0)
        return Blocks(self.q, np.repeat(self.scale, times, axis=0), self.bits, block, offset)

    def dequantized(self) -> np.ndarray:
        w = dequantize_blocks(self.q, self.scale, self.block)
        if self.offset is not None:
            w = w + np.repeat(self.offset, self.block, axis=0)[: w.shape[0]]
        return w


@dataclass
class PackedInt4:
    """An int4 tensor as stored: `packed` bytes (pack_int4) of a logical `shape`. numpy has no int4 dtype, so
    the weights file writer, the weights-file mapper and the backends carry int4 tensors in this wrapper."""

    packed: np.ndarray  # uint8 [ceil(prod(shape) / 2)]
    shape: tuple[int, ...]


    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes)

    @staticmethod
    def from_values(q: np.ndarray) -> "PackedInt4":
        return PackedInt4(pack_int4(q), tuple(q.shape))

    def values(self) -> np.ndarray:
        return unpack_int4(self.packed, self.shape)


def int4_nbytes(shape: tuple[int, ...]) -> int:
    return (int(np.prod(shape)) + 1) // 2
