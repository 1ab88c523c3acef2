"""Quantized graphs as onnxruntime optimizes them, made once per bundle and kept, with their new weights shared.

A quantized bundle stores each weight product in the standard domain, DequantizeLinear(W.q, W.scale) -> MatMul,
W.q [K, N] in blocks along K. When a session is created, onnxruntime fuses every such pair into its MatMulNBits
kernel, whose weights are laid out [N, K/block, ...]: it writes transposed copies of every W.q and W.scale into
that session (about 110 MB for SmolLM2 int4 while the session is built, 25-55 MB for as long as it lives). A
run holds several sessions (prefill, decode and verify graphs, per context bucket), each with its own copies.

This cache runs that optimization once per graph and keeps the result: the optimized graph (MatMulNBits nodes,
the same kernels and attributes onnxruntime would have made) and its initializers, one file per tensor, named
by content. Sessions then load the optimized graph with graph optimization off and receive every tensor
through AddInitializer from read-only mmaps, so one copy of the transformed weights serves every session of
every process, and the pages drop out of RSS once packed, like the bundle's own weights file.

An entry lives in <cache>/ort/<model key>/: the key digests the weights file's bytes, the session config the
graphs need, onnxruntime's version and this machine's CPU (a fully optimized graph may use CPU-specific
layouts). Inside it, <graph digest>.onnx per graph and t-<content digest>.bin per tensor, each written to a
temporary name and renamed into place, so concurrent runs and crashes never leave half a file behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile

import numpy as np

from ..reblock import EXTERNAL_DATA_FOLDER, external_data_folder, reblocked_graph
from .digests import FileDigests

CACHE_FORMAT = 1  # bump when the layout of an entry changes
MIN_EXTERNAL_BYTES = 1024  # smaller initializers stay inside the graph file

# onnx TensorProto data types of the initializers a quantized step graph has after optimization
_NUMPY = {1: np.float32, 2: np.uint8, 3: np.int8, 6: np.int32, 7: np.int64, 9: np.bool_, 10: np.float16}


def default_root() -> str:
    from ...tools.demo import cache_dir

    return os.path.join(cache_dir(), "ort")


def _cpu() -> str:
    """What a CPU-specific optimization could depend on: the machine and its instruction-set flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return f"{platform.machine()} {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def _atomic_write(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class OptimizedGraphs:
    def __init__(self, root: str | None = None):
        self.root = root or default_root()
        self._digest = FileDigests()

    def model_dir(self, weights_path: str, config: dict[str, str], int4_block: int | None = None) -> str:
        import onnxruntime

        parts = {"format": CACHE_FORMAT, "weights": self._digest(weights_path), "config": config,
                 "onnxruntime": onnxruntime.__version__, "cpu": _cpu()}
        if int4_block is not None:  # graphs re-blocked at load (reblock.py); absent: the key of earlier entries
            parts["int4_block"] = int4_block
        return os.path.join(self.root, hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32])

    def graph(self, graph_path: str, weights_path: str, config: dict[str, str], weights: set[str],
              int4_block: int | None = None) -> tuple[str, dict[str, np.ndarray]]:
        """The optimized graph of `graph_path` (made now if absent) and its external tensors by name, as
        read-only memmaps of their cache files. `weights`: the names of the weights file's tensors, which keep
        their names (sessions get them from the bundle); every other initializer is renamed after its content,
        as names like a graph's constants mean different tensors in different graphs. `int4_block`: optimize the
        graph with its int4 products re-blocked into blocks of that size (reblock.py)."""
        from ...tools.cache import mark_used, record_source

        d = self.model_dir(weights_path, config, int4_block)
        path = os.path.join(d, self._digest(graph_path)[:32] + ".onnx")
        if not os.path.isfile(path):
            if not os.path.isdir(d):
                os.makedirs(d, exist_ok=True)
                record_source(d, weights_path)
            self._optimize(graph_path, path, config, weights, int4_block)
        mark_used(d)
        return path, _tensors(path)

    @staticmethod
    def _optimize(graph_path: str, out: str, config: dict[str, str], weights: set[str], int4_block: int | None) -> None:
        """Let onnxruntime optimize the graph as a session would, then store its initializers by content."""
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto

        from ...graphs.external_data import file_pointer, point_at_file

        with tempfile.TemporaryDirectory(dir=os.path.dirname(out), prefix=".tmp-") as tmp:
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            so.log_severity_level = 3  # its warning about CPU-specific layouts: the cache key has the CPU
            so.optimized_model_filepath = os.path.join(tmp, "graph.onnx")
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "graph.bin")
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                        str(MIN_EXTERNAL_BYTES))
            so.add_session_config_entry("session.disable_prepacking", "1")  # only the graph is wanted here
            for key, value in config.items():
                so.add_session_config_entry(key, str(value))
            source = graph_path
            if int4_block is not None:
                source = reblocked_graph(graph_path, int4_block)
                so.add_session_config_entry(EXTERNAL_DATA_FOLDER, external_data_folder(graph_path))
            ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
            model = onnx.load(os.path.join(tmp, "graph.onnx"), load_external_data=False)
            with open(os.path.join(tmp, "graph.bin"), "rb") as f:
                data = f.read()
            renamed = {}
            for t in model.graph.initializer:
                if t.data_location != TensorProto.EXTERNAL:
                    continue
                _, offset, length = file_pointer(t)
                blob = data[offset:offset + length]
                digest = hashlib.sha256(blob + bytes(str((t.data_type, list(t.dims))), "ascii")).hexdigest()[:32]
                name = f"t-{digest}.bin"
                if t.name not in weights:
                    renamed[t.name] = t.name = f"t-{digest}"
                target = os.path.join(os.path.dirname(out), name)
                if not os.path.isfile(target) or os.path.getsize(target) != length:
                    _atomic_write(target, blob)
                point_at_file(t, name, 0, length)
            for node in model.graph.node:
                for i, name in enumerate(node.input):
                    if name in renamed:
                        node.input[i] = renamed[name]
            _atomic_write(out, model.SerializeToString())


def _tensors(graph_path: str) -> dict[str, np.ndarray]:
    import onnx
    from onnx import TensorProto

    from ...graphs.external_data import file_pointer

    model = onnx.load(graph_path, load_external_data=False)
    d = os.path.dirname(graph_path)
    out = {}
    for t in model.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL or t.data_type not in _NUMPY:
            continue
        location, _, _ = file_pointer(t)
        out[t.name] = np.memmap(os.path.join(d, location), dtype=_NUMPY[t.data_type], mode="r",
                                shape=tuple(t.dims) if t.dims else ())
    return out
