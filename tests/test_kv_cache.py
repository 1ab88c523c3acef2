"""The KV cache returns the memory of buckets it has left, and keeps what the next steps read."""
import sys

import numpy as np
import pytest

from specedge.graphs.contract import ModelDims
from specedge.runtime.kv_cache import KVCache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")

# 4 layers x (K, V) x 8 kv heads x 64 x float32 = 16 KiB per slot: a 2048-slot bucket is 32 MiB
DIMS = ModelDims(num_layers=4, num_heads=8, num_kv_heads=8, head_dim=64, hidden_size=512, vocab_size=16,
                 context=4096, batch=1, dtype="float32")
MIB = 2**20


def rss_anon() -> float:
    """Private resident memory of this process, MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon"))


def fill(cache: KVCache, n: int, seed: int) -> np.ndarray:
    """Append n entries of random K/V (one step of n tokens) and return them, [2, L, 1, H_kv, n, D]."""
    d = cache.dims
    new_kv = np.random.default_rng(seed).standard_normal(
        (2, d.num_layers, 1, d.num_kv_heads, n, d.head_dim)).astype(np.float32)
    cache.append(new_kv, [n])
    return new_kv


def test_a_bucket_the_cache_leaves_goes_back_to_the_os():
    cache = KVCache(DIMS, buckets=[1024, 2048])
    first = fill(cache, 1000, seed=0)  # the smallest bucket (16 MiB), nearly full
    cache.use_bucket(2048)
    second = fill(cache, 1000, seed=1)  # 2000 entries: every page of the 2048 bucket (32 MiB) written
    before = rss_anon()
    cache.use_bucket(4096)
    after = rss_anon()
    # the 4096 bucket gains the 2000 valid entries (about 31 MiB); the 2048 bucket's 32 MiB are released
    assert after - before < 4, (before, after)
    assert not cache.block(2048).any()  # released pages read as zeros: nothing of them is kept
    valid = cache.block(4096)[..., :2000, :]
    assert np.array_equal(valid[..., :1000, :], first) and np.array_equal(valid[..., 1000:, :], second)
    # the smallest bucket is kept: every generation starts there
    assert np.array_equal(cache.block(1024)[..., :1000, :], first)
    assert cache.resident_bytes == (16 + 64) * MIB

    # a new generation: the active bucket is released too, the smallest one is written over as before
    before = rss_anon()
    cache.reset()
    assert before - rss_anon() > 0.9 * 31, "the 4096 bucket's valid entries were not released"
    assert cache.bucket == 1024 and not cache.block(4096).any()
    again = fill(cache, 10, seed=2)
    assert np.array_equal(cache.block(1024)[..., :10, :], again)
    assert cache.resident_bytes == (16 + 64) * MIB  # the largest bucket used stays the bound


def test_a_promotion_in_the_smallest_bucket_keeps_it():
    cache = KVCache(DIMS, buckets=[1024, 2048])
    first = fill(cache, 600, seed=3)
    cache.use_bucket(2048)
    assert np.array_equal(cache.block(1024)[..., :600, :], first)  # not released
    cache.reset()
    assert cache.bucket == 1024 and not cache.block(2048).any()


def test_a_promotion_never_holds_both_buckets_whole(monkeypatch):
    """The old bucket's pages go slab by slab (one layer's K or V) as their entries are copied: resident
    memory during a promotion stays within a slab or two of where it started, not 31 MiB above it."""
    cache = KVCache(DIMS, buckets=[1024, 2048])
    cache.use_bucket(2048)
    first = fill(cache, 2000, seed=4)  # every page of the 2048 bucket written (32 MiB, 4 MiB per slab)
    start, during = rss_anon(), []
    move = cache._move_slab
    monkeypatch.setattr(cache, "_move_slab", lambda old, new, slab: (move(old, new, slab), during.append(rss_anon())))
    cache.use_bucket(4096)
    assert len(during) == 2 * DIMS.num_layers and max(during) - start < 2 * 4 + 2, (start, during)
    assert np.array_equal(cache.block(4096)[..., :2000, :], first) and not cache.block(2048).any()
