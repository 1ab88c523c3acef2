"""Measure what sharing prepacked weights across onnxruntime sessions buys (developer tool; prints tables).

A synthetic model of `layers` x ([d x ff] and [ff x d]) float32 MatMuls (~425 MB at the defaults) is written to one
raw weights file, plus one static-shape .onnx per M (rows per run, like the T=1 / T=9 / T=64 step graphs) that
points at it as external data. Each mode then runs in a fresh subprocess, creating one session per M:

  python     onnxruntime's Python API, weights via SessionOptions.add_initializer from an np.memmap of the file
             (default prepacking: every session packs its own copy)
  capi       specedge.runtime.backends.ort_capi.Env: the same memmap via AddInitializer, one shared
             OrtPrepackedWeightsContainer
  capi_nopack  the same with "session.disable_prepacking" (the cost of not packing at all)
  decoy      capi, but the .onnx files' external data points at a NaN-filled decoy file: does ORT read it?
  A+B        two of the above in one process, timed alternately run by run (a fair speed comparison on a busy
             machine), e.g. python+capi, capi+capi_nopack

and reports VmRSS / RssAnon / RssFile (/proc/self/status) after each session, the mean ms per run for each M, and
RssFile after madvise(MADV_DONTNEED) on the memmap followed by more runs (does ORT still read the raw weights once
they are packed?).

    python -m specedge.tools.capi_prepack_probe [--layers 30 --d 576 --ff 3072 --ms 1,9,64 --threads 2]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

MODES = ("python", "capi", "capi_nopack", "decoy", "python+capi", "capi+capi_nopack")


def _names(layers: int) -> list[str]:
    return [f"l{i}.{kind}" for i in range(layers) for kind in ("up", "down")]


def build(d: str, layers: int, dm: int, ff: int, ms: list[int]) -> None:
    """weights.bin (random, scaled so activations stay O(1)), decoy.bin (NaNs, same size), step_M[_decoy].onnx."""
    import onnx
    from onnx import TensorProto, helper

    from specedge.graphs.external_data import point_at_file

    rng = np.random.default_rng(0)
    shapes = {n: ((dm, ff) if n.endswith("up") else (ff, dm)) for n in _names(layers)}
    offsets, offset = {}, 0
    with open(os.path.join(d, "weights.bin"), "wb") as f:
        for n, shape in shapes.items():
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / np.sqrt(shape[0]))
            f.write(w.tobytes())
            offsets[n], offset = offset, offset + w.nbytes
    with open(os.path.join(d, "decoy.bin"), "wb") as f:
        chunk = np.full(1 << 20, np.nan, np.float32).tobytes()
        for _ in range(-(-offset // len(chunk))):
            f.write(chunk)
        f.truncate(offset)
    for location, suffix in (("weights.bin", ""), ("decoy.bin", "_decoy")):
        inits = []
        for n, shape in shapes.items():
            t = TensorProto(name=n, data_type=TensorProto.FLOAT, dims=shape)
            inits.append(point_at_file(t, location, offsets[n], 4 * shape[0] * shape[1]))
        for m in ms:
            x, nodes = "x", []
            for i in range(layers):
                nodes += [helper.make_node("MatMul", [x, f"l{i}.up"], [f"h{i}"]),
                          helper.make_node("MatMul", [f"h{i}", f"l{i}.down"], [f"x{i}"])]
                x = f"x{i}"
            nodes.append(helper.make_node("Identity", [x], ["y"]))
            graph = helper.make_graph(nodes, f"probe_{m}",
                                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, dm])],
                                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, dm])], inits)
            onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                      os.path.join(d, f"step_{m}{suffix}.onnx"))
    with open(os.path.join(d, "index.json"), "w") as f:
        json.dump({"shapes": shapes, "offsets": offsets, "size": offset}, f)


def _mem() -> dict[str, float]:
    """VmRSS / RssAnon / RssFile in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) / 1024
    return out


