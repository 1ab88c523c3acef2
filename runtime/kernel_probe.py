"""Does this machine's onnxruntime compute a quantized product's rows alike at every row count?

Exact greedy speculation on a quantized bundle rests on one property of onnxruntime's MatMulNBits kernel (the
fusion of a blocked DequantizeLinear and a MatMul, graphs/quant.py): a row of an M-row product (a verify step's
row) is bit for bit the same row computed alone (a decode step). Which kernel computes a product depends on the
CPU, not on the graph. On x86 with AVX-512 one kernel takes every row count; on AVX2-only x86 CPUs (most laptop
and desktop parts) onnxruntime 1.2x-1.3x computes a one-row int4 product with blocks of 32 or more through a
kernel of its own, whose rows differ from the multi-row kernel's in the last bits, while int4 blocks of 16
and every int8 block go through one kernel (measured on an AVX2 AMD EPYC, benchmarks/quant/README.md). On
aarch64 (emulated, benchmarks/arm/README.md) int4 in blocks of 16 differs in tiles of four rows, and on cores
without the int8 dot product every int4 block does; int8 was alike on every CPU measured.

So the runtime asks the machine: it runs one small product of the bundle's layout (random weights, K = 4
blocks, N = 16) with 1, 2, 3, 5 and 9 rows in onnxruntime's CPU session, with the session settings the bundle's
graphs run under, and compares the rows. The model is written here as ONNX protobuf bytes (the runtime does
not depend on the onnx package). A few milliseconds, once per layout and process.

Where only the one-row product differs (int4 in blocks of 32 or more on AVX2: every product of two rows or
more computes each row alike), the target decodes each token as a two-row step, its second row padding, in the
bundle's own layout; else, where a smaller block that divides the bundle's is alike, the CPU backends load the
int4 products in that block (runtime/reblock.py rewrites the graphs, the weights stay as they are). Two-row
decode comes first because it is the faster of the two on the CPU measured: a T=2 step in blocks of 32 took
11.4 ms against 11.8 ms for a T=1 step re-blocked to 16, and a T=5 verify step 20.4 ms against 24.4
(SmolLM2-135M int4, AVX2 AMD EPYC, benchmarks/quant/README.md). `row_plan` makes the choice per model.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import numpy as np

from ..graphs.quant import BLOCK_SIZES, DEFAULT_BLOCK, ORT_SESSION_CONFIG, pack_int4

ROWS = (2, 3, 5, 9)  # multi-row products compared with the rows computed alone
N = 16
ONNXRUNTIME_CPU = ("cpu", "ort")  # the backends over onnxruntime's CPU kernels: the C API and the Python API


# -- the smallest protobuf writer that an ONNX model needs ---------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _bytes(field: int, value: bytes | str) -> bytes:
    value = value.encode() if isinstance(value, str) else value
    return _varint(field << 3 | 2) + _varint(len(value)) + value


_FLOAT, _INT8, _INT4 = 1, 3, 22  # onnx.TensorProto data types


def _tensor(name: str, dtype: int, dims: tuple[int, ...], raw: bytes) -> bytes:
    return b"".join(_int(1, d) for d in dims) + _int(2, dtype) + _bytes(8, name) + _bytes(9, raw)


def _value_info(name: str, dims: tuple[int, ...]) -> bytes:
    shape = b"".join(_bytes(1, _int(1, d)) for d in dims)
    return _bytes(1, name) + _bytes(2, _bytes(1, _int(1, _FLOAT) + _bytes(2, shape)))


def _attribute_int(name: str, value: int) -> bytes:
    return _bytes(1, name) + _int(3, value) + _int(20, 2)  # type INT


def product_model(bits: int, block: int, rows: int, seed: int = 0) -> bytes:
    """x [rows, K] @ DequantizeLinear(W [K, N] int`bits`, scale [K/block, N], axis 0, block_size) at opset 21,
    with K = 4 blocks: the pattern onnxruntime fuses into MatMulNBits."""
    rng = np.random.default_rng(seed)
    K = 4 * block
    low, high = (-8, 8) if bits == 4 else (-128, 128)
    q = rng.integers(low, high, (K, N)).astype(np.int8)
    scale = (rng.random((K // block, N)) * 0.02 + 0.001).astype(np.float32)
    raw, dtype = (pack_int4(q).tobytes(), _INT4) if bits == 4 else (q.tobytes(), _INT8)
    nodes = (_bytes(1, _bytes(1, "W") + _bytes(1, "S") + _bytes(2, "Wd") + _bytes(4, "DequantizeLinear")
                    + _bytes(5, _attribute_int("axis", 0)) + _bytes(5, _attribute_int("block_size", block)))
             + _bytes(1, _bytes(1, "x") + _bytes(1, "Wd") + _bytes(2, "y") + _bytes(4, "MatMul")))
    graph = (nodes + _bytes(2, "probe") + _bytes(5, _tensor("W", dtype, (K, N), raw))
             + _bytes(5, _tensor("S", _FLOAT, scale.shape, scale.tobytes()))
             + _bytes(11, _value_info("x", (rows, K))) + _bytes(12, _value_info("y", (rows, N))))
    opset = _bytes(1, "") + _int(2, 21)
    return _int(1, 10) + _bytes(7, graph) + _bytes(8, opset)  # IR version 10: int4


@functools.lru_cache(maxsize=None)
def rows_alike(bits: int, block: int, least: int = 1) -> bool:
    """True when onnxruntime's CPU kernels on this machine compute every row of a 2-, 3-, 5- and 9-row product of
    this layout bit for bit like the row computed alone; with `least` = 2, alone means as the first row of a
    two-row product whose second row is padding (two-row decode)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for key, value in ORT_SESSION_CONFIG.items():
        options.add_session_config_entry(key, value)
    run = {rows: ort.InferenceSession(product_model(bits, block, rows), options, providers=["CPUExecutionProvider"])
           for rows in {least, *ROWS}}
    rng = np.random.default_rng(1)
    x = rng.standard_normal((max(ROWS), 4 * block)).astype(np.float32)
    padding = rng.standard_normal((least - 1, 4 * block)).astype(np.float32)
    alone = np.concatenate([run[least].run(None, {"x": np.concatenate([x[i:i + 1], padding])})[0][:1]
                            for i in range(max(ROWS))])
    return all(np.array_equal(run[m].run(None, {"x": x[:m]})[0], alone[:m]) for m in ROWS)


