"""A ctypes binding to the few onnxruntime C API calls that the Python API lacks: sessions sharing ONE prepacked
copy of the weights.

Why: the runtime runs several static-shape step graphs of one model (T=1 decode, T=9 verify, T=64 prefill...),
one session each. ORT's CPU MatMul needs its weights *prepacked* to be fast for more than one row, and every
Python `InferenceSession` packs a private copy: N sessions hold N packed copies of the model. The C API has an
`OrtPrepackedWeightsContainer`: sessions created with it (and fed the same weights via `AddInitializer`) keep a
single packed copy between them. The Python API does not expose it, so we call the C library that the wheel
ships (`onnxruntime/capi/libonnxruntime.so.*`) directly.

Usage:
    with Env(threads=4) as env:
        env.add_weights({name: view_of_memmap, ...})          # zero copy; shared by every session of env
        s = env.create_session("step_t9.onnx")
        s.bind({"ids": ids}, {"logits": logits})                # caller-owned buffers, bound once
        ids[:] = ...; s.run()                                   # ORT reads ids and writes logits in place

Only numpy, ctypes and the stdlib are used; onnxruntime's Python package is only *located* (not imported) to find
the shared library next to it.

What ORT does with this (measured with onnxruntime 1.32, see tools/capi_prepack_probe.py):
- Names registered but absent from a model are ignored. A weight whose shape differs from the model's declaration
  is NOT rejected at session creation (a wrong dtype is): shapes are the caller's contract.
- With every initializer supplied, ORT only stat()s a model's external-data file (it must exist) and never reads
  it, except for initializers that graph optimization constant-folds (e.g. Transpose/Cast of a weight): those are
  folded from the file's bytes, into a private copy per session.
- Once packed, the raw weights are not read again: madvise(MADV_DONTNEED) on the memmap returns their RSS.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import weakref
from ctypes import CFUNCTYPE, POINTER, byref, c_char_p, c_int, c_int64, c_size_t, c_uint32, c_void_p

import numpy as np

from ...graphs.quant import PackedInt4
from ..reblock import EXTERNAL_DATA_FOLDER, external_data_folder

# GetApi(N) hands out the function table as of API version N. 13 is the version of the header the indices below
# were read from (onnxruntime 1.13's include/onnxruntime/core/session/onnxruntime_c_api.h, commit 0017800f); every
# function used here exists there. Newer libraries (1.32 serves 1..32) keep old entries where they were.
ORT_API_VERSION = 13

# struct OrtApi is a table of function pointers, append-only across versions, so a function's position never
# changes. Indices were counted over every member of `struct OrtApi` in that header, in order (ORT_API2_STATUS
# entries, ORT_CLASS_RELEASE entries and plain function pointers alike). A wrong index calls the wrong function
# and usually segfaults: tests/test_ort_capi.py exercises every entry below.
_S, _P = c_void_p, c_void_p  # OrtStatus* (NULL = success) and any opaque pointer
_PP = POINTER(c_void_p)
_FUNCS = {  # name: (index, restype, argtypes)
    "GetErrorCode": (1, c_int, [_P]),
    "GetErrorMessage": (2, c_char_p, [_P]),
    "Run": (9, _S, [_P, _P, POINTER(c_char_p), _PP, c_size_t, POINTER(c_char_p), c_size_t, _PP]),
    "CreateSessionOptions": (10, _S, [_PP]),
    "SetSessionExecutionMode": (13, _S, [_P, c_int]),
    "SetSessionGraphOptimizationLevel": (23, _S, [_P, c_int]),
    "SetIntraOpNumThreads": (24, _S, [_P, c_int]),
    "SetInterOpNumThreads": (25, _S, [_P, c_int]),
    "SessionGetInputCount": (30, _S, [_P, POINTER(c_size_t)]),
    "SessionGetOutputCount": (31, _S, [_P, POINTER(c_size_t)]),
    "SessionGetInputTypeInfo": (33, _S, [_P, c_size_t, _PP]),
    "SessionGetOutputTypeInfo": (34, _S, [_P, c_size_t, _PP]),
    "SessionGetInputName": (36, _S, [_P, c_size_t, _P, _PP]),
    "SessionGetOutputName": (37, _S, [_P, c_size_t, _P, _PP]),
    "CreateTensorWithDataAsOrtValue": (49, _S, [_P, _P, c_size_t, POINTER(c_int64), c_size_t, c_int, _PP]),
    "CastTypeInfoToTensorInfo": (55, _S, [_P, _PP]),
    "GetTensorElementType": (60, _S, [_P, POINTER(c_int)]),
    "GetDimensionsCount": (61, _S, [_P, POINTER(c_size_t)]),
    "GetDimensions": (62, _S, [_P, POINTER(c_int64), c_size_t]),
    "CreateCpuMemoryInfo": (69, _S, [c_int, c_int, _PP]),
    "AllocatorFree": (76, _S, [_P, _P]),
    "GetAllocatorWithDefaultOptions": (78, _S, [_PP]),
    "ReleaseEnv": (92, None, [_P]),
    "ReleaseStatus": (93, None, [_P]),
    "ReleaseMemoryInfo": (94, None, [_P]),
    "ReleaseSession": (95, None, [_P]),
    "ReleaseValue": (96, None, [_P]),
    "ReleaseTypeInfo": (98, None, [_P]),
    "ReleaseSessionOptions": (100, None, [_P]),
    "CreateEnvWithGlobalThreadPools": (119, _S, [c_int, c_char_p, _P, _PP]),
    "DisablePerSessionThreads": (120, _S, [_P]),
    "CreateThreadingOptions": (121, _S, [_PP]),
    "ReleaseThreadingOptions": (122, None, [_P]),
    "AddSessionConfigEntry": (130, _S, [_P, c_char_p, c_char_p]),
    "CreateAndRegisterAllocator": (144, _S, [_P, _P, _P]),
    "SetGlobalIntraOpNumThreads": (147, _S, [_P, c_int]),
    "SetGlobalInterOpNumThreads": (148, _S, [_P, c_int]),
    "AddInitializer": (150, _S, [_P, c_char_p, _P]),
    "CreatePrepackedWeightsContainer": (166, _S, [_PP]),
    "ReleasePrepackedWeightsContainer": (167, None, [_P]),
    "CreateSessionWithPrepackedWeightsContainer": (168, _S, [_P, c_char_p, _P, _P, _PP]),
    "CreateSessionFromArrayWithPrepackedWeightsContainer": (169, _S, [_P, c_char_p, c_size_t, _P, _P, _PP]),
}

# ONNXTensorElementDataType <-> numpy. Types numpy lacks (string 8, bfloat16 16) get a name but cannot be bound.
_DTYPE_OF_ONNX = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 8: "string",
                  9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16"}
_ONNX_OF_DTYPE = {v: k for k, v in _DTYPE_OF_ONNX.items() if v not in ("string", "bfloat16")}
_ONNX_INT4 = 22  # packed two per byte; numpy has no such dtype (weights only, see PackedInt4)
_DTYPE_OF_ONNX[_ONNX_INT4] = "int4"
_OPT_LEVELS = {"disable": 0, "basic": 1, "extended": 2, "all": 99}  # GraphOptimizationLevel
# ERROR, as the Python backend's sessions: onnxruntime's warnings are about its own optimizer (a float16 graph on
# the CPU logged 30 lines of "can't constant fold Where node" per check); errors reach us as statuses anyway
_ORT_LOGGING_LEVEL_ERROR, _ORT_SEQUENTIAL, _ORT_ARENA_ALLOCATOR, _ORT_MEM_TYPE_DEFAULT = 3, 0, 1, 0


class CapiError(RuntimeError):
    """An onnxruntime call failed; the message is ORT's own (GetErrorMessage), `code` its OrtErrorCode."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