def _python_sessions(d: str, weights: dict, xs: dict, threads: int, steps: list, keep: list) -> dict:
    """Python API sessions, one per M; returns {M: (run, y)} with y a preallocated output (IOBinding)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    values = {n: ort.OrtValue.ortvalue_from_numpy(w) for n, w in weights.items()}
    keep.append(values)  # add_initializer does not keep the OrtValues alive: they must outlive the sessions
    for n, v in values.items():
        so.add_initializer(n, v)
    steps.append(("python: weights added", _mem()))
    runs = {}
    for m, x in xs.items():
        t0 = time.perf_counter()
        sess = ort.InferenceSession(os.path.join(d, f"step_{m}.onnx"), so, providers=["CPUExecutionProvider"])
        steps.append((f"python: session M={m} ({time.perf_counter() - t0:.1f}s)", _mem()))
        y = np.zeros_like(x)
        binding = sess.io_binding()
        binding.bind_cpu_input("x", x)
        binding.bind_output("y", "cpu", 0, np.float32, y.shape, y.ctypes.data)
        keep.append(sess)
        runs[m] = (lambda s=sess, b=binding: s.run_with_iobinding(b)), y
    return runs


def _capi_sessions(d: str, weights: dict, xs: dict, threads: int, steps: list, keep: list, mode: str) -> dict:
    """ort_capi sessions, one per M, sharing one Env (one prepacked-weights container); returns {M: (run, y)}."""
    from specedge.runtime.backends import ort_capi

    env = ort_capi.Env(threads=threads)
    env.add_weights(weights)
    keep.append(env)
    steps.append((f"{mode}: weights added", _mem()))
    runs = {}
    for m, x in xs.items():
        t0 = time.perf_counter()
        sess = env.create_session(os.path.join(d, f"step_{m}{'_decoy' if mode == 'decoy' else ''}.onnx"),
                                  prepack=mode != "capi_nopack")
        steps.append((f"{mode}: session M={m} ({time.perf_counter() - t0:.1f}s)", _mem()))
        y = np.zeros_like(x)
        sess.bind({"x": x}, {"y": y})
        keep.append(sess)
        runs[m] = sess.run, y
    return runs


def child(d: str, mode: str, ms: list[int], threads: int, runs: int) -> dict:
    index = json.load(open(os.path.join(d, "index.json")))
    mm = np.memmap(os.path.join(d, "weights.bin"), dtype=np.float32, mode="r")
    weights = {n: mm[o // 4:o // 4 + shape[0] * shape[1]].reshape(shape)
               for (n, shape), o in zip(index["shapes"].items(), index["offsets"].values())}
    rng = np.random.default_rng(1)
    xs = {m: rng.standard_normal((m, weights["l0.up"].shape[0]), dtype=np.float32) for m in ms}
    steps, keep = [("start", _mem())], []
    # "a+b": both kinds of sessions in one process, timed alternately run by run, so that load from other
    # processes hits both alike (the fair speed comparison on a busy machine).
    kinds = mode.split("+")
    sessions = {k: _python_sessions(d, weights, xs, threads, steps, keep) if k == "python"
                else _capi_sessions(d, weights, xs, threads, steps, keep, k) for k in kinds}
    times = {k: {m: [] for m in ms} for k in kinds}
    for m in ms:
        for k in kinds:
            for _ in range(2):  # warm-up
                sessions[k][m][0]()
        for _ in range(runs):
            for k in kinds:
                t0 = time.perf_counter()
                sessions[k][m][0]()
                times[k][m].append((time.perf_counter() - t0) * 1e3)
    outputs = {k: {m: y.copy() for m, (_, y) in sessions[k].items()} for k in kinds}
    steps.append(("after timed runs", _mem()))
    mm._mmap.madvise(mmap.MADV_DONTNEED)  # drop our mapping's pages (they stay in the page cache)
    steps.append(("madvise(DONTNEED)", _mem()))
    same = True
    for k in kinds:
        for m, (run, y) in sessions[k].items():
            y.fill(0)
            for _ in range(3):
                run()
            same &= bool(np.array_equal(y, outputs[k][m]))
    steps.append(("3 runs per M after madvise", _mem()))
    maps = open("/proc/self/maps").read()
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    errs = {}
    for m in ms:  # the same chain of MatMuls in numpy (after all memory readings: this reads the file again)
        x = xs[m]
        for i in range(len(weights) // 2):
            x = x @ weights[f"l{i}.up"] @ weights[f"l{i}.down"]
        errs[m] = max(float(np.max(np.abs(outputs[k][m] - x)) / np.max(np.abs(x))) for k in kinds)
    return {"mode": mode, "steps": steps, "same_after_madvise": same, "rel_err_vs_numpy": max(errs.values()),
            "ms": {k: {m: (float(np.mean(t)), float(np.median(t))) for m, t in times[k].items()} for k in kinds},
            "maps": {f: maps.count(os.path.join(d, f)) for f in ("weights.bin", "decoy.bin")},
            "files_open": sorted({os.path.basename(f) for f in fds if f.startswith(d)})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--d", type=int, default=576)
    p.add_argument("--ff", type=int, default=3072)
    p.add_argument("--ms", default="1,9,64")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dir", help="reuse/keep the model files here (default: a temp dir, removed)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="also print the raw reports")
    a = p.parse_args()
    ms = [int(m) for m in a.ms.split(",")]
    if a.child:
        print(json.dumps(child(a.dir, a.child, ms, a.threads, a.runs)))
        return
    tmp = None if a.dir else tempfile.TemporaryDirectory(prefix="capi_probe_")
    d = a.dir or tmp.name
    os.makedirs(d, exist_ok=True)
    if not os.path.exists(os.path.join(d, "index.json")):
        t0 = time.perf_counter()
        build(d, a.layers, a.d, a.ff, ms)
        print(f"built {os.path.getsize(os.path.join(d, 'weights.bin')) / 2**20:.0f} MB of weights in "
              f"{time.perf_counter() - t0:.0f}s under {d}")
    reports = []
    for mode in a.modes.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--dir", d, "--ms", a.ms,
               "--threads", str(a.threads), "--runs", str(a.runs)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{mode}: failed (rc {out.returncode})\n{out.stderr[-2000:]}")
            continue
        reports.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"\nmemory (MB), {a.threads} intra-op threads")
    print(f"{'mode':16} {'step':38} {'VmRSS':>7} {'RssAnon':>7} {'RssFile':>7}")
    for r in reports:
        for step, mem in r["steps"]:
            print(f"{r['mode']:16} {step:38} {mem['VmRSS']:7.0f} {mem['RssAnon']:7.0f} {mem['RssFile']:7.0f}")
    print(f"\nms per run, mean / median of {a.runs} runs after 2 warm-up")
    print(f"{'mode':16} {'sessions':12}" + "".join(f"{'M=' + str(m):>15}" for m in ms)
          + "  same after madvise  rel err vs numpy  mappings weights.bin/decoy.bin  files open")
    for r in reports:
        for k, by_m in r["ms"].items():
            print(f"{r['mode']:16} {k:12}" + "".join(f"{by_m[str(m)][0]:8.1f} /{by_m[str(m)][1]:6.1f}" for m in ms)
                  + f"  {str(r['same_after_madvise']):18}  {r['rel_err_vs_numpy']:.1e}"
                  + f"           {r['maps']['weights.bin']}/{r['maps']['decoy.bin']}{'':22}{r['files_open']}")
    if a.json:
        print(json.dumps(reports, indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
