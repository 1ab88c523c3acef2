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
blocks, N = 16) with 1, 2 and 5 rows in onnxruntime's CPU session, with the session settings the bundle's
graphs run under, and compares the rows. The model is written here as ONNX protobuf bytes (the runtime does
not depend on the onnx package). A few milliseconds, once per layout and process. Where the bundle's int4
block differs and a smaller block that divides it does not, the CPU backends load the bundle's int4 products
in that block (load_block; runtime/reblock.py rewrites the graphs, the weights stay as they are).
"""
from __future__ import annotations

import functools
import importlib.util

import numpy as np

from ..graphs.quant import BLOCK_SIZES, DEFAULT_BLOCK, ORT_SESSION_CONFIG, pack_int4

ROWS = (2, 5)  # multi-row products compared with one-row ones
N = 16


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
def rows_alike(bits: int, block: int) -> bool:
    """True when onnxruntime's CPU kernels on this machine compute every row of a 2- and 5-row product of this
    layout bit for bit like the row alone."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for key, value in ORT_SESSION_CONFIG.items():
        options.add_session_config_entry(key, value)
    run = {rows: ort.InferenceSession(product_model(bits, block, rows), options, providers=["CPUExecutionProvider"])
           for rows in (1,) + ROWS}
    x = np.random.default_rng(1).standard_normal((max(ROWS), 4 * block)).astype(np.float32)
    alone = np.concatenate([run[1].run(None, {"x": x[i:i + 1]})[0] for i in range(max(ROWS))])
    return all(np.array_equal(run[m].run(None, {"x": x[:m]})[0], alone[:m]) for m in ROWS)


def exact_block(bits: int, block: int) -> int:
    """`block` where this machine computes the rows of that layout alike; else the largest block that divides it
    and is alike (a bundle's int4 products can be loaded in it unchanged: runtime/reblock.py); else `block`."""
    if rows_alike(bits, block):
        return block
    return next((b for b in sorted(BLOCK_SIZES, reverse=True) if b < block and block % b == 0 and rows_alike(bits, b)),
                block)


def load_block(quant: dict | None) -> int | None:
    """The block onnxruntime's CPU backends load the int4 products of a bundle with this quant record in, when it
    is not the bundle's own: its exact_block, where that differs and the onnx package (which the graph rewrite
    needs) is installed. None for bundles without int4 products and wherever the bundle's block is used as is."""
    if not quant or 4 not in (int(quant["bits"]), int(quant["head_bits"])):
        return None
    block = exact_block(4, int(quant["block"]))
    return block if block != int(quant["block"]) and importlib.util.find_spec("onnx") is not None else None


def inexact_layouts(quant: dict) -> list[str]:
    """The weight layouts of a manifest's quant record (layers, head) whose rows differ between row counts on
    this machine as its CPU backends load them (int4 re-blocked where load_block says so), in words; empty when
    every product is exact here."""
    block = int(quant["block"])
    loaded = {4: load_block(quant) or block, 8: block}
    kinds = sorted({int(quant["bits"]), int(quant["head_bits"])})
    return [f"int{bits} in blocks of {loaded[bits]}" for bits in kinds if not rows_alike(bits, loaded[bits])]


def exact_choices() -> list[str]:
    """Export flags of the quantized layouts whose rows are alike on this machine: int8 in its default block,
    and int4 in the smallest such block (the closest to float32)."""
    choices = ["--quant int8"] if rows_alike(8, DEFAULT_BLOCK[8]) else []
    block = next((b for b in BLOCK_SIZES if rows_alike(4, b)), None)
    if block is not None:
        choices.append(f"--quant int4 --quant-block {block}")
    return choices


def why_inexact(quant: dict) -> str | None:
    """Why a bundle with this quant record is not exact on this machine and what to export instead, in words for
    a warning or a check line; None when every product of its layout computes rows alike here."""
    layouts = inexact_layouts(quant)
    if not layouts:
        return None
    # int8 first: where it is exact it is the safer choice (on an AVX2-only CPU it decoded as fast as int4 in
    # blocks of 16 and agrees with float32 on 95.7% of positions against 73.8%, benchmarks/quant/README.md).
    choices = exact_choices()
    instead = (f"exact here: re-export with {' or '.join(choices)}" if choices else
               "no quantized layout tried is exact here: a float32 bundle is")
    smaller = exact_block(4, int(quant["block"]))
    if any(layout.startswith("int4") for layout in layouts) and smaller != int(quant["block"]):
        # the runtime would have re-blocked it, had it the onnx package
        instead += (f" (or pip install onnx: the runtime then loads its int4 products in blocks of {smaller}, "
                    "exact here)")
    return (f"onnxruntime's CPU kernels on this machine compute the rows of a product of {' and '.join(layouts)} "
            f"differently at different row counts, so a verify row is not a decode row; {instead}")
