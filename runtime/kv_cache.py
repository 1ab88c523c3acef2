"""The KV cache of one model: buffers the runtime owns, and the valid-length tensor.

Per layer, K and V buffers of the contract's shape [B, H_kv, S_b, D] for the active context bucket S_b, and
`length`, the int64 [B] array that every step graph reads as `cache_len`. Buffers are allocated once per
bucket and bound to the graphs of that bucket as inputs; they are never reallocated. A step writes its new
K/V at slots length..length+n; commit and rollback are one assignment to `length`: slots past it are stale,
and the graphs mask them out.

Context buckets: a bundle has graphs for several past lengths (say 256, 512, 768, 1024), and a step attends over
the smallest bucket that holds the cache. When the cache outgrows its bucket, its valid entries are copied
once into the next bucket's buffers (at most once per bucket per generation, never per step).
"""
from __future__ import annotations

import numpy as np

from ..graphs.contract import ModelDims


class KVCache:
    def __init__(self, dims: ModelDims, buckets: list[int] | None = None):
        self.dims = dims
        self.buckets = sorted(set(buckets or []) | {dims.context})
        self.length = np.zeros(dims.batch, dtype=np.int64)  # bound as `cache_len` in every graph
        self._buffers: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self.bucket = self.buckets[0]
        self.promotions = 0  # bucket changes, for the stats

    def buffers(self, bucket: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """K and V buffers ([B, H_kv, bucket, D] per layer), allocated on first use."""
        if bucket not in self._buffers:
            d = self.dims
            shape, dtype = (d.batch, d.num_kv_heads, bucket, d.head_dim), np.dtype(d.dtype)
            self._buffers[bucket] = ([np.zeros(shape, dtype) for _ in range(d.num_layers)],
                                     [np.zeros(shape, dtype) for _ in range(d.num_layers)])
        return self._buffers[bucket]

    @property
    def keys(self) -> list[np.ndarray]:
        return self.buffers(self.bucket)[0]

    @property
    def values(self) -> list[np.ndarray]:
        return self.buffers(self.bucket)[1]

    @property
    def capacity(self) -> int:
        return self.dims.context

    @property
    def used(self) -> int:
        return int(self.length[0])

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def use_bucket(self, bucket: int) -> None:
        """Make `bucket` (>= the active one) active, carrying the valid entries over."""
        if bucket == self.bucket:
            return
        if bucket < self.bucket or bucket not in self.buckets:
            raise ValueError(f"cannot move the cache from bucket {self.bucket} to {bucket}")
        n = self.used
        old_k, old_v = self.buffers(self.bucket)
        new_k, new_v = self.buffers(bucket)
        for src, dst in zip(old_k + old_v, new_k + new_v):
            dst[:, :, :n] = src[:, :, :n]
        self.bucket = bucket
        self.promotions += 1

    def append(self, new_keys: list[np.ndarray], new_values: list[np.ndarray], n: int) -> None:
        """Store the first n entries of a step's new K/V ([B, H_kv, T, D] each) after the valid ones."""
        start = self.used
        if start + n > self.bucket:
            raise ValueError(f"cache overflow: {start} + {n} > bucket {self.bucket}")
        for buf, new in zip(self.keys, new_keys):
            buf[:, :, start:start + n] = new[:, :, :n]
        for buf, new in zip(self.values, new_values):
            buf[:, :, start:start + n] = new[:, :, :n]
        self.length[:] = start + n

    def set_length(self, n: int) -> None:
        """Commit or roll back: the first n entries are history, the rest are stale."""
        if not 0 <= n <= self.bucket:
            raise ValueError(f"cache length {n} outside 0..{self.bucket}")
        self.length[:] = n

    def reset(self) -> None:
        """An empty cache in the smallest bucket (for a new generation)."""
        self.length[:] = 0
        self.bucket = self.buckets[0]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for k, v in self._buffers.values() for a in k + v)
