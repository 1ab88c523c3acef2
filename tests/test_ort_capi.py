"""Tests of the ctypes binding to onnxruntime's C API (specedge.runtime.backends.ort_capi).

The models are built here with onnx.helper: a few MatMul/Add/Gemm layers over named initializers whose bytes sit in
ONE raw weights file (the .onnx files point at it as external data, as the exporter's step graphs do), one model per
token count T. The binding gets the same weights as read-only views of an np.memmap of that file.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from specedge.graphs.external_data import point_at_file  # noqa: E402
from specedge.runtime.backends import ort_capi as oc  # noqa: E402

if not oc.available():
    pytest.skip("onnxruntime's shared library (C API) is not available", allow_module_level=True)


def test_the_default_backend_is_the_c_api_one():
    """`cpu` falls back to onnxruntime's Python API when the C library is missing; where it is installed (CI),
    the default must be the C API backend, which shares one copy of the packed weights between sessions."""
    from specedge.runtime.backends import create_backend
    from specedge.runtime.backends.cpu import CapiBackend

    backend = create_backend("cpu", threads=1)
    try:
        assert isinstance(backend, CapiBackend)
    finally:
        backend.close()

D, H, O, VOCAB = 16, 32, 8, 50
TS = (1, 3, 8)


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "emb": rng.standard_normal((VOCAB, D), dtype=np.float32),
        "w1": rng.standard_normal((D, H), dtype=np.float32) / np.float32(np.sqrt(D)),
        "b1": rng.standard_normal(H, dtype=np.float32),
        "w2": rng.standard_normal((O, H), dtype=np.float32) / np.float32(np.sqrt(H)),  # Gemm with transB=1
        "b2": rng.standard_normal(O, dtype=np.float32),
        "w3": rng.standard_normal((O, O), dtype=np.float32) / np.float32(np.sqrt(O)),
    }


def _reference(w: dict[str, np.ndarray], ids: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.maximum((w["emb"][ids] + x) @ w["w1"] + w["b1"], 0)
    return (h @ w["w2"].T + w["b2"]) @ w["w3"], h


def _write_weights(path: str, w: dict[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """All tensors in one raw file, 64-byte aligned; returns name -> (offset, length)."""
    where, offset = {}, 0
    with open(path, "wb") as f:
        for name, arr in w.items():
            offset = -(-offset // 64) * 64
            f.seek(offset)
            f.write(arr.tobytes())
            where[name] = (offset, arr.nbytes)
            offset += arr.nbytes
    return where


def _initializer(name: str, arr: np.ndarray, location: str, offset: int, length: int) -> TensorProto:
    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype), dims=arr.shape)
    return point_at_file(t, location, offset, length)


def _step_model(path: str, T, w: dict[str, np.ndarray], where: dict, location: str) -> None:
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"]),
        helper.make_node("Add", ["e", "x"], ["ex"]),
        helper.make_node("MatMul", ["ex", "w1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["h"]),
        helper.make_node("Gemm", ["h", "w2", "b2"], ["g"], transB=1),
        helper.make_node("MatMul", ["g", "w3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, f"step_{T}",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [T]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, O]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, [T, H])],
        [_initializer(n, a, location, *where[n]) for n, a in w.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("capi")
    w = _weights()
    where = _write_weights(str(d / "weights.bin"), w)
    for T in TS:
        _step_model(str(d / f"step_{T}.onnx"), T, w, where, "weights.bin")
    _step_model(str(d / "step_sym.onnx"), "T", w, where, "weights.bin")
    mm = np.memmap(d / "weights.bin", dtype=np.uint8, mode="r")
    views = {n: mm[o:o + n_].view(w[n].dtype).reshape(w[n].shape) for n, (o, n_) in where.items()}
    return {"dir": d, "w": w, "views": views, "where": where, "path": lambda T: str(d / f"step_{T}.onnx")}


def _buffers(T: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, T).astype(np.int64)
    x = rng.standard_normal((T, D), dtype=np.float32)
    return ids, x, np.zeros((T, O), np.float32), np.zeros((T, H), np.float32)


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("prepack,level", [(True, "all"), (False, "all"), (True, "disable"), (True, "basic")])
def test_matches_numpy_and_python_ort(model, T, prepack, level):
    import onnxruntime as ort  # only as a reference

    ids, x, y, h = _buffers(T)
    with oc.Env(threads=1) as env:
        env.add_weights(model["views"])
        s = env.create_session(model["path"](T), prepack=prepack, optimization_level=level)
        s.bind({"ids": ids, "x": x}, {"y": y, "h": h})
        s.run()
    y_ref, h_ref = _reference(model["w"], ids, x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)
    # The Python API, reading the same weights from the model's external data file.
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    py = ort.InferenceSession(model["path"](T), so, providers=["CPUExecutionProvider"])
    y_py, h_py = py.run(["y", "h"], {"ids": ids, "x": x})
    np.testing.assert_allclose(y, y_py, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h, h_py, rtol=1e-5, atol=1e-5)


def test_metadata(model):
    with oc.Env() as env:
        env.add_weights(model["views"])
        s = env.create_session(model["path"](3))
        assert s.inputs == [("ids", "int64", (3,)), ("x", "float32", (3, D))]
        assert s.outputs == [("y", "float32", (3, O)), ("h", "float32", (3, H))]
        sym = env.create_session(str(model["dir"] / "step_sym.onnx"))
        assert sym.inputs == [("ids", "int64", (-1,)), ("x", "float32", (-1, D))]
        for T in (2, 5):  # a symbolic dim accepts any size
            ids, x, y, h = _buffers(T)
            sym.bind({"ids": ids, "x": x}, {"y": y})  # a subset of the outputs is fine
            sym.run()
            np.testing.assert_allclose(y, _reference(model["w"], ids, x)[0], rtol=1e-5, atol=1e-5)


def test_one_env_many_sessions_in_place_runs(model):
    """The runtime's pattern: one Env, one session per T, buffers bound once and mutated in place between runs."""
    with oc.Env(threads=2) as env:
        env.add_weights(model["views"])
        steps = {}
        for T in TS:
            bufs = _buffers(T)
            s = env.create_session(model["path"](T))
            s.bind({"ids": bufs[0], "x": bufs[1]}, {"y": bufs[2], "h": bufs[3]})
            steps[T] = (s, bufs)
        rng = np.random.default_rng(7)
        for _ in range(4):
            for T, (s, (ids, x, y, h)) in steps.items():
                ids[:] = rng.integers(0, VOCAB, T)
                x[...] = rng.standard_normal((T, D), dtype=np.float32)
                y.fill(np.nan)
                s.run()
                y_ref, h_ref = _reference(model["w"], ids, x)
                np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)


