"""Which pages of a bundle's weights file a run keeps mapped. Sessions hold their packed copies of the weight
products, so after loading a step reads from the file only what it looks up (embedding rows) and what it
reads whole at every run; the latter are private copies (backends.PRIVATE_MAX_BYTES), and prefill runs drop
the lookup pages they mapped. On Linux only: madvise, /proc/self/smaps and /proc/self/pagemap."""
from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
from conftest import CHUNK

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.graphs.manifest import load_manifest, read_index, weights_index_file
from specedge.runtime import backends
from specedge.runtime.batch import BatchGenerator
from specedge.runtime.generator import Generator
from specedge.runtime.model import LOOKUP_RELEASE_TOKENS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")

SMALL = 16 << 10  # a tiny model's norms and RoPE tables under it, its embedding and weight products over it


def mapped_kib(path: str) -> int:
    """Resident KiB of this process's mappings of a file (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = fields[-1] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.fixture
def own_bundle(tiny_bundle, tmp_path):
    """A copy of the tiny bundle that no other test maps: mapped_kib counts every mapping of the file in this
    process, so a generator that another test left to the garbage collector would count too."""
    out = str(tmp_path / "tiny")
    shutil.copytree(tiny_bundle, out)
    return out


def test_small_tensors_are_private_copies_and_the_rest_views_of_the_file(own_bundle, monkeypatch, request):
    """The norm weights, read whole by every step, come from private copies: reading them from the file
    would map the page cache around them (on large-folio kernels whole folios: about 60 MB of SmolLM2 int4's
    quantized weights, which the packed sessions never read again, after one decode step)."""
    monkeypatch.setattr(backends, "PRIVATE_MAX_BYTES", SMALL)
    manifest = load_manifest(own_bundle)
    path = os.path.join(own_bundle, manifest.target.weights)
    index = read_index(os.path.join(own_bundle, weights_index_file(manifest.target.weights)))
    mapped, tensors = backends.map_weights(path, index)
    request.addfinalizer(lambda: backends.release_pages([mapped]))  # the other tests count the file's pages
    file = np.frombuffer(mapped, np.uint8)
    small = {n for n, ref in index.items() if ref.length <= SMALL}
    assert small and len(small) < len(index)
    for name, ref in index.items():
        array = tensors[name]
        assert np.shares_memory(array, file) == (name not in small), name
        raw = np.asarray(array).view(np.uint8).reshape(-1)
        assert bytes(raw) == bytes(file[ref.offset:ref.offset + ref.length]), name


def test_a_prefill_leaves_no_pages_of_the_weights_file_mapped(own_bundle, monkeypatch, request):
    """Each prefill run reads embedding rows from the mapped weights file, and each read maps the page cache
    around it; the runs drop those pages again (a decode step maps some, which the test sees)."""
    monkeypatch.setattr(backends, "PRIVATE_MAX_BYTES", SMALL)
    gen = Generator.load(own_bundle)
    request.addfinalizer(gen.close)
    target = gen.target
    weights = os.path.realpath(os.path.join(own_bundle, gen.manifest.target.weights))
    prompt = [int(t) for t in np.random.default_rng(5).integers(5, 200, size=3 * CHUNK + 5)]
    gen.warm("none", 4, prompt=len(prompt))
    target.reset()
    target.prefill(prompt)
    assert target.cache.used == len(prompt) and mapped_kib(weights) == 0
    target.run([7])
    assert mapped_kib(weights) > 0


def test_batch_prefills_leave_no_pages_of_the_weights_file_mapped(tiny_models, tmp_path, monkeypatch, request):
    """Likewise a batch's prefill chunk and a row's own prefill (row graphs) drop the pages they mapped."""
    monkeypatch.setattr(backends, "PRIVATE_MAX_BYTES", SMALL)
    bundle = str(tmp_path / "b3")
    export_bundle(tiny_models["llama"][0], bundle, ExportOptions(context=128, prefill_chunk=CHUNK, batch=3),
                  progress=False)
    gen = BatchGenerator.load(bundle)
    request.addfinalizer(gen.close)
    target = gen.target
    weights = os.path.realpath(os.path.join(bundle, gen.manifest.target.weights))
    gen.runner.warm(0)
    long, short = list(range(5, 5 + 2 * CHUNK + 3)), [9, 10, 11]
    assert target.prefill_chunk([long, long[:CHUNK + 1], []]) == [CHUNK, CHUNK, 0]
    assert mapped_kib(weights) == 0
    target.run_rows([[7], [], []])
    assert mapped_kib(weights) > 0
    assert target.prefill_row(2, short) == len(short)
    assert mapped_kib(weights) == 0


def test_decode_drops_the_lookup_pages_every_so_many_tokens(own_bundle, monkeypatch, request):
    """A decode step maps the page cache around the embedding rows it reads; every LOOKUP_RELEASE_TOKENS
    tokens those pages go, so a long generation does not map the whole table a folio at a time."""
    monkeypatch.setattr(backends, "PRIVATE_MAX_BYTES", SMALL)
    gen = Generator.load(own_bundle)
    request.addfinalizer(gen.close)
    target = gen.target
    weights = os.path.realpath(os.path.join(own_bundle, gen.manifest.target.weights))
    gen.warm("none", 0)
    target.reset()
    target.prefill([5, 6, 7])
    tokens = [int(t) for t in np.random.default_rng(3).integers(5, 200, size=LOOKUP_RELEASE_TOKENS)]
    for token in tokens[:-1]:
        target.run([token])
    assert mapped_kib(weights) > 0
    target.run([tokens[-1]])
    assert mapped_kib(weights) == 0
    target.run([9])
    assert mapped_kib(weights) > 0
