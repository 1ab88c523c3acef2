"""The KV cache of one model: buffers the runtime owns, and the valid-length tensor.

Per layer, K and V buffers of the contract's shape [B, H_kv, S_b, D] for the active context bucket S_b, and
`length`, the int64 [B] array that every step graph reads as `cache_len`. Buffers are allocated once per
bucket and bound to the graphs of that bucket as inputs; they are never reallocated (the addresses stay, so
the bindings do), but their memory is returned to the OS when the cache leaves the bucket (below). A step writes its new
K/V at slots length..length+n; commit and rollback are one assignment to `length`: slots past it are stale,
and the graphs mask them out.

Context buckets: a bundle has graphs for several past lengths (say 128, 256, 384, 512, 768, 1024), and a step
attends over the smallest bucket that holds the cache. When the cache outgrows its bucket, its valid entries
are copied once into the next bucket's buffers (at most once per bucket per generation, never per step; a
prefill climbs too: its chunks attend over the smallest bucket that holds them, which for a 480-token prompt
is 1.5x faster than prefilling in the final bucket, at the cost of those buckets' sessions).

A bucket the cache has left holds only stale entries, so its pages are released (Linux madvise DONTNEED on a
private anonymous mapping: the memory goes back to the OS, the address stays valid and reads as zeros).
Resident KV memory is then the active bucket plus the smallest one, which every generation starts in and
which is kept so that short generations never fault pages in again. Without this a generation that reached
1,000 tokens kept every bucket it passed: 3x the KV memory it needs. The price is faulting a bucket's pages
in again each time a generation enters it (about 1 us per 4 KiB page here, under 0.5% of a 128-token run).

A draft cut from the target's first N layers (`layers_of: "target"` in the manifest) owns no buffers: its
`SharedKVCache` is the target's first N layers with a `cache_len` of its own (see that class).
"""
from __future__ import annotations

import mmap

import numpy as np

from ..graphs.contract import ModelDims