def test_bad_inputs(model):
    with oc.Env() as env:
        env.add_weights(model["views"])
        s = env.create_session(model["path"](3))
        ids, x, y, h = _buffers(3)
        cases = [
            ({"ids": ids.astype(np.int32), "x": x}, {"y": y}, "dtype int32, the model wants int64"),
            ({"ids": ids, "x": x[:2]}, {"y": y}, "shape (2, 16), the model wants (3, 16)"),
            ({"ids": ids, "x": x[None]}, {"y": y}, "the model wants (3, 16)"),
            ({"ids": ids}, {"y": y}, "missing input(s) ['x']"),
            ({"ids": ids, "x": x, "z": x}, {"y": y}, "unknown input(s) ['z']"),
            ({"ids": ids, "x": x}, {}, "missing output(s)"),
            ({"ids": ids, "x": x}, {"logits": y}, "unknown output(s) ['logits']"),
            ({"ids": ids, "x": np.asfortranarray(np.ones((3, D), np.float32))}, {"y": y}, "C-contiguous"),
            ({"ids": ids, "x": x.tolist()}, {"y": y}, "expected a numpy array"),
            ({"ids": ids, "x": x}, {"y": np.zeros((3, O), np.float64)}, "dtype float64, the model wants float32"),
        ]
        ro = y.copy()
        ro.flags.writeable = False
        cases.append(({"ids": ids, "x": x}, {"y": ro}, "read-only"))
        for inputs, outputs, message in cases:
            with pytest.raises((ValueError, oc.CapiError), match=re.escape(message)):
                s.bind(inputs, outputs)
        with pytest.raises(oc.CapiError, match="before bind"):
            s.run()
        with pytest.raises(ValueError, match="optimization_level"):
            env.create_session(model["path"](3), optimization_level="max")
        with pytest.raises(ValueError, match="already registered"):
            env.add_weights({"w1": model["views"]["w1"]})
        with pytest.raises(ValueError, match="no ONNX tensor type"):
            env.add_weights({"s": np.array(["a"])})
        # ORT's own errors come back as CapiError with ORT's message (GetErrorMessage) and code.
        with pytest.raises(oc.CapiError, match="nope.onnx") as err:
            env.create_session(str(model["dir"] / "nope.onnx"))
        assert err.value.code not in (None, 0)


