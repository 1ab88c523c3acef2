"""Inference backends: run a bundle's step graphs over buffers the runtime owns.

Every backend has the same two-object shape:

  backend = create_backend("cpu", threads=2)
  backend.add_weights_file(path, index)          # one mmap per weights file, shared by all sessions
  session = backend.load(graph_path, path, prepack=True)   # a graph and the weights file it reads
  session.bind(inputs={name: array}, outputs={name: array})   # once: zero-copy views of runtime buffers
  session.run()                                  # per step: reads the inputs, writes the outputs in place

Backends:
  cpu       onnxruntime on the CPU through its C API (ort_capi): all sessions of a model share ONE copy of the
            prepacked weights, so a bundle with many step graphs costs about one model of memory. Falls back
            to `ort` when the C library cannot be found.
  ort       onnxruntime's Python API on the CPU; each prepacking session holds its own packed weights.
  cuda      onnxruntime-gpu with the CUDA execution provider (pip install 'specedge[cuda]').
  tensorrt  onnxruntime-gpu with the TensorRT execution provider (needs TensorRT libraries).
  qnn       onnxruntime-qnn: the QNN execution provider on a Qualcomm HTP, or its x86 emulator (qnn.py).
The GPU backends are provider choices over the same `ort` code path, with the cache in host memory (inputs
are bound again before each run: ort_python.DEVICE_PROVIDERS). CI has no GPU; `cuda` was checked once on an
H200 with tools/gpu_check.py (benchmarks/gpu/README.md), `tensorrt` never.
"""
from __future__ import annotations

import mmap
import numbers
import os

import numpy as np

from ...errors import BackendError, BundleError
from ...graphs.manifest import WeightRef
from ...graphs.quant import PackedInt4, int4_nbytes

BACKENDS = ("cpu", "ort", "cuda", "tensorrt", "qnn")


# Tensors up to this size are copied out of the weights file when it is mapped: norm weights and biases,
# which every step reads whole (SmolLM2: 61 norms of 2.3 KB). The weights file sits around them, and on a
# kernel that caches files in large folios (ext4 on Linux 6.18 here) each such read maps the whole folio
# around it: the norms' reads kept about 60 MB of SmolLM2 int4's quantized weights, which the packed
# sessions never read, resident after a single decode step. Larger tensors stay views: the weight products,
# which a copy would only duplicate, and the tables that steps look rows up in (embedding, RoPE).
PRIVATE_MAX_BYTES = 64 << 10


