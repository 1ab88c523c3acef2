"""Write one raw weights file per model, shared by all of its step graphs.

Tensors go back to back, little-endian, each at an aligned offset (4096 for large tensors, so a runtime can
mmap them in place; 64 for small ones). The returned index is what the graphs' external-data entries and
the bundle's `<model>.weights.json` record.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ..graphs.manifest import WeightRef

PAGE = 4096
SMALL = 64


def write_weights(path: str, tensors: Iterable[tuple[str, np.ndarray]],
                  on_tensor: Callable[[str], None] | None = None) -> dict[str, WeightRef]:
    refs: dict[str, WeightRef] = {}
    offset = 0
    with open(path, "wb") as f:
        for name, array in tensors:
            array = np.ascontiguousarray(array)
            pad = -offset % (PAGE if array.nbytes >= 1 << 16 else SMALL)
            f.write(b"\0" * pad)
            offset += pad
            f.write(array.tobytes())
            refs[name] = WeightRef(name, array.dtype.name, tuple(array.shape), offset, array.nbytes)
            offset += array.nbytes
            if on_tensor:
                on_tensor(name)
    return refs
