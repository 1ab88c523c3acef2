"""Loading int4 weight products in smaller blocks where the bundle's block would compute rows inexactly.

A block of B input rows sharing one scale is, unchanged, B/b blocks of b rows that share that same scale. So
`DequantizeLinear(W_q, scale [K/B, N], block_size=B)` equals, element for element, `DequantizeLinear(W_q,
repeat(scale, B/b rows) [K/b, N], block_size=b)`: the same weights, no requantization. What changes is which
onnxruntime kernel computes the product. On AVX2-only x86 CPUs a one-row int4 product in blocks of 32 or more
runs through a kernel of its own whose rows differ from the multi-row kernel's, while blocks of 16 take one
kernel at every row count (runtime/kernel_probe.py). Re-blocked at load, a bundle exported in blocks of 32, 64
or 128 (the layouts that are fast on AVX-512 and ARM, or that TensorRT imports) decodes exactly on such a CPU,
at the speed of blocks of 16. Where the bundle has a T=2 step graph the runtime decodes in two rows instead,
in the bundle's own block (kernel_probe.row_plan): faster there; re-blocking serves the bundles without one.

The rewrite is done on the graph, not on the weights file: each int4 DequantizeLinear gets its scale through
Reshape -> Expand -> Reshape (-> Slice when K is not a multiple of B) and the new block_size. onnxruntime's
optimizer folds that chain of constants into one scale tensor and then fuses the product into MatMulNBits as
usual, so a session holds nothing more than a bundle exported in blocks of b would. The backends over
onnxruntime's CPU kernels (`cpu`, `ort`) load a graph re-blocked where the model's kernel_probe.RowPlan says
so. The rewrite needs the onnx package (`pip install onnx`, part of specedge[export]); without it the bundle loads as it
is and speculation on it says that its rows may differ (runtime/exactness.py).
"""
from __future__ import annotations

import os

# session config entry: where a graph created from bytes finds its external data (onnxruntime >= 1.18)
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


def external_data_folder(graph_path: str) -> str:
    """EXTERNAL_DATA_FOLDER's value for a session made from reblocked_graph(graph_path, ...): the graph's folder."""
    return os.path.dirname(os.path.abspath(graph_path))


def reblock_int4(model, block: int) -> int:
    """Rewrite every int4 DequantizeLinear of `model` (an onnx ModelProto, external data not loaded) whose block is
    larger than `block` to blocks of `block`; returns how many it rewrote."""
    from onnx import TensorProto, helper

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    nodes, rewritten = [], 0
    repeated: dict[str, str] = {}  # scale -> its re-blocked output, made once however many products share it
    for node in graph.node:
        weight = initializers.get(node.input[0]) if node.op_type == "DequantizeLinear" and node.input else None
        size = next((a for a in node.attribute if a.name == "block_size"), None)
        if weight is None or weight.data_type != TensorProto.INT4 or size is None or size.i <= block:
            nodes.append(node)
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        zero_point = len(node.input) > 2 and node.input[2]  # int4 too, which Expand does not take
        if size.i % block or len(weight.dims) != 2 or axis != 0 or zero_point:  # not a layout specedge exports
            dims = ", ".join(map(str, weight.dims))
            raise ValueError(f"{node.name or node.output[0]}: cannot re-block int4 [{dims}] in blocks of {size.i} "
                             f"along axis {axis}{' with a zero point' if zero_point else ''} into blocks of {block}")
        K, N = weight.dims
        old_rows, repeat = -(-K // size.i), size.i // block
        scale, name = node.input[1], f"{node.input[1]}/block{block}"
        if scale in repeated:
            node.input[1], size.i = repeated[scale], block
            nodes.append(node)
            rewritten += 1
            continue
        consts = {"by_block": [old_rows, 1, N], "repeated": [old_rows, repeat, N], "rows": [old_rows * repeat, N]}
        graph.initializer.extend(helper.make_tensor(f"{name}/{k}", TensorProto.INT64, [len(v)], v)
                                 for k, v in consts.items())
        nodes += [helper.make_node("Reshape", [scale, f"{name}/by_block"], [f"{name}/3d"]),
                  helper.make_node("Expand", [f"{name}/3d", f"{name}/repeated"], [f"{name}/expanded"]),
                  helper.make_node("Reshape", [f"{name}/expanded", f"{name}/rows"], [name])]
        if old_rows * repeat != -(-K // block):  # a short last block: only ceil(K/b) of its rows exist
            graph.initializer.extend(helper.make_tensor(f"{name}/{k}", TensorProto.INT64, [1], [v])
                                     for k, v in (("start", 0), ("end", -(-K // block)), ("axis", 0)))
            nodes.append(helper.make_node("Slice", [name, f"{name}/start", f"{name}/end", f"{name}/axis"],
                                          [f"{name}/sliced"]))
            name = f"{name}/sliced"
        node.input[1] = repeated[scale] = name
        size.i = block
        nodes.append(node)
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return rewritten


def reblocked_graph(graph_path: str, block: int) -> bytes:
    """The graph file at `graph_path` with its int4 products in blocks of `block`, serialized. Its external data
    still points into the bundle's weights file: create the session from these bytes with EXTERNAL_DATA_FOLDER
    set to external_data_folder(graph_path) (or hand every external tensor over as an initializer)."""
    import onnx

    model = onnx.load(graph_path, load_external_data=False)
    reblock_int4(model, block)
    return model.SerializeToString()
