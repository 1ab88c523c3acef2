"""A small ONNX graph builder: ops in, ModelProto out, standard domain only.

Weights live outside the graph: `weight(name)` declares an initializer whose bytes sit in the model's one
external weights file (written by specedge.export.weights_file), so every step graph of a model refers to
the same bytes. Small constants (shapes, axes, masks) are embedded in the graph itself.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .contract import OPSET, TensorSpec
from .external_data import point_at_file
from .manifest import WeightRef

ONNX_DTYPE = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "int64": TensorProto.INT64,
    "int32": TensorProto.INT32,
    "bool": TensorProto.BOOL,
    "int8": TensorProto.INT8,
    "int4": TensorProto.INT4,
}


class GraphBuilder:
    def __init__(self, name: str, weights: dict[str, WeightRef], weights_file: str, opset: int = OPSET,
                 ir_version: int = 8):
        """`opset`/`ir_version`: 17/8 for the portable float flavour (the IR of opset 17, ONNX 1.12: what ATC
        and older TensorRT parsers read); quantized flavours need 21/10 (blocked DequantizeLinear, int4)."""
        self.name = name
        self.opset, self.ir_version = opset, ir_version
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._weights = weights
        self._weights_file = weights_file
        self._declared: set[str] = set()
        self._consts: dict[tuple, str] = {}
        self._count = 0

    @property
    def weights(self) -> dict[str, WeightRef]:
        """The weights file's index: what `weight` can reference."""
        return self._weights

    # -- tensors -------------------------------------------------------------------------------------
    def input(self, spec: TensorSpec) -> str:
        self.inputs.append(helper.make_tensor_value_info(spec.name, ONNX_DTYPE[spec.dtype], list(spec.shape)))
        return spec.name

    def declare_output(self, spec: TensorSpec) -> None:
        """Make a value already produced under the contract name (op(..., name=...)) a graph output."""
        self.outputs.append(helper.make_tensor_value_info(spec.name, ONNX_DTYPE[spec.dtype], list(spec.shape)))

    def weight(self, name: str) -> str:
        """Reference a tensor of the external weights file (declared once per graph)."""
        if name not in self._declared:
            ref = self._weights[name]
            t = TensorProto(name=name, data_type=ONNX_DTYPE[ref.dtype], dims=list(ref.shape))
            self.initializers.append(point_at_file(t, self._weights_file, ref.offset, ref.length))
            self._declared.add(name)
        return name

    def const(self, value, dtype: str | None = None) -> str:
        """A small embedded constant; identical constants are shared within the graph."""
        array = np.asarray(value, dtype=dtype) if dtype else np.asarray(value)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = f"const_{len(self._consts)}"
            self.initializers.append(numpy_helper.from_array(array, name))
            self._consts[key] = name
        return self._consts[key]

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64))

    # -- ops -----------------------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str, outputs: int = 1, name: str | None = None, label: str | None = None,
           **attrs):
        """Add one node; returns its output name (`name` if given), or a list of names when outputs > 1.
        `name` may also be a list with an entry per output (None: a generated name), for a node whose outputs
        are graph outputs. `label` ends the node's name (n<i>_<op>_<label>): what a flavour's tools find the node by."""
        self._count += 1
        names = [f"{op_type.lower()}_{self._count}" + (f"_{k}" if outputs > 1 else "") for k in range(outputs)]
        if isinstance(name, (list, tuple)):
            names = [given or generated for given, generated in zip(name, names)]
        elif name is not None:
            names = [name]
        if op_type == "Split" and len(inputs) == 1 and self.opset >= 18:
            attrs.setdefault("num_outputs", outputs)  # equal parts: an attribute since opset 18
        node_name = f"n{self._count}_{op_type}" + (f"_{label}" if label else "")
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=node_name, **attrs))
        return names[0] if outputs == 1 else names

    def build(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)], producer_name="specedge")
        model.ir_version = self.ir_version
        return model