@dataclass(frozen=True)
class RowPlan:
    """How onnxruntime's CPU backends load a model and feed its steps so that a verify row is a decode row."""

    int4_block: int | None = None  # the block its int4 products are loaded in, when not the bundle's (reblock.py)
    min_rows: int = 1  # the fewest rows a step computes: 2 where each decoded token runs with a padding row

    def min_tokens(self, batch: int) -> int:
        """The smallest T of a step graph of `batch` rows that computes min_rows rows."""
        return -(-self.min_rows // batch)


def row_plan(model, backend: str, target=None) -> RowPlan:
    """The RowPlan of `model` (a manifest ModelEntry) on `backend`; other backends than onnxruntime's CPU ones load
    and run graphs as they are. `target`: the target's entry when `model` is its draft.

    A draft's rows need not be exact: its tokens are proposals that the target's verify step judges, its logits
    are only the q of a sampled proposal (taken from the same run that drew it), and its K/V are its own (a
    draft model's cache) or overwritten by the verify step (a layer draft's rows past the target's valid
    length). So a draft decodes in one-row steps, through onnxruntime's fastest kernel, whatever its rows'
    kernels are; one cut from the target's layers loads in the target's layout (their sessions share one packed
    copy of each weight), a draft model as exported."""
    if target is not None:
        return RowPlan(int4_block=row_plan(target, backend).int4_block if model.layers_of == "target" else None)
    quant = model.quant
    if backend not in ONNXRUNTIME_CPU or not quant or 4 not in (int(quant["bits"]), int(quant["head_bits"])):
        return RowPlan()
    block = int(quant["block"])
    if rows_alike(4, block):
        return RowPlan()
    if rows_alike(4, block, least=2) and 2 in model.step_tokens():
        return RowPlan(min_rows=2)
    smaller = exact_block(4, block)
    if smaller != block and importlib.util.find_spec("onnx") is not None:
        return RowPlan(int4_block=smaller)
    return RowPlan()


def exact_block(bits: int, block: int) -> int:
    """`block` where this machine computes the rows of that layout alike; else the largest block that divides it
    and is alike (a bundle's int4 products can be loaded in it unchanged: runtime/reblock.py); else `block`."""
    if rows_alike(bits, block):
        return block
    return next((b for b in sorted(BLOCK_SIZES, reverse=True) if b < block and block % b == 0 and rows_alike(bits, b)),
                block)


def inexact_layouts(model) -> list[str]:
    """The weight layouts of a model (layers, head) whose rows differ between row counts on this machine as its
    CPU backends load and run them (row_plan), in words; empty when every product is exact here."""
    if model.quant.get("rows"):  # integer products: exact at every row count by construction (graphs/quant.py)
        return []
    quant, plan = model.quant, row_plan(model, ONNXRUNTIME_CPU[0])
    block = int(quant["block"])
    loaded = {4: plan.int4_block or block, 8: block}
    kinds = sorted({int(quant["bits"]), int(quant["head_bits"])})
    return [f"int{bits} in blocks of {loaded[bits]}" for bits in kinds
            if not rows_alike(bits, loaded[bits], plan.min_rows)]


def exact_choices() -> list[str]:
    """Export flags of the quantized layouts whose rows are alike on this machine: int8 in its default block,
    and int4 in the smallest such block (the closest to float32)."""
    choices = ["--quant int8"] if rows_alike(8, DEFAULT_BLOCK[8]) else []
    block = next((b for b in BLOCK_SIZES if rows_alike(4, b)), None)
    if block is not None:
        choices.append(f"--quant int4 --quant-block {block}")
    return choices


def why_inexact(model) -> str | None:
    """Why a model (a manifest ModelEntry) with a quant record is not exact on this machine and what to export
    instead, in words for a warning or a check line; None when every product of its layout computes rows alike
    here as the runtime runs them."""
    layouts = inexact_layouts(model)
    if not layouts:
        return None
    # int8 first: where it is exact it is the safer choice (on an AVX2-only CPU it decoded as fast as int4 in
    # blocks of 16 and agrees with float32 on 95.7% of positions against 73.8%, benchmarks/quant/README.md).
    choices = exact_choices()
    instead = (f"exact here: re-export with {' or '.join(choices)}" if choices else
               "no quantized layout tried is exact here: a float32 bundle is")
    block = int(model.quant["block"])
    smaller = exact_block(4, block)
    if any(layout.startswith("int4") for layout in layouts):
        if rows_alike(4, block, least=2) and 2 not in model.step_tokens():
            instead += " (or re-export with 1 among --gamma: decode then runs in its two-token step graph, exact here)"
        elif smaller != block:  # the runtime would have re-blocked it, had it the onnx package
            instead += (f" (or pip install onnx: the runtime then loads its int4 products in blocks of {smaller}, "
                        "exact here)")
    return (f"onnxruntime's CPU kernels on this machine compute the rows of a product of {' and '.join(layouts)} "
            f"differently at different row counts, so a verify row is not a decode row; {instead}")