def test_weights_come_from_add_weights_and_extra_names_are_ignored(model):
    """ORT uses the AddInitializer values (not the file's bytes) and ignores registered names a model lacks."""
    ids, x, y, h = _buffers(8)
    doubled = {n: a * 2 for n, a in model["w"].items()}
    with oc.Env() as env:
        env.add_weights(doubled)
        env.add_weights({"not_in_the_model": np.zeros(3, np.float32)})
        s = env.create_session(model["path"](8))
        s.bind({"ids": ids, "x": x}, {"y": y, "h": h})
        s.run()
    np.testing.assert_allclose(y, _reference(doubled, ids, x)[0], rtol=1e-5, atol=1e-5)


def test_two_envs_coexist(model):
    ids, x, y1, _ = _buffers(3)
    y2 = np.zeros_like(y1)
    doubled = {n: a * 2 for n, a in model["w"].items()}
    env1, env2 = oc.Env(threads=1), oc.Env(threads=1)
    env1.add_weights(model["views"])
    env2.add_weights(doubled)
    s1, s2 = env1.create_session(model["path"](3)), env2.create_session(model["path"](3))
    s1.bind({"ids": ids, "x": x}, {"y": y1})
    s2.bind({"ids": ids, "x": x}, {"y": y2})
    s1.run()
    s2.run()
    np.testing.assert_allclose(y1, _reference(model["w"], ids, x)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y2, _reference(doubled, ids, x)[0], rtol=1e-5, atol=1e-5)
    env1.close()  # the other Env is untouched
    y2.fill(0)
    s2.run()
    np.testing.assert_allclose(y2, _reference(doubled, ids, x)[0], rtol=1e-5, atol=1e-5)
    env2.close()


def test_close_is_idempotent(model):
    ids, x, y, _ = _buffers(1)
    env = oc.Env()
    env.add_weights(model["views"])
    s = env.create_session(model["path"](1))
    s.bind({"ids": ids, "x": x}, {"y": y})
    s.run()
    s.close()
    s.close()
    with pytest.raises(oc.CapiError, match="closed"):
        s.run()
    s2 = env.create_session(model["path"](1))
    env.close()  # closes its live sessions first
    env.close()
    with pytest.raises(oc.CapiError, match="closed"):
        s2.run()
    with pytest.raises(oc.CapiError, match="closed"):
        env.create_session(model["path"](1))
    s2.close()
    del env, s, s2  # __del__ after close is harmless


