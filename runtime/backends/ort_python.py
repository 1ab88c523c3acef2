"""onnxruntime through its Python API: CPU, CUDA or TensorRT execution providers.

Weights are handed to every session as OrtValues over one mmap (SessionOptions.add_initializer), so the raw
weights exist once; prepacking sessions still keep private packed copies (the Python API has no shared
prepacked-weights container; the `cpu` backend in ort_capi.py does). Buffers are bound once with I/O binding,
so a step moves no data through Python.
"""
from __future__ import annotations

import os

import numpy as np

from ...errors import BackendError, PlacementError
from ...graphs.manifest import WeightRef
from ...graphs.quant import PackedInt4
from ..reblock import EXTERNAL_DATA_FOLDER, external_data_folder, reblocked_graph
from . import map_weights, release_pages, trim_heap

_PROVIDERS = {
    "ort": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}
# float32 bundles compute in float32: onnxruntime's CUDA provider lets cuBLAS use TF32 (10-bit mantissa) by
# default. On an H200 a float32 verify step's rows differed from one-token decode by up to 8e-3 with it, by
# 1e-7 to 8e-6 without (benchmarks/gpu/README.md).
_PROVIDER_OPTIONS = {"CUDAExecutionProvider": {"use_tf32": "0"}}
_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64",
          "tensor(int32)": "int32", "tensor(bool)": "bool"}


# Providers that compute in device memory. onnxruntime copies a host-bound input to the device when it is
# bound (IOBinding::BindInput), not at every run: a session bound once would read the inputs of its first
# step forever. Their sessions bind the inputs again before each run, which sends what the runtime wrote
# since (tokens, positions, cache_len, the cache). Outputs bound to host memory are copied back by every run.
DEVICE_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


