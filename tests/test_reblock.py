"""Re-blocking int4 products at load (runtime/reblock.py): the same weights in smaller blocks, nothing requantized."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specedge.graphs.quant import QUANT_IR_VERSION, QUANT_OPSET, pack_int4
from specedge.runtime.reblock import reblock_int4


def _product(K: int, N: int, block: int, zero_point: bool = False, seed: int = 0) -> onnx.ModelProto:
    """y = x [3, K] @ DequantizeLinear(W int4 [K, N], scale [ceil(K/block), N], axis 0, block_size)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, (K, N)).astype(np.int8)
    rows = -(-K // block)
    scale = (rng.random((rows, N)) * 0.02 + 0.001).astype(np.float32)
    weight = helper.make_tensor("W", TensorProto.INT4, [K, N], pack_int4(q).tobytes(), raw=True)
    inits = [weight, numpy_helper.from_array(scale, "S")]
    inputs = ["W", "S"]
    if zero_point:
        zp = rng.integers(-2, 2, (rows, N)).astype(np.int8)
        inits.append(helper.make_tensor("Z", TensorProto.INT4, [rows, N], pack_int4(zp).tobytes(), raw=True))
        inputs.append("Z")
    nodes = [helper.make_node("DequantizeLinear", inputs, ["Wd"], axis=0, block_size=block),
             helper.make_node("MatMul", ["x", "Wd"], ["y"])]
    graph = helper.make_graph(nodes, "product", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, N])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", QUANT_OPSET)], ir_version=QUANT_IR_VERSION)


def _outputs(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    """Unoptimized: DequantizeLinear then a float MatMul, so equal weights give equal bits."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return _outputs(model, x)[0]


@pytest.mark.parametrize("K,block,to", [(64, 32, 16), (256, 128, 16), (128, 64, 32), (48, 32, 16), (80, 64, 16)])
def test_reblocked_products_compute_the_same_weights(K, block, to):
    """Every int4 DequantizeLinear is rewritten, and the product's output is bit for bit the original's: the
    dequantized weights are the same numbers. K = 48 and 80 end in a short block (the Slice branch)."""
    model = _product(K, 24, block)
    x = np.random.default_rng(1).standard_normal((3, K)).astype(np.float32)
    want = _run(model, x)
    assert reblock_int4(model, to) == 1
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert {a.name: a.i for a in dq.attribute} == {"axis": 0, "block_size": to}
    onnx.checker.check_model(model, full_check=True)
    np.testing.assert_array_equal(_run(model, x), want)


def test_a_scale_two_products_share_is_repeated_once():
    model = _product(64, 24, 32)
    dq, matmul = model.graph.node
    twin = onnx.helper.make_node("DequantizeLinear", list(dq.input), ["Wd2"], axis=0, block_size=32)
    model.graph.node.extend([twin, onnx.helper.make_node("MatMul", ["x", "Wd2"], ["y2"])])
    model.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [3, 24]))
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    assert reblock_int4(model, 16) == 2
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node].count("Expand") == 1
    y, y2 = _outputs(model, x)
    np.testing.assert_array_equal(y, y2)


def test_products_in_blocks_no_larger_are_left_alone():
    model = _product(64, 24, 16)
    before = model.SerializeToString()
    assert reblock_int4(model, 16) == 0 and model.SerializeToString() == before


def test_layouts_it_cannot_rewrite_are_refused():
    """Layouts specedge does not export: blocks along N, an int4 zero point (which ONNX's Expand does not take)."""
    model = _product(64, 24, 32)
    model.graph.node[0].attribute[0].i = 1
    with pytest.raises(ValueError, match="cannot re-block int4 \\[64, 24\\] in blocks of 32 along axis 1 into"):
        reblock_int4(model, 16)
    with pytest.raises(ValueError, match="along axis 0 with a zero point into blocks of 16"):
        reblock_int4(_product(64, 24, 32, zero_point=True), 16)
