"""The KV cache of one model: buffers the runtime owns, and the valid-length tensor.

Per layer, K and V buffers of the contract's shape [B, H_kv, S, D]; and `length`, the int64 [B] array that
every step graph reads as `cache_len`. The buffers are allocated once and bound to every step graph as
inputs; they are never reallocated or copied. A step writes its new K/V at slots length..length+n; commit
and rollback are one assignment to `length`: slots past it are stale, and the graphs mask them out.
"""
from __future__ import annotations

import numpy as np

from ..graphs.contract import ModelDims


class KVCache:
    def __init__(self, dims: ModelDims):
        self.dims = dims
        shape, dtype = dims.cache_shape, np.dtype(dims.dtype)
        self.keys = [np.zeros(shape, dtype) for _ in range(dims.num_layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(dims.num_layers)]
        self.length = np.zeros(dims.batch, dtype=np.int64)  # bound as `cache_len`

    @property
    def capacity(self) -> int:
        return self.dims.context

    @property
    def used(self) -> int:
        return int(self.length[0])

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def append(self, new_keys: list[np.ndarray], new_values: list[np.ndarray], n: int) -> None:
        """Store the first n entries of a step's new K/V ([B, H_kv, T, D] each) after the valid ones."""
        start = self.used
        if start + n > self.capacity:
            raise ValueError(f"cache overflow: {start} + {n} > {self.capacity}")
        for buf, new in zip(self.keys, new_keys):
            buf[:, :, start:start + n] = new[:, :, :n]
        for buf, new in zip(self.values, new_values):
            buf[:, :, start:start + n] = new[:, :, :n]
        self.length[:] = start + n

    def set_length(self, n: int) -> None:
        """Commit or roll back: the first n entries are history, the rest are stale."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"cache length {n} outside 0..{self.capacity}")
        self.length[:] = n

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.keys) + sum(b.nbytes for b in self.values)