def zeroed_pages(shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, mmap.mmap | None]:
    """A zeroed array on a private anonymous mapping of its own, whose pages `KVCache.release` can return to
    the OS. Where madvise is missing (not Linux), a plain array and None."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if not (nbytes and hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap, "MAP_PRIVATE")):
        return np.zeros(shape, dtype), None
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dtype=dtype).reshape(shape), pages


def new_kv_block(dims: ModelDims, rows: int, tokens: int) -> np.ndarray:
    """Zeroed output buffers for a step's new K/V: [2, L, rows, H_kv, T, D]; block[0][i] and block[1][i] are
    layer i's `new_key` / `new_value` outputs (contiguous, bound as they are), and the whole block goes to
    KVCache.append in one copy."""
    return np.zeros((2, dims.num_layers, rows, dims.num_kv_heads, tokens, dims.head_dim), np.dtype(dims.dtype))


class KVCache:
    def __init__(self, dims: ModelDims, buckets: list[int] | None = None):
        self.dims = dims
        self.buckets = sorted(set(buckets or []) | {dims.context})
        self.length = np.zeros(dims.batch, dtype=np.int64)  # bound as `cache_len` in every graph
        self._blocks: dict[int, np.ndarray] = {}  # bucket -> [2, L, B, H_kv, S_b, D]: every K, then every V
        self._pages: dict[int, mmap.mmap | None] = {}  # bucket -> the mapping under its block
        self._buffers: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self._bucket = self.buckets[0]
        self.promotions = 0  # bucket changes, for the stats

    def buffers(self, bucket: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """K and V buffers ([B, H_kv, bucket, D] per layer), allocated on first use: contiguous views of one
        block (`block`), so that a step's new entries for all layers are stored with one copy."""
        if bucket not in self._buffers:
            block = self.block(bucket)
            self._buffers[bucket] = (list(block[0]), list(block[1]))
        return self._buffers[bucket]

    def block(self, bucket: int) -> np.ndarray:
        """The buffers of a bucket as one array [2, L, B, H_kv, bucket, D] (K of every layer, then V)."""
        if bucket not in self._blocks:
            d = self.dims
            shape = (2, d.num_layers, d.batch, d.num_kv_heads, bucket, d.head_dim)
            self._blocks[bucket], self._pages[bucket] = zeroed_pages(shape, np.dtype(d.dtype))
        return self._blocks[bucket]

    def _releasable(self, bucket: int) -> mmap.mmap | None:
        """The mapping of a bucket whose pages may go back to the OS, or None: the smallest bucket stays (every
        generation starts in it), and a bucket not allocated as pages cannot be released."""
        return self._pages.get(bucket) if bucket != self.buckets[0] else None

    def release(self, bucket: int) -> None:
        """Return a bucket's pages to the OS (it reads as zeros again), unless it is the smallest bucket."""
        pages = self._releasable(bucket)
        if pages is not None:
            pages.madvise(mmap.MADV_DONTNEED)

    @property
    def bucket(self) -> int:
        """The active context bucket: the past length the next step attends over."""
        return self._bucket

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
        """Valid entries of the longest row (the only row at batch 1): what bucket and capacity checks need."""
        return int(self.length.max())

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def use_bucket(self, bucket: int) -> None:
        """Make `bucket` (>= the active one) active, carrying the valid entries over."""
        if bucket == self.bucket:
            return
        if bucket < self.bucket or bucket not in self.buckets:
            raise ValueError(f"cannot move the cache from bucket {self.bucket} to {bucket}")
        self.buffers(bucket)  # allocated, and its per-layer views made once
        for slab in range(2 * self.dims.num_layers):
            self._move_slab(self.bucket, bucket, slab)
        self.release(self.bucket)
        self._bucket = bucket
        self.promotions += 1

    def _move_slab(self, old: int, new: int, slab: int) -> None:
        """Copy the valid entries of one layer's K or V (slab = kv * L + layer) from bucket old to new, then
        give that slab's pages of the old bucket back (one that is released at all): both buckets whole would
        be resident at once otherwise, the peak of a run (float32 SmolLM2 from 512 to 768 slots: 24 MB)."""
        n, old_block = self.used, self.block(old)
        kv, layer = divmod(slab, self.dims.num_layers)
        self.block(new)[kv, layer, ..., :n, :] = old_block[kv, layer, ..., :n, :]
        pages = self._releasable(old)
        if pages is not None:
            size = old_block[kv, layer].nbytes
            first = -(-slab * size // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the slab only
            end = (slab + 1) * size // mmap.PAGESIZE * mmap.PAGESIZE
            if end > first:
                pages.madvise(mmap.MADV_DONTNEED, first, end - first)

    def append(self, new_kv: np.ndarray, counts: list[int]) -> None:
        """Per row b, store the first counts[b] entries of a step's new K/V (new_kv [2, L, B, H_kv, T, D], K of
        every layer then V, as `new_kv_block` lays them out) after that row's valid ones."""
        for b, n in enumerate(counts):
            self.append_row(b, new_kv[:, :, b:b + 1], n)

    def append_row(self, row: int, new_kv: np.ndarray, n: int) -> None:
        """Store the first n entries of a one-row step's new K/V (new_kv [2, L, 1, H_kv, T, D]) after row
        `row`'s valid ones."""
        start = int(self.length[row])
        if start + n > self.bucket:
            raise ValueError(f"cache overflow in row {row}: {start} + {n} > bucket {self.bucket}")
        if n:  # one copy for every layer (60 small copies cost 3-4x as much after a run)
            self.block(self.bucket)[:, :, row, :, start:start + n] = new_kv[:, :, 0, :, :n]
        self.length[row] = start + n

    def move_entry(self, src: int, dst: int) -> None:
        """Copy slot src to slot dst in every layer (batch 1): a tree node accepted off the first chain."""
        block = self.block(self.bucket)
        block[:, :, 0, :, dst] = block[:, :, 0, :, src]

    def set_row_length(self, row: int, n: int) -> None:
        """Commit or roll back one row of a batch."""
        if not 0 <= n <= self.bucket:
            raise ValueError(f"cache length {n} outside 0..{self.bucket}")
        self.length[row] = n

    def set_length(self, n: int) -> None:
        """Commit or roll back: the first n entries are history, the rest are stale."""
        if not 0 <= n <= self.bucket:
            raise ValueError(f"cache length {n} outside 0..{self.bucket}")
        self.length[:] = n

    def reset(self) -> None:
        """An empty cache in the smallest bucket (for a new generation)."""
        self.length[:] = 0
        self.release(self._bucket)
        self._bucket = self.buckets[0]

    # -- snapshots (runtime/session.py) --------------------------------------------------------------
    def read_entries(self) -> list[np.ndarray]:
        """Copies of the valid entries of a batch-1 cache: per layer K then V, each [H_kv, n, D]."""
        n = self.used
        return [np.array(buf[0, :, :n]) for buf in self.keys + self.values]

    def write_entries(self, entries: list[np.ndarray]) -> None:
        """Replace the cache with entries from read_entries, in the smallest bucket that leaves a free slot."""
        n = entries[0].shape[1] if entries else 0
        self.reset()
        self.use_bucket(next((b for b in self.buckets if b > n), self.buckets[-1]))
        for buf, entry in zip(self.keys + self.values, entries):
            buf[0, :, :n] = entry
        self.set_length(n)

    @property
    def resident_bytes(self) -> int:
        """The most KV memory the cache keeps resident: the smallest bucket's buffers and the largest one used."""
        released = None not in self._pages.values()  # else nothing is ever released
        kept = {self.buckets[0], max(self._blocks, default=0)} if released else set(self._blocks)
        return sum(self._blocks[b].nbytes for b in kept if b in self._blocks)


class SharedKVCache(KVCache):
    """A layer draft's cache: the target's K/V buffers of its first N layers, and a cache_len of its own.

    Why: for every committed token, a draft made of the target's first N layers computes exactly the K/V
    the target already stored for those layers. Reading the target's buffers removes the draft's prefill
    (its share of TTFT), its catch-up steps and its cache memory. Each round the draft starts at the
    target's valid length and writes its proposals' K/V after it; the target's verify step then rewrites
    those slots with its own K/V before anything reads them, so the target never sees a draft entry.

    The bucket is the target's: the proposer moves the target to the bucket its verify step needs before
    the draft runs (`ModelRunner.reserve`), so the bucket never changes while draft entries sit past the
    target's valid length (a promotion copies only valid entries).
    """

    def __init__(self, dims: ModelDims, parent: KVCache):
        super().__init__(dims, parent.buckets)
        if dims.num_layers > parent.dims.num_layers:
            raise ValueError(f"a {dims.num_layers}-layer draft cannot share a {parent.dims.num_layers}-layer cache")
        self.parent = parent

    @property
    def bucket(self) -> int:
        return self.parent.bucket

    def buffers(self, bucket: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        keys, values = self.parent.buffers(bucket)
        return keys[: self.dims.num_layers], values[: self.dims.num_layers]

    def block(self, bucket: int) -> np.ndarray:
        return self.parent.block(bucket)[:, : self.dims.num_layers]

    def use_bucket(self, bucket: int) -> None:
        if bucket == self.parent.bucket:
            return
        if self.used > self.parent.used:  # draft entries past the target's valid ones would be lost
            raise RuntimeError("a shared draft cache cannot change bucket in the middle of a round")
        self.parent.use_bucket(bucket)

    def follow(self) -> None:
        """Start a round at the target's valid length (every committed token but the pending one)."""
        self.length[:] = self.parent.length

    def reset(self) -> None:
        self.length[:] = 0

    @property
    def resident_bytes(self) -> int:
        return 0  # the buffers are the target's

    @staticmethod
    def compatible(draft: ModelDims, target: ModelDims, draft_buckets: list[int], target_buckets: list[int]) -> bool:
        """Whether a layer draft's graphs can read the target's buffers as they are."""
        same = ("batch", "num_kv_heads", "head_dim", "context", "dtype")
        return (all(getattr(draft, f) == getattr(target, f) for f in same)
                and draft.num_layers <= target.num_layers
                and sorted(set(draft_buckets) | {draft.context}) == sorted(set(target_buckets) | {target.context}))