def map_weights(path: str, index: dict[str, WeightRef]) -> tuple[mmap.mmap, dict[str, np.ndarray | PackedInt4]]:
    """Read-only views of every indexed tensor over one mmap of the weights file (no copy, no read); int4
    tensors come as PackedInt4 over their packed bytes. Float and int8 tensors of at most PRIVATE_MAX_BYTES
    are private copies instead."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise BundleError(f"weights file missing: {path}") from None
    except OSError as e:  # a directory, no permission
        raise BundleError(f"weights file {path} cannot be read ({e.strerror or e})") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        for name, ref in index.items():  # read_index checked each entry (offsets, lengths >= 0); here they must
            if ref.offset + ref.length > size:  # lie inside the file
                need = max(r.offset + r.length for r in index.values())
                raise BundleError(f"weights file {path} is truncated: {size} bytes, the index needs {need} (entry "
                                  f"{name}: offset {ref.offset}, length {ref.length})")
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise BundleError(f"weights file {path} is empty") from None
    tensors = {}
    for name, ref in index.items():
        if ref.dtype == "int4":
            if ref.length != int4_nbytes(ref.shape):
                raise BundleError(f"weights index entry {name}: {ref.length} bytes do not hold int4{list(ref.shape)}")
            packed = np.frombuffer(mapped, dtype=np.uint8, count=ref.length, offset=ref.offset)
            tensors[name] = PackedInt4(packed, tuple(ref.shape))
            continue
        try:
            dtype = np.dtype(ref.dtype)
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in "biuf":  # "object" or "S" would fail in frombuffer, or divide by 0
            raise BundleError(f"weights index entry {name}: unknown dtype {ref.dtype!r}")
        count = ref.length // dtype.itemsize
        if count != int(np.prod(ref.shape)):
            raise BundleError(f"weights index entry {name}: {ref.length} bytes do not hold {ref.dtype}{list(ref.shape)}")
        view = np.frombuffer(mapped, dtype=dtype, count=count, offset=ref.offset).reshape(ref.shape)
        tensors[name] = view.copy() if ref.length <= PRIVATE_MAX_BYTES else view
    return mapped, tensors


def release_pages(maps: list[mmap.mmap]) -> None:
    """Drop the resident pages of mapped weights files (Linux madvise DONTNEED; a no-op elsewhere).

    Once every session has packed its MatMul/Gemm weights, the raw pages are not read again (onnxruntime
    keeps the packed copy); what is still read (embedding rows, norms) faults back in from the page cache.
    Without this the raw weights stay counted in RSS next to their packed copy."""
    for m in maps:
        if hasattr(mmap, "MADV_DONTNEED"):
            m.madvise(mmap.MADV_DONTNEED)


class DroppingPages:
    """While a session is created, drop the weights files' resident pages every `interval` seconds.

    onnxruntime reads the raw weights once, to prepack (or, for a quantized graph, to transpose) them into
    memory it owns. Without this the whole raw file is resident next to that copy until the last session
    exists: a float32 model peaked at about twice its size. The mappings are read-only and file-backed, so a
    dropped page that onnxruntime is still reading faults back in from the page cache with the same bytes:
    dropping is always safe, it only bounds how many raw pages are resident at once. The session call runs
    without the GIL (ctypes), so a thread can do this concurrently.

    The interval bounds that transient. onnxruntime reads raw weights at several GB/s, so at a 20 ms interval
    about 100 MB of them were resident at a time, and a float32 SmolLM2 run had its peak there (900 MB; at
    1 ms, 810-867 MB: benchmarks/quant/README.md). A drop with nothing mapped costs about 4 us, so polling
    every 1 ms costs under 1% of a core."""

    def __init__(self, maps: list[mmap.mmap], interval: float = 0.001):
        import threading

        self._maps, self._interval = maps, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specedge-drop-pages", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            release_pages(self._maps)

    def __enter__(self) -> "DroppingPages":
        if self._maps and hasattr(mmap, "MADV_DONTNEED"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        release_pages(self._maps)
        trim_heap()  # the optimizer's scratch, freed but still mapped: measured ~30 MB per quantized session


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc malloc_trim). Creating a session frees a lot of graph-
    optimization scratch that glibc would otherwise keep mapped; measured: 18 sessions, -37 MB RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def create_backend(name: str = "cpu", threads: int | None = None):
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1):
        # onnxruntime reads 0 as its own default and quietly runs a negative count as that default too
        raise BackendError(f"threads must be at least 1, not {threads!r}")
    most = 8 * (os.cpu_count() or 1)
    if threads is not None and threads > most:  # onnxruntime starts them all: 100000 hung the process
        raise BackendError(f"threads {threads} is more than 8x this machine's {os.cpu_count()} cores ({most})")
    import importlib.util

    if importlib.util.find_spec("onnxruntime") is None:  # found, not imported: the C API path needs no Python API
        raise BackendError("onnxruntime is not installed: pip install onnxruntime") from None
    if name == "qnn":
        from .qnn import QnnBackend
        return QnnBackend(threads)
    if name == "cpu":
        from . import ort_capi
        if ort_capi.available():
            from .cpu import CapiBackend
            return CapiBackend(threads)
        name = "ort"
    from .ort_python import OrtBackend
    return OrtBackend(name, threads)