def _library_path() -> str | None:
    # find_spec locates the package without importing it: importing would load the Python bindings' own copy of
    # ORT (tens of MB) next to the one we use.
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.origin:
        return None
    capi = os.path.join(os.path.dirname(spec.origin), "capi")
    for pattern in ("libonnxruntime.so*", "libonnxruntime*.dylib", "onnxruntime.dll"):
        hits = sorted(glob.glob(os.path.join(capi, pattern)))
        if hits:
            return hits[-1]
    return None


class _Api:
    """The loaded library and its function table, as ctypes functions that raise CapiError on a failed status."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.OrtGetApiBase.restype = c_void_p
        base = ctypes.cast(self.lib.OrtGetApiBase(), POINTER(c_void_p))  # struct OrtApiBase {GetApi; GetVersionString}
        self.version = CFUNCTYPE(c_char_p)(base[1])().decode()
        table = CFUNCTYPE(c_void_p, c_uint32)(base[0])(ORT_API_VERSION)
        if not table:
            raise CapiError(f"onnxruntime {self.version} at {path} does not serve C API version {ORT_API_VERSION}")
        table = ctypes.cast(table, POINTER(c_void_p))
        for name, (index, restype, argtypes) in _FUNCS.items():
            fn = CFUNCTYPE(restype, *argtypes)(table[index])  # CFUNCTYPE releases the GIL during the call
            if restype is _S:
                fn.errcheck = self._check
            setattr(self, name, fn)
        allocator = c_void_p()
        self.GetAllocatorWithDefaultOptions(byref(allocator))  # process-wide; never freed
        self.allocator = allocator

    def _check(self, status, fn, args):
        if status:  # every non-NULL OrtStatus is read once and released here
            message = self.GetErrorMessage(status).decode(errors="replace")
            code = self.GetErrorCode(status)
            self.ReleaseStatus(status)
            raise CapiError(message, code)
        return status


_API: _Api | None = None


def _api() -> _Api:
    global _API
    if _API is None:
        path = _library_path()
        if path is None:
            raise CapiError("onnxruntime's shared library (onnxruntime/capi/libonnxruntime.*) was not found")
        try:
            _API = _Api(path)
        except (OSError, AttributeError) as e:  # not loadable, or no OrtGetApiBase in it
            raise CapiError(f"cannot use {path}: {e}") from e
    return _API


_POOL = {"threads": None, "usable": True}  # the process's global intra-op pool: its size, and whether it exists
_SHARED_ARENA = {"registered": False}  # one CPU arena in the OrtEnv that every session allocates from


def _create_env(api: _Api, threads: int | None, out: c_void_p) -> bool:
    """Get the process's OrtEnv, asking for one global intra-op thread pool; True if sessions should use it.

    Every session of a bundle (draft and target, all T and buckets) then runs on the same threads: private
    per-session pools spin waiting for work while another session runs, stealing the cores it needs (measured:
    a draft model alternating with the target ran 1.5x slower). ORT keeps one refcounted OrtEnv per process, so
    the pool exists only if this process's first env was created here (not, say, by onnxruntime's Python API):
    create_session finds out and falls back to private pools. An Env asking for a different thread count than
    the pool has also gets private pools."""
    options = c_void_p()
    api.CreateThreadingOptions(byref(options))
    try:
        api.SetGlobalIntraOpNumThreads(options, threads or 0)  # 0: ORT's default, one per physical core
        api.SetGlobalInterOpNumThreads(options, 1)
        api.CreateEnvWithGlobalThreadPools(_ORT_LOGGING_LEVEL_ERROR, b"specedge", options, byref(out))
    finally:
        api.ReleaseThreadingOptions(options)
    if _POOL["threads"] is None:
        _POOL["threads"] = threads or 0
    return _POOL["usable"] and _POOL["threads"] == (threads or 0)


def _share_arena(api: _Api, env: c_void_p, mem_info: c_void_p) -> bool:
    """Register one CPU arena allocator in the OrtEnv, for sessions created with session.use_env_allocators.

    Each session otherwise keeps an arena sized to its own peak activations; a bundle's sessions run one at
    a time, so one shared arena (sized to the largest step) holds what twenty private ones would."""
    if not _SHARED_ARENA["registered"]:
        try:
            api.CreateAndRegisterAllocator(env, mem_info, None)  # NULL arena config: ORT's defaults
        except CapiError as e:
            if "already" not in str(e).lower():  # registered earlier in this process: fine
                raise
        _SHARED_ARENA["registered"] = True
    return True


def available() -> bool:
    """True when the library is found and serves the API version we need."""
    try:
        _api()
        return True
    except CapiError:
        return False


def _tensor(api: _Api, mem_info: c_void_p, arr: np.ndarray | PackedInt4) -> c_void_p:
    """An OrtValue over `arr`'s own memory (no copy): the array must outlive the value."""
    if isinstance(arr, PackedInt4):
        data, dims, elem = arr.packed, arr.shape, _ONNX_INT4
    else:
        data, dims, elem = arr, arr.shape, _ONNX_OF_DTYPE[arr.dtype.name]
    shape = (c_int64 * max(len(dims), 1))(*dims)  # ORT copies the shape
    value = c_void_p()
    api.CreateTensorWithDataAsOrtValue(mem_info, data.ctypes.data, data.nbytes, shape, len(dims), elem, byref(value))
    return value


