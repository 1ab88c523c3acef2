"""Initializers whose bytes live in a file next to the graph (ONNX external data).

onnx.external_data_helper.set_external_data refuses a tensor without raw_data, and ours never hold their
bytes: the weights file is written once and every graph only points into it. These two functions are the
one place that writes and reads such a pointer (location, offset, length).
"""
from __future__ import annotations

from onnx import TensorProto


def point_at_file(tensor: TensorProto, location: str, offset: int, length: int) -> TensorProto:
    """Make `tensor` read `length` bytes at `offset` of `location` (relative to the graph's folder)."""
    tensor.data_location = TensorProto.EXTERNAL
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    return tensor


def file_pointer(tensor: TensorProto) -> tuple[str | None, int, int | None]:
    """(location, offset, length) of an external tensor; offset 0 and length None where the entry is absent,
    as ONNX reads them."""
    where = {e.key: e.value for e in tensor.external_data}
    length = where.get("length")
    return where.get("location"), int(where.get("offset", 0)), None if length is None else int(length)
