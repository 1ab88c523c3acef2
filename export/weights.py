"""Write one raw weights file per model, shared by all of its step graphs.

Tensors go back to back, little-endian, each at an aligned offset (4096 for large tensors, so a runtime can
mmap them in place; 64 for small ones). The returned index is what the graphs' external-data entries and
the bundle's `<model>.weights.json` record.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ..graphs.manifest import WeightRef
from ..graphs.quant import PackedInt4

PAGE = 4096
SMALL = 64


def write_weights(path: str, tensors: Iterable[tuple[str, np.ndarray | PackedInt4]],
                  on_tensor: Callable[[str], None] | None = None) -> dict[str, WeightRef]:
    refs: dict[str, WeightRef] = {}
    offset = 0
    with open(path, "wb") as f:
        for name, tensor in tensors:
            if isinstance(tensor, PackedInt4):  # int4: the packed bytes, indexed with the logical shape
                data, dtype, shape = tensor.packed, "int4", tensor.shape
            else:
                data = np.ascontiguousarray(tensor)
                dtype, shape = data.dtype.name, tuple(data.shape)
            pad = -offset % (PAGE if data.nbytes >= 1 << 16 else SMALL)
            f.write(b"\0" * pad)
            offset += pad
            f.write(data.reshape(-1).view(np.uint8))  # the array's own bytes: no copy of a 113 MB table
            refs[name] = WeightRef(name, dtype, shape, offset, data.nbytes)
            offset += data.nbytes
            if on_tensor:
                on_tensor(name)
    return refs
