"""The default CPU backend: onnxruntime through its C API (ort_capi), one shared prepacked-weights container.

Every session of every model in a bundle draws its weights from one mmap per weights file and its packed
weights from one container, so ten step graphs cost about one model of memory, and a layer draft cut from
the target costs nothing extra.
"""
from __future__ import annotations

from ...errors import BackendError
from ...graphs.manifest import WeightRef
from . import DroppingPages, map_weights, release_pages, trim_heap, ort_capi


class CapiBackend:
    name = "cpu"

    def __init__(self, threads: int | None):
        self.threads = threads
        self._envs: dict[str, ort_capi.Env] = {}  # one Env (weights + packed-weights container) per weights file
        self._maps = []

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
        self._envs[path] = env

    def load(self, graph_path: str, weights_path: str, prepack: bool = True, config: dict[str, str] | None = None):
        """`config`: onnxruntime session config entries the graph needs (the manifest's, see ModelEntry)."""
        try:
            with DroppingPages(self._maps):
                return self._envs[weights_path].create_session(graph_path, prepack=prepack, config=config)
        except ort_capi.CapiError as e:
            raise BackendError(f"onnxruntime cannot load {graph_path}: {str(e).splitlines()[0]}") from None

    def release_raw_weights(self) -> None:
        """Call once all sessions exist: their packed weights are what they read now."""
        release_pages(self._maps)
        trim_heap()

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()
        self._maps.clear()