class OrtSession:
    def __init__(self, session, rebind_inputs: bool = False, name: str = "graph"):
        self._session = session
        self._rebind_inputs = rebind_inputs
        self._name = name
        self.inputs = [(i.name, _TYPES.get(i.type, i.type), tuple(d if isinstance(d, int) else -1 for d in i.shape))
                       for i in session.get_inputs()]
        self.outputs = [(o.name, _TYPES.get(o.type, o.type), tuple(d if isinstance(d, int) else -1 for d in o.shape))
                        for o in session.get_outputs()]
        self._binding = None
        self._keep = None

    def bind(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        _check_arrays("input", self.inputs, inputs)
        _check_arrays("output", self.outputs, outputs)
        binding = self._session.io_binding()
        _bind_inputs(binding, inputs)
        for name, array in outputs.items():
            binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        self._binding, self._keep = binding, (inputs, outputs)

    def run(self) -> None:
        if self._rebind_inputs:
            _bind_inputs(self._binding, self._keep[0])
        try:
            self._session.run_with_iobinding(self._binding)
        except Exception as e:  # a kernel the provider lacks shows only here (CUDA: int4 DequantizeLinear)
            raise PlacementError(f"onnxruntime failed running {self._name} on {self._session.get_providers()[0]}: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def close(self) -> None:
        self._binding = self._keep = self._session = None


def _bind_inputs(binding, inputs: dict[str, np.ndarray]) -> None:
    for name, array in inputs.items():
        binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


def _check_arrays(kind: str, specs, arrays: dict[str, np.ndarray]) -> None:
    want = {name: (dtype, shape) for name, dtype, shape in specs}
    if set(arrays) != set(want):
        missing, extra = sorted(set(want) - set(arrays)), sorted(set(arrays) - set(want))
        raise BackendError(f"cannot bind {kind}s: missing {missing}, unexpected {extra}")
    for name, array in arrays.items():
        dtype, shape = want[name]
        if array.dtype.name != dtype or tuple(array.shape) != shape or not array.flags.c_contiguous:
            raise BackendError(f"cannot bind {kind} {name}: got {array.dtype.name}{list(array.shape)}"
                               f"{'' if array.flags.c_contiguous else ' (not contiguous)'}, graph wants {dtype}{list(shape)}")


class OrtBackend:
    def __init__(self, name: str, threads: int | None):
        import onnxruntime as ort

        self._ort = ort
        self.name = name
        self.threads = threads
        self._weights: dict[str, dict[str, object]] = {}  # weights file -> {name: OrtValue}
        self._maps = []
        self.providers = self._providers()
        if self.providers and self.providers[0] in DEVICE_PROVIDERS:
            # The CUDA kernels log to the process-wide logger, not the session's: its ScatterND warns at every
            # cache write that duplicate indices are undefined (ours never repeat), thousands of lines a run.
            ort.set_default_logger_severity(3)

    def _providers(self) -> list[str]:
        """The execution providers sessions get, checked against this onnxruntime (a subclass may register its own)."""
        providers = _PROVIDERS[self.name]
        missing = set(providers) - set(self._ort.get_available_providers())
        if missing:
            extra = "cuda" if self.name == "cuda" else "tensorrt"
            raise BackendError(f"backend {self.name!r} needs {', '.join(sorted(missing))}, which this onnxruntime "
                               f"lacks: pip install 'specedge[{extra}]' on a machine with an NVIDIA GPU")
        return providers

    def add_weights_file(self, path: str, index: dict[str, WeightRef]) -> None:
        if path in self._weights:
            return
        mapped, tensors = map_weights(path, index)
        self._maps.append(mapped)
        # The session options do not keep these alive: we do, as long as the backend lives. The Python API
        # cannot wrap packed int4 bytes as an int4 OrtValue: those tensors ORT reads from the file itself.
        self._weights[path] = {n: self._ort.OrtValue.ortvalue_from_numpy(a) for n, a in tensors.items()
                               if not isinstance(a, PackedInt4)}

    def load(self, graph_path: str, weights_path: str, prepack: bool = True,
             config: dict[str, str] | None = None, int4_block: int | None = None) -> OrtSession:
        """`int4_block`: on the CPU, load the graph's int4 products in this smaller block (reblock.py; the model's
        kernel_probe.RowPlan says when)."""
        so = self.session_options(weights_path, prepack, config)
        try:
            source = graph_path
            block = int4_block if self.name == "ort" else None
            if block is not None:
                source = reblocked_graph(graph_path, block)
                so.add_session_config_entry(EXTERNAL_DATA_FOLDER, external_data_folder(graph_path))
            providers = [(p, _PROVIDER_OPTIONS[p]) if p in _PROVIDER_OPTIONS else p for p in self.providers]
            session = self._ort.InferenceSession(source, so, providers=providers)
        except Exception as e:
            raise BackendError(f"onnxruntime cannot load {graph_path}: {str(e).splitlines()[0]}") from None
        if self.providers[0] not in session.get_providers():
            # onnxruntime falls back to the next provider, with a warning only, when one cannot start (CUDA or
            # TensorRT libraries missing or of another version): a `cuda` run would quietly be a CPU run.
            raise PlacementError(f"backend {self.name!r}: onnxruntime could not start {self.providers[0]} for "
                                 f"{os.path.basename(graph_path)} (it fell back to {session.get_providers()[0]}); "
                                 "are the CUDA/TensorRT libraries onnxruntime-gpu needs installed?")
        return OrtSession(session, rebind_inputs=self.providers[0] in DEVICE_PROVIDERS,
                          name=os.path.basename(graph_path))

    def session_options(self, weights_path: str, prepack: bool = True, config: dict[str, str] | None = None):
        """Threads, the graph's session config and the shared weights of `weights_path` (add_weights_file)."""
        so = self._ort.SessionOptions()
        if self.threads:
            so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        for key, value in (config or {}).items():  # what the graph needs (quantized graphs: graphs/quant.py)
            so.add_session_config_entry(key, str(value))
        if not prepack:
            so.add_session_config_entry("session.disable_prepacking", "1")
        for name, value in self._weights[weights_path].items():  # names the graph does not use are ignored
            so.add_initializer(name, value)
        return so

    def release_raw_weights(self) -> None:
        """Call once all sessions exist: their packed weights are what they read now."""
        release_pages(self._maps)
        trim_heap()

    def release_lookup_pages(self) -> None:
        """Drop the mapped pages of the weights files (see CapiBackend's)."""
        release_pages(self._maps)

    def close(self) -> None:
        self._weights.clear()
        self._maps.clear()  # the mmaps close once no array refers to them