def test_dtypes(tmp_path):
    """Every mapped dtype goes through ORT and back (Identity: ORT copies into the preallocated outputs)."""
    dtypes = ["float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "uint16", "bool"]
    def info(name, d):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(d)), [2, 3])

    graph = helper.make_graph([helper.make_node("Identity", [f"in_{d}"], [f"out_{d}"]) for d in dtypes], "dtypes",
                              [info(f"in_{d}", d) for d in dtypes], [info(f"out_{d}", d) for d in dtypes])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "dtypes.onnx")
    with oc.Env() as env:
        s = env.create_session(str(tmp_path / "dtypes.onnx"))
        assert [dt for _, dt, _ in s.inputs] == dtypes
        ins = {f"in_{d}": (np.arange(6).reshape(2, 3) % 2 if d == "bool" else np.arange(6).reshape(2, 3)).astype(d)
               for d in dtypes}
        outs = {f"out_{d}": np.zeros((2, 3), d) for d in dtypes}
        s.bind(ins, outs)
        s.run()
        for d in dtypes:
            np.testing.assert_array_equal(outs[f"out_{d}"], ins[f"in_{d}"])


def test_every_api_entry_is_called(model):
    """A wrong index into the OrtApi table calls the wrong function: run a full flow (including a failing call)
    with every entry wrapped and check that each was called; the other tests check what they computed."""
    api = oc._api()
    called = set()

    def wrap(name, fn):
        def call(*args):
            called.add(name)
            return fn(*args)
        return call

    originals = {name: getattr(api, name) for name in oc._FUNCS}
    for name, fn in originals.items():
        setattr(api, name, wrap(name, fn))
    oc._SHARED_ARENA["registered"] = False  # registered once per process: make this flow register it again
    try:
        test_metadata(model)  # creates an Env, so the process's global pool exists
        pool_threads = oc._POOL["threads"]
        with oc.Env(threads=pool_threads + 1) as other:  # a thread count the global pool lacks: private pools
            other.add_weights(model["views"])
            other.create_session(model["path"](1))
        with oc.Env(threads=pool_threads or None) as env:  # the pool's own count: the global pool
            env.add_weights(model["views"])
            s = env.create_session(model["path"](1), prepack=False)
            with pytest.raises(oc.CapiError):
                env.create_session(str(model["dir"] / "nope.onnx"))
            with open(model["path"](1), "rb") as f:  # from bytes (a graph re-blocked at load, runtime/reblock.py)
                from_bytes = env.create_session(model["path"](1), model=f.read())
            for session in (s, from_bytes):
                ids, x, y, _ = _buffers(1)
                session.bind({"ids": ids, "x": x}, {"y": y})
                session.run()
                np.testing.assert_allclose(y, _reference(model["w"], ids, x)[0], rtol=1e-5, atol=1e-5)
    finally:
        for name, fn in originals.items():
            setattr(api, name, fn)
    # GetAllocatorWithDefaultOptions runs once when the library is loaded (before we could wrap it).
    assert set(oc._FUNCS) - called == {"GetAllocatorWithDefaultOptions"}
    assert api.allocator


def test_version():
    from importlib.metadata import version

    assert oc._api().version == version("onnxruntime")
    assert os.path.exists(oc._library_path())


def _resident_kb(address: int) -> int:
    """Resident kB of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("mapping not found")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_sessions_created_while_pages_are_dropped_compute_the_same(model):
    """DroppingPages drops the weights file's resident pages while onnxruntime reads them to prepack: the
    pages fault back in with the same bytes, so the session computes bit for bit what an undisturbed one
    does, and afterwards none of the file is resident."""
    import mmap

    from specedge.runtime.backends import DroppingPages

    path = str(model["dir"] / "weights.bin")
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    views = {n: np.ndarray(a.shape, a.dtype, buffer=mapped, offset=model["where"][n][0]) for n, a in model["w"].items()}
    outputs = []
    for dropping in (False, True):
        ids, x, y, h = _buffers(8, seed=3)
        with oc.Env(threads=1) as env:
            env.add_weights(views)
            if dropping:
                with DroppingPages([mapped], interval=1e-4):
                    s = env.create_session(model["path"](8))
                assert _resident_kb(np.frombuffer(mapped, np.uint8).ctypes.data) == 0
            else:
                s = env.create_session(model["path"](8))
            s.bind({"ids": ids, "x": x}, {"y": y, "h": h})
            s.run()
            outputs.append((y.copy(), h.copy()))
    assert all(np.array_equal(a, b) for a, b in zip(*outputs))
