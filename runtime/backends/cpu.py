"""The default CPU backend: onnxruntime through its C API (ort_capi), one shared prepacked-weights container.

Every session of every model in a bundle draws its weights from one mmap per weights file and its packed
weights from one container, so ten step graphs cost about one model of memory, and a layer draft cut from
the target costs nothing extra.
"""
from __future__ import annotations

import os
import sys

from ...errors import BackendError
from ...graphs.manifest import WeightRef
from ...graphs.quant import ORT_SESSION_CONFIG
from ..reblock import reblocked_graph
from . import DroppingPages, map_weights, release_pages, trim_heap, ort_capi

QUANT_KEY = next(iter(ORT_SESSION_CONFIG))  # the MatMulNBits accuracy level: the graph is a quantized one


class CapiBackend:
    name = "cpu"

    def __init__(self, threads: int | None):
        self.threads = threads
        self._envs: dict[str, ort_capi.Env] = {}  # one Env (weights + packed-weights container) per weights file
        self._maps = []
        self._bundle_maps = []  # the bundle's weights files only (not the optimized graphs' tensors)
        self._cache = None  # ort_cache.OptimizedGraphs, made on the first quantized graph
        self._names: dict[str, set[str]] = {}  # weights file -> the names of its tensors
        self._warned = False

    def add_weights_file(self, path: str, index: dict[str, WeightRef]) -> None:
        if path in self._envs:
            return
        mapped, tensors = map_weights(path, index)
        try:
            env = ort_capi.Env(self.threads)
            env.add_weights(tensors)
        except ort_capi.CapiError as e:
            raise BackendError(f"onnxruntime C API: {e}") from None
        self._maps.append(mapped)
        self._bundle_maps.append(mapped)
        self._envs[path] = env
        self._names[path] = set(index)

    def load(self, graph_path: str, weights_path: str, prepack: bool = True, config: dict[str, str] | None = None,
             int4_block: int | None = None):
        """`config`: onnxruntime session config entries the graph needs (the manifest's, see ModelEntry). A
        quantized graph (its config sets the MatMulNBits accuracy level) loads through the optimized-graph
        cache (ort_cache.py) unless SPECEDGE_ORT_CACHE=0. `int4_block`: load the graph's int4 products in this
        smaller block (reblock.py; the model's kernel_probe.RowPlan says when)."""
        env = self._envs[weights_path]
        level, model = "all", None
        block = int4_block
        try:
            if config and QUANT_KEY in config and os.environ.get("SPECEDGE_ORT_CACHE", "1") != "0":
                optimized = self._optimized_graph(env, graph_path, weights_path, config, block)
                if optimized != graph_path:  # what onnxruntime's optimizer made of it already (re-blocked)
                    graph_path, level, block = optimized, "disable", None
            if block is not None:
                model = reblocked_graph(graph_path, block)
            with DroppingPages(self._maps):
                return env.create_session(graph_path, prepack=prepack, optimization_level=level, config=config,
                                          model=model)
        except (ort_capi.CapiError, ValueError) as e:  # ValueError: int4 products reblock.py cannot rewrite
            raise BackendError(f"onnxruntime cannot load {graph_path}: {str(e).splitlines()[0]}") from None

    def _optimized_graph(self, env: ort_capi.Env, graph_path: str, weights_path: str, config: dict[str, str],
                         int4_block: int | None) -> str:
        from .ort_cache import OptimizedGraphs

        if self._cache is None:
            self._cache = OptimizedGraphs()
        try:
            path, tensors = self._cache.graph(graph_path, weights_path, config, self._names[weights_path],
                                              int4_block)
        except OSError as e:  # a read-only cache location: run, with each session's own copies
            if not self._warned:
                print(f"specedge: no optimized-graph cache under {self._cache.root} ({e.strerror or e}); each "
                      f"session keeps its own weight copies (set SPECEDGE_CACHE to a writable directory)",
                      file=sys.stderr)
                self._warned = True
            return graph_path
        except Exception:  # onnxruntime refused the graph: the plain session creation says why
            return graph_path
        new = {n: a for n, a in tensors.items() if not env.has_weight(n)}  # the bundle's own stay from its file
        env.add_weights(new)
        self._maps.extend(a._mmap for a in new.values() if getattr(a, "_mmap", None) is not None)
        return path

    def release_raw_weights(self) -> None:
        """Call once all sessions exist: their packed weights are what they read now."""
        release_pages(self._maps)
        trim_heap()

    def release_lookup_pages(self) -> None:
        """Drop the mapped pages of the bundle's weights files, but not of the optimized graphs' tensors, which
        every step reads. Once sessions have packed their weights, what a run still reads there is an embedding
        row per token (the norms are private copies, map_weights). Each read fault maps the page cache around
        its row (64 KB of fault-around, or a whole large folio), so a 481-token float32 prefill left about 30 MB
        of the table resident. ModelRunner calls this after each prefill run and every so many decode tokens."""
        release_pages(self._bundle_maps)

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()
        self._maps.clear()
        self._bundle_maps.clear()