def _check_array(kind: str, name: str, arr, dtype: str | None = None, shape: tuple | None = None) -> None:
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{kind} {name!r}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype.name not in _ONNX_OF_DTYPE:
        raise ValueError(f"{kind} {name!r}: dtype {arr.dtype} has no ONNX tensor type here")
    if not (arr.flags.c_contiguous and arr.flags.aligned):
        raise ValueError(f"{kind} {name!r}: array must be C-contiguous and aligned (use np.ascontiguousarray)")
    if dtype is not None and arr.dtype.name != dtype:
        raise ValueError(f"{kind} {name!r}: dtype {arr.dtype.name}, the model wants {dtype}")
    if shape is not None and (len(shape) != arr.ndim or any(d >= 0 and d != a for d, a in zip(shape, arr.shape))):
        raise ValueError(f"{kind} {name!r}: shape {arr.shape}, the model wants {shape} (-1 = any)")


class _Closable:
    """Context manager and finalizer around close(), which must be idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: ctypes may already be gone
            pass


class Env(_Closable):
    """One OrtEnv and one OrtPrepackedWeightsContainer; the weights and packed weights its sessions share.

    ORT keeps a single refcounted OrtEnv per process (CreateEnv hands every Env the same one), so Envs differ only
    in their weights, containers and thread settings; each session owns its own intra-op thread pool."""

    def __init__(self, threads: int | None = None):
        self._api = api = _api()
        self.threads = threads
        self._env, self._container, self._mem_info = c_void_p(), c_void_p(), c_void_p()
        self._weights: dict[str, tuple[np.ndarray, c_void_p]] = {}  # name -> (array kept alive, its OrtValue)
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        try:
            self._global_pool = _create_env(api, threads, self._env)
            api.CreatePrepackedWeightsContainer(byref(self._container))
            api.CreateCpuMemoryInfo(_ORT_ARENA_ALLOCATOR, _ORT_MEM_TYPE_DEFAULT, byref(self._mem_info))
            self._shared_arena = _share_arena(api, self._env, self._mem_info)
        except BaseException:
            self.close()
            raise

    def _check_open(self) -> None:
        if not self._env:
            raise CapiError("Env is closed")

    def add_weights(self, tensors: dict[str, np.ndarray]) -> None:
        """Register initializers by name, zero copy (typically read-only views of one np.memmap). Every session
        created afterwards gets all of them via AddInitializer; the arrays are kept alive until close()."""
        self._check_open()
        for name, arr in tensors.items():
            _check_array("weight", name, arr.packed if isinstance(arr, PackedInt4) else arr)
            if name in self._weights:  # sessions may already point at the old OrtValue: replacing would be unsafe
                raise ValueError(f"weight {name!r} is already registered")
        for name, arr in tensors.items():
            self._weights[name] = (arr, _tensor(self._api, self._mem_info, arr))

    def has_weight(self, name: str) -> bool:
        return name in self._weights

    def create_session(self, model_path: str, prepack: bool = True, optimization_level: str = "all",
                       config: dict[str, str] | None = None, model: bytes | None = None) -> Session:
        """A session over `model_path` whose initializers come from add_weights() wherever the names match (ORT
        ignores registered names the model lacks) and whose packed weights live in this Env's container.
        `model`: the graph's serialized bytes, made from the file at `model_path` (whose folder holds what its
        external data points at), to be run instead of the file."""
        self._check_open()
        if optimization_level not in _OPT_LEVELS:
            raise ValueError(f"optimization_level must be one of {sorted(_OPT_LEVELS)}, got {optimization_level!r}")
        args = (model_path, prepack, optimization_level)
        try:
            return self._create_session(*args, self._global_pool, config or {}, model)
        except CapiError as e:
            if not (self._global_pool and "CreateEnvWithGlobalThreadPools" in str(e)):
                raise
            _POOL["usable"] = self._global_pool = False  # the env predates us: no global pool to share
            return self._create_session(*args, False, config or {}, model)

    def _create_session(self, model_path: str, prepack: bool, optimization_level: str, global_pool: bool,
                        config: dict[str, str], model: bytes | None) -> Session:
        api = self._api
        options, session = c_void_p(), c_void_p()
        api.CreateSessionOptions(byref(options))
        try:
            if global_pool:
                api.DisablePerSessionThreads(options)
            else:
                if self.threads is not None:
                    api.SetIntraOpNumThreads(options, self.threads)
                api.SetInterOpNumThreads(options, 1)
                # Private pools of sessions that run in turn would spin against each other on a few cores.
                api.AddSessionConfigEntry(options, b"session.intra_op.allow_spinning", b"0")
            if self._shared_arena:
                api.AddSessionConfigEntry(options, b"session.use_env_allocators", b"1")
            for key, value in config.items():  # what the graph needs (quantized graphs: graphs/quant.py)
                api.AddSessionConfigEntry(options, key.encode(), str(value).encode())
            api.SetSessionExecutionMode(options, _ORT_SEQUENTIAL)
            api.SetSessionGraphOptimizationLevel(options, _OPT_LEVELS[optimization_level])
            if not prepack:
                api.AddSessionConfigEntry(options, b"session.disable_prepacking", b"1")
            for name, (_, value) in self._weights.items():
                api.AddInitializer(options, name.encode(), value)
            if model is None:
                api.CreateSessionWithPrepackedWeightsContainer(self._env, os.fsencode(model_path), options,
                                                               self._container, byref(session))
            else:
                folder = external_data_folder(model_path).encode()
                api.AddSessionConfigEntry(options, EXTERNAL_DATA_FOLDER.encode(), folder)
                api.CreateSessionFromArrayWithPrepackedWeightsContainer(self._env, model, len(model), options,
                                                                        self._container, byref(session))
        finally:
            api.ReleaseSessionOptions(options)  # the session keeps its own copy
        s = Session(self, session)
        self._sessions.add(s)
        return s

    def close(self) -> None:
        """Release sessions first (they use the container and the weights), then weights, container, env."""
        api = self._api
        for s in list(self._sessions):
            s.close()
        for _, value in self._weights.values():
            api.ReleaseValue(value)
        self._weights.clear()
        for release, handle in ((api.ReleasePrepackedWeightsContainer, self._container),
                                (api.ReleaseMemoryInfo, self._mem_info), (api.ReleaseEnv, self._env)):
            if handle:
                release(handle)
                handle.value = None



class Session(_Closable):
    """One ORT session with caller-owned input/output buffers bound once (see bind) and run in place."""

    def __init__(self, env: Env, handle: c_void_p):
        self._env, self._api, self._handle = env, env._api, handle  # holding env keeps weights/container alive
        self._bound: list[np.ndarray] = []
        self._values: list[c_void_p] = []
        self._run_args = None
        self.inputs = self._metadata(self._api.SessionGetInputCount, self._api.SessionGetInputName,
                                     self._api.SessionGetInputTypeInfo)
        self.outputs = self._metadata(self._api.SessionGetOutputCount, self._api.SessionGetOutputName,
                                      self._api.SessionGetOutputTypeInfo)

    def _metadata(self, get_count, get_name, get_type_info) -> list[tuple[str, str, tuple[int, ...]]]:
        api, result, count = self._api, [], c_size_t()
        get_count(self._handle, byref(count))
        for i in range(count.value):
            name_ptr = c_void_p()
            get_name(self._handle, i, api.allocator, byref(name_ptr))
            try:
                name = ctypes.string_at(name_ptr).decode()
            finally:
                api.AllocatorFree(api.allocator, name_ptr)  # the name was allocated for us
            type_info, tensor_info = c_void_p(), c_void_p()
            get_type_info(self._handle, i, byref(type_info))
            try:
                api.CastTypeInfoToTensorInfo(type_info, byref(tensor_info))  # owned by type_info
                if not tensor_info:
                    raise CapiError(f"{name!r} is not a tensor (sequences/maps are not supported)")
                elem, ndim = c_int(), c_size_t()
                api.GetTensorElementType(tensor_info, byref(elem))
                api.GetDimensionsCount(tensor_info, byref(ndim))
                dims = (c_int64 * max(ndim.value, 1))()
                api.GetDimensions(tensor_info, dims, ndim.value)  # symbolic dims come back as -1
            finally:
                api.ReleaseTypeInfo(type_info)
            result.append((name, _DTYPE_OF_ONNX.get(elem.value, f"onnx_type_{elem.value}"), tuple(dims[:ndim.value])))
        return result

    def bind(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        """Wrap caller-owned arrays in OrtValues once (zero copy). run() then reads `inputs` and writes `outputs` in
        place: mutate the arrays between runs, never rebind them to new objects. Every model input is required;
        outputs may be any non-empty subset. The Session keeps the arrays alive until the next bind or close."""
        if not self._handle:
            raise CapiError("Session is closed")
        for kind, given, wanted in (("input", inputs, self.inputs), ("output", outputs, self.outputs)):
            names = {name for name, _, _ in wanted}
            unknown, missing = sorted(set(given) - names), sorted(names - set(given))
            if unknown:
                raise ValueError(f"unknown {kind}(s) {unknown}; the model has {sorted(names)}")
            if missing if kind == "input" else not given:  # all inputs; at least one output
                raise ValueError(f"missing {kind}(s) {missing}")
            for name, dtype, shape in wanted:
                if name in given:
                    _check_array(kind, name, given[name], dtype, shape)
                    if kind == "output" and not given[name].flags.writeable:
                        raise ValueError(f"output {name!r}: array is read-only")
        self._unbind()
        in_names = [n for n, _, _ in self.inputs]
        out_names = [n for n, _, _ in self.outputs if n in outputs]
        arrays = [inputs[n] for n in in_names] + [outputs[n] for n in out_names]
        try:
            for arr in arrays:
                self._values.append(_tensor(self._api, self._env._mem_info, arr))
        except BaseException:
            self._unbind()
            raise
        self._bound = arrays
        n_in, n_out = len(in_names), len(out_names)
        # Run's argument arrays, built once so that run() is a single foreign call.
        self._run_args = ((c_char_p * n_in)(*(n.encode() for n in in_names)),
                          (c_void_p * n_in)(*(v.value for v in self._values[:n_in])), n_in,
                          (c_char_p * n_out)(*(n.encode() for n in out_names)), n_out,
                          (c_void_p * n_out)(*(v.value for v in self._values[n_in:])))

    def run(self) -> None:
        """One OrtApi::Run over the bound buffers; ORT writes the outputs into the bound output arrays."""
        if self._run_args is None:
            raise CapiError("Session.run() before bind()" if self._handle else "Session is closed")
        in_names, in_values, n_in, out_names, n_out, out_values = self._run_args
        self._api.Run(self._handle, None, in_names, in_values, n_in, out_names, n_out, out_values)

    def _unbind(self) -> None:
        self._run_args = None
        for value in self._values:
            self._api.ReleaseValue(value)
        self._values, self._bound = [], []

    def close(self) -> None:
        if self._handle:
            self._api.ReleaseSession(self._handle)
            self._handle = c_void_p()
        self._unbind()
        self._env._sessions.discard(self)

