"""The qnn-qdq16 flavour: a float32 bundle turned into QDQ graphs for Qualcomm's HTP (onnxruntime's QNN EP).

One job: calibrate and quantize the float32 step graphs that export_bundle has just written, in place.

* Calibration runs the float32 bundle itself through the specedge runtime (CPU, the `ort` backend) over real
  prompts (the prompt suite by default), teacher-forced: each prompt walks through the cache in turns of every
  graph of the model (prefill chunks and step graphs alike), so every (role, T) graph sees real feeds at many
  cache lengths. What each graph receives (input_ids, position_ids, cache_len, the valid slots of the past K/V)
  is recorded and becomes its CalibrationDataReader. A graph of a larger context bucket that the prompts did
  not reach reads the same samples with the past zero-padded (slots past cache_len are masked: any value is
  valid there).
* Every step graph of a model is built with the same nodes under the same names (build_step_graph same_ops:
  a one-token step scatters like a verify step), and each tensor gets one range, the union over all the
  model's graphs: a verify row is then quantized exactly like a decode step, and greedy speculation on the HTP
  equals plain greedy decoding there (tests/test_qnn_qdq.py). Per-graph scales broke that on the tiny model.
* ScatterElements runs on raw quantized values on the HTP: its data, updates and output share one range.
* onnxruntime.quantization (get_qnn_qdq_config + quantize_static, MinMax) writes QDQ graphs: uint16 activations,
  int8 symmetric weights (per output channel for every MatMul weight). The graph I/O stays float32 / int64
  (QuantizeLinear after each input, DequantizeLinear before each output): the contract and the runtime's
  buffers do not change. The quantizer is single-threaded Python, so graphs are quantized in parallel worker
  processes (export/qdq_worker.py); the result does not depend on how many.
* Range outliers: the additive attention mask shares its quantization scale with the masked scores (one Add),
  so the float graphs of this flavour are built with a mask of MASK_VALUE instead of the dtype's minimum (see
  graphs/llama.py). Softmax turns a hidden slot's score - |MASK_VALUE| into exp(-|MASK_VALUE| + ...) ~ 0.
* Weights: every graph quantizes the same float tensors to the same int8 values and scales (symmetric MinMax
  depends on the tensor only), so the large initializers of all graphs of a weights file are stored once, in a
  new weights file that replaces the float32 one, and the graphs refer to it as external data; per-graph
  activation scales (small) stay inside each graph.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np

from ..errors import ExportError
from ..graphs import contract as C

ACTIVATIONS = "uint16"
WEIGHTS = "int8"
MASK_VALUE = -100.0  # additive mask of hidden slots in the float graphs this flavour quantizes
DEFAULT_PROMPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "prompts",
                               "suite.jsonl")
DEFAULT_COUNT = 4  # prompts used for calibration
SAMPLES_PER_GRAPH = 24  # calibration feeds per graph (more only cost time: MinMax ranges settle quickly)
_STORE_MIN = 1024  # initializers with at least this many elements go to the shared weights file
MAX_JOBS = 4  # default_jobs' ceiling
MIN_REAL_RANGE = 1e-4  # get_qnn_qdq_config's MinimumRealRange: a weight channel's range is at least this
WORKER_PEAK = 2.2  # a quantizing worker's peak RSS / its model's float weights file (measured on SmolLM2: 2.17)
QUANTIZED = "q.onnx"  # what quantize_graph writes into its folder


@dataclass
class Calibration:
    prompts: str = DEFAULT_PROMPTS
    count: int = DEFAULT_COUNT
    samples_per_graph: int = SAMPLES_PER_GRAPH


# -- prompts ----------------------------------------------------------------------------------------------
def load_prompt_ids(path: str, tokenizer, count: int) -> list[list[int]]:
    """The first `count` prompts of a JSONL file ({"messages"} / {"prompt"} / {"prompt_ids"}), as token ids."""
    try:
        with open(path) as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        raise ExportError(f"cannot read the calibration prompts {path}: {e.strerror}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if len(out) == count:
            break
        try:
            item = json.loads(line)
        except ValueError:
            raise ExportError(f"{path}:{number}: not a JSON object") from None
        if isinstance(item, dict) and "prompt_ids" in item:
            out.append([int(t) for t in item["prompt_ids"]])
        elif tokenizer is None:
            raise ExportError("calibration needs the model's tokenizer to read text prompts, and the bundle has none")
        elif isinstance(item, dict) and "messages" in item:
            out.append(tokenizer.apply_chat_template(item["messages"]))
        elif isinstance(item, dict) and "prompt" in item:
            out.append(tokenizer.encode(item["prompt"]))
        else:
            raise ExportError(f"{path}:{number}: needs a 'messages', 'prompt' or 'prompt_ids' field")
    if not out:
        raise ExportError(f"{path} holds no prompts to calibrate with")
    return out


# -- recording what each graph receives ---------------------------------------------------------------------
class _RecordingSession:
    """A backend session that keeps a copy of its inputs at every run (the past trimmed to its valid slots)."""

    def __init__(self, session, sink: list):
        self._session = session
        self._sink = sink
        self.inputs, self.outputs = session.inputs, session.outputs
        self._inputs = None

    def bind(self, inputs, outputs):
        self._inputs = inputs
        self._session.bind(inputs, outputs)

    def run(self):
        n = int(self._inputs[C.CACHE_LEN].max())
        self._sink.append({k: (v[:, :, :n].copy() if k.startswith("past_") else v.copy())
                           for k, v in self._inputs.items()})
        self._session.run()

    def close(self):
        self._session.close()


class _RecordingBackend:
    def __init__(self, backend, samples: dict):
        self._backend = backend
        self.name = backend.name
        self.samples = samples  # (graph file name) -> [feeds]

    def load(self, graph_path, weights_path, prepack=True, config=None, int4_block=None):
        # No prepacking: this backend's sessions would each keep a packed copy of the float weights (16 SmolLM2
        # graphs: 8.8 GB, the export's peak); unpacked, they all read the one copy of the weights file.
        sink = self.samples.setdefault(os.path.basename(graph_path), [])
        return _RecordingSession(self._backend.load(graph_path, weights_path, False, config, int4_block), sink)

    def release_lookup_pages(self):
        self._backend.release_lookup_pages()


def record_feeds(bundle: str, manifest, prompts: list[list[int]]) -> dict[str, list[dict]]:
    """Run every model of the float32 bundle over the prompts, teacher-forced, each prompt walking through the
    cache in turns of every graph; return graph file -> the feeds it received.

    Every (role, T) must also run early in the cache, where it fits the smallest bucket: a walk that starts
    with the largest prefill chunk reaches its steps only past 120 slots (64 + 32 + 16 + 8), beyond a 128-slot
    bucket and beyond a short prompt's end. So prompts alternate between that walk and the reverse one (the
    smallest step first, the largest prefill last), and a single prompt walks both.

    A tree graph (step_mask) runs in two kinds of turns: a chain (the causal mask, as the runtime runs chains in
    it) and a token tree shaped like the runtime's proposals (runtime/tree.py: a spine plus leaves), whose spine
    is the prompt's continuation and is committed, the leaves' entries discarded as a rejected branch's are."""
    from ..graphs.manifest import read_index, weights_index_file
    from ..runtime.backends.ort_python import OrtBackend
    from ..runtime.model import ModelRunner

    backend = OrtBackend("ort", None)
    samples: dict[str, list[dict]] = {}
    try:
        for weights in {m.weights for m in manifest.models.values()}:
            backend.add_weights_file(os.path.join(bundle, weights),
                                     read_index(os.path.join(bundle, weights_index_file(weights))))
        for name, entry in manifest.models.items():
            runner = ModelRunner(name, bundle, entry, _RecordingBackend(backend, samples))  # its own cache
            turns = sorted({(g.role, g.tokens) for g in entry.graphs} | {(TREE, t) for t in entry.tree_tokens()},
                           key=lambda rt: ((C.PREFILL, C.STEP, TREE).index(rt[0]), -rt[1]))
            walks = [(prompt, turns if i % 2 == 0 else turns[::-1]) for i, prompt in enumerate(prompts)]
            if len(prompts) == 1:
                walks.append((prompts[0], turns[::-1]))
            try:
                for prompt, order in walks:
                    runner.reset()
                    pos, turn = 0, 0
                    while True:
                        role, T = order[turn % len(order)]
                        if pos + T > len(prompt) or runner.cache.free < T:
                            break
                        if role == C.PREFILL:
                            runner.prefill(prompt[pos:pos + T])
                        elif role == C.STEP:
                            runner.run(prompt[pos:pos + T])
                        else:
                            T = _tree_turn(runner, prompt[pos:pos + T])
                        pos, turn = pos + T, turn + 1
            finally:
                runner.close()
    finally:
        backend.close()
    return samples


TREE = "tree"  # record_feeds' turn of a tree graph run with a token tree


def _tree_turn(runner, tokens: list[int]) -> int:
    """Verify tokens[0] (the root) and a spine-plus-leaves tree of the tokens after it, the spine being the
    text's own continuation; commit the root and the spine, as an accepted path. Returns how many of the tokens
    entered the cache."""
    from ..runtime.tree import TreeLayout, spine_and_leaves, spine_length

    parents = spine_and_leaves(len(tokens) - 1)
    spine = spine_length(parents)
    base = runner.cache.used
    runner.run_tree(TreeLayout.build(tokens[0], tokens[1:], parents))
    runner.commit_tree(base, list(range(spine)))
    return 1 + spine


def _graph_feeds(graph, dims: C.ModelDims, recorded: dict[str, list[dict]], model_graphs, limit: int) -> list[dict]:
    """Feeds for one graph: its own recorded runs, else those of the same (role, T) in other buckets that fit,
    the past zero-padded (or cut: only slots < cache_len + T matter) to this graph's context. A row graph of a
    batch model (batch 1) takes the first row of its batch twin's runs when it has none of its own."""
    own = recorded.get(os.path.basename(graph.file), [])
    pool = own or [f for g in model_graphs if (g.role, g.tokens, g.step_mask) == (graph.role, graph.tokens, graph.step_mask)
                   for f in recorded.get(os.path.basename(g.file), [])
                   if int(f[C.CACHE_LEN].max()) + graph.tokens <= graph.context]
    if len(pool) > limit:  # spread over the runs: early and late cache lengths both
        pool = [pool[i] for i in np.linspace(0, len(pool) - 1, limit).round().astype(int)]
    out = []
    for f in pool:
        feeds = {}
        for k, v in f.items():
            if graph.batch == 1 and v.shape[0] > 1:  # every input's first axis is the batch
                v = v[:1]
            if k.startswith("past_"):
                full = np.zeros((v.shape[0], v.shape[1], graph.context, v.shape[3]), v.dtype)
                full[:, :, :v.shape[2]] = v
                v = full
            feeds[k] = v
        out.append(feeds)
    return out


# -- quantizing ---------------------------------------------------------------------------------------------
# Ops that QNN runs on the raw quantized values, whose inputs onnxruntime's quantizer gives scales of their own:
# the data input, the updates and the output of a ScatterElements must share one scale (measured: updates with
# their own scale put 0.09 of error into the tiny model's new K/V on the emulated HTP).
_SHARED_RANGE_OPS = {"ScatterElements": (0, 2)}
# Ops whose output onnxruntime's quantizer gives its input's scale: an override must go to the first tensor up
# such a chain, where the scale is decided.
_PASS_THROUGH = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Split", "Gather",
                 "GatherElements"}


def _activation_overrides(model, ranges) -> dict[str, dict]:
    """Activation overrides: each _SHARED_RANGE_OPS node's inputs and output, and each past K/V input with the
    tensor its layer's new K/V are computed as, get the union of their ranges (rmin/rmax), and the second operand
    of every product of two activations (attention's values) reaches its MatMul converted to symmetric int16 (the
    tensor keeps uint16 for its other readers).

    Why int16: the emulated HTP computes a uint16 x uint16 MatMul whose second operand has a zero point far from
    0 badly wrong. SmolLM2's layer-0 probabilities x values (values uint16 with zero point 38000, the range they
    share with the cache): 26% relative error against 0.01% on the CPU for the same quantized inputs; with the
    values converted to symmetric int16, 0.04% (tests/test_qnn_qdq.py has a product built like it)."""
    from onnxruntime.quantization import QuantType

    producer = {o: n for n in model.graph.node for o in n.output}
    weights = {i.name for i in model.graph.initializer}

    def root(t):
        while t in producer and producer[t].op_type in _PASS_THROUGH:
            t = producer[t].input[0]
        return t

    merged: list[set[str]] = []  # a tensor in two groups joins them

    def join(group: set[str]) -> None:
        for other in [m for m in merged if m & group]:
            group |= other
            merged.remove(other)
        merged.append(group)

    for node in model.graph.node:
        if node.op_type in _SHARED_RANGE_OPS:
            join({root(node.input[i]) for i in _SHARED_RANGE_OPS[node.op_type]} | {node.output[0]})
    # A new K/V entry leaves the graph dequantized and comes back in a later step's past: it must come back as
    # the same integers, so the tensor it is computed as and the past input share one range. Otherwise a verify
    # row attends to the step's own keys at one scale and a decode step to the same keys at the cache's (tiny
    # llama: 2.157e-05 / zero point 29598 against 2.156e-05 / 29605), and rows differ now and then (2e-4 in the
    # logits on the emulated HTP).
    # The quantizer puts a past input's QuantizeLinear after its pass-through readers (the keys' Transpose), with
    # their own ranges: those join too.
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)

    def passed_on(t):  # t and what pass-through nodes make of it
        out = {t}
        for n in readers.get(t, []):
            if n.op_type in _PASS_THROUGH:
                out |= passed_on(n.output[0])
        return out

    inputs = {i.name for i in model.graph.input}
    layer = 0
    while C.past_key(layer) in inputs:
        for past, new in ((C.past_key(layer), C.new_key(layer)), (C.past_value(layer), C.new_value(layer))):
            join(passed_on(past) | {root(new)})
        layer += 1
    converts: dict[str, set[str]] = {}
    for n in model.graph.node:
        if n.op_type == "MatMul" and not {n.input[0], n.input[1]} & weights:
            converts.setdefault(n.input[1], set()).add(n.name)
    out = {}
    for group in merged:
        known = [ranges[t] for t in group if t in ranges]
        lo, hi = min(r[0] for r in known), max(r[1] for r in known)
        for t in group:
            out[t] = [{"rmin": np.array(lo, np.float32), "rmax": np.array(hi, np.float32)}]
    for t, readers in converts.items():
        if root(t) != t or t not in ranges:
            continue  # a pass-through's output (the keys' Transpose) inherits its input's type
        entry = out.setdefault(t, [{"rmin": np.array(ranges[t][0], np.float32),
                                    "rmax": np.array(ranges[t][1], np.float32)}])[0]
        entry.update(quant_type=QuantType.QUInt16,
                     convert={"quant_type": QuantType.QInt16, "symmetric": True, "recv_nodes": readers})
    return out


def _calibrate(path: str, feeds: list[dict]) -> dict[str, tuple[float, float]]:
    """MinMax ranges of every float tensor a node of one float32 graph reads or writes (initializers aside) over
    its feeds: what onnxruntime's MinMax calibrator computes (tests/test_qnn_qdq.py compares the two), without its
    graph surgery, which inserts each tensor's ReduceMin/ReduceMax by a scan of the node list and took 3 of the
    3.5 minutes a SmolLM2 graph spent in calibration. Here every such tensor becomes a graph output of an
    unoptimized session (the calibrator's own setting), reduced in numpy after each run."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(path, load_external_data=False)  # the weights stay in the bundle's file, read by reference
    typed = onnx.shape_inference.infer_shapes(model)
    infos = {v.name: v for v in list(typed.graph.value_info) + list(typed.graph.output) + list(typed.graph.input)}
    weights = {i.name for i in model.graph.initializer}
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    tensors = list(dict.fromkeys(
        t for n in model.graph.node for t in [*n.input, *n.output]
        if t in infos and t not in weights and infos[t].type.tensor_type.elem_type in floats))
    outputs = {o.name for o in model.graph.output}
    for t in tensors:
        if t not in outputs:
            model.graph.output.append(onnx.helper.make_tensor_value_info(t, infos[t].type.tensor_type.elem_type, None))
    # Next to the graph, so that its external data references resolve; the bundle is still the export's temp dir.
    augmented = os.path.join(os.path.dirname(path), f".calibrate-{os.path.basename(path)}")
    onnx.save(model, augmented)
    try:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(augmented, options, providers=["CPUExecutionProvider"])
        lo = {t: np.inf for t in tensors}
        hi = {t: -np.inf for t in tensors}
        for feed in feeds:
            for t, value in zip(tensors, session.run(tensors, feed)):
                if value.size and not np.isnan(value).all():
                    lo[t] = min(lo[t], float(np.nanmin(value)))
                    hi[t] = max(hi[t], float(np.nanmax(value)))
        del session
    finally:
        os.remove(augmented)
    return {t: (lo[t], hi[t]) for t in tensors if lo[t] <= hi[t]}


def float_nodes(model) -> list[str]:
    """The nodes this flavour leaves in float: the residual stream's adds and the RMSNorm statistics
    (graphs/llama.py labels them). Measured on SmolLM2 (teacher-forced, 32 tokens, CPU onnxruntime running
    the QDQ graphs): quantizing them too gives 0/32 top-1 agreement with float32 (logits correlation 0.14),
    leaving them in float 31/32 (0.998)."""
    from ..graphs.llama import NORM, RESIDUAL

    return [n.name for n in model.graph.node if n.name.endswith((f"_{NORM}", f"_{RESIDUAL}"))]


def quantize_graph(path: str, ranges: dict[str, tuple[float, float]], scratch: str) -> str:
    """Write the QDQ model of one float32 graph from tensor ranges into the empty folder `scratch`
    (QUANTIZED, with its weights as external data) and return its path. Runs in a worker process
    (export/qdq_worker.py)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_static
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData, save_tensors_data
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))  # its "consider pre-processing"
    # The graph's structure only: quantize_static reads the weights itself, from the bundle's weights file. (A
    # copy loaded here, even freed before it runs, stayed in the process's heap: SmolLM2's peak 1.87 -> 1.28 GB.)
    model = onnx.load(path, load_external_data=False)
    names = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    data = TensorsData(CalibrationMethod.MinMax, {
        n: TensorData(lowest=np.array(lo, np.float32), highest=np.array(hi, np.float32))
        for n, (lo, hi) in ranges.items() if n in names})
    cache = os.path.join(scratch, "ranges.json")
    save_tensors_data(data, cache)
    inits = {i.name: i for i in model.graph.initializer}
    overrides = _activation_overrides(model, ranges)
    # int8 per output channel for every MatMul weight ([in, out]: axis 1); get_qnn_qdq_config would make them
    # per-tensor (older QNN lacked per-channel MatMul), the emulated HTP runs them. The scales are given, not left
    # to the quantizer: it computes them one channel at a time in Python (200k calls, 40% of a SmolLM2 graph).
    for n in model.graph.node:
        if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2:
            scales = weight_scales(_read_weight(inits[n.input[1]], os.path.dirname(path)))
            overrides[n.input[1]] = [{"quant_type": QuantType.QInt8, "axis": 1, "scale": s, "zero_point": 0}
                                     for s in scales.tolist()]  # (floats: the config deep-copies them)
    config = get_qnn_qdq_config(model, None, activation_type=QuantType.QUInt16, weight_type=QuantType.QInt8,
                                init_overrides=overrides)
    exclude = float_nodes(model)
    out = os.path.join(scratch, QUANTIZED)
    quantize_static(path, out, None, calibration_cache_path=cache, quant_format=config.quant_format,
                    activation_type=config.activation_type, weight_type=config.weight_type,
                    op_types_to_quantize=config.op_types_to_quantize, per_channel=config.per_channel,
                    nodes_to_exclude=exclude, use_external_data_format=True,
                    extra_options=config.extra_options)
    os.remove(cache)
    return out


def weight_scales(weight: np.ndarray) -> np.ndarray:
    """Symmetric int8 scales per output channel of a MatMul weight [in, out] (zero point 0): onnxruntime's rule
    (quant_utils.compute_scale_zp for levels -127..127, with the QNN config's MinimumRealRange), for all channels
    at once. The ranges include 0; the scale is computed in float64 and stored as float32."""
    low = np.minimum(weight.min(axis=0), np.float32(0))
    high = np.maximum(np.maximum(weight.max(axis=0), np.float32(0)), low + np.float32(MIN_REAL_RANGE))
    absmax = np.maximum(np.abs(low), np.abs(high)).astype(np.float64)
    return (2 * absmax / 254).astype(np.float32)


def _read_weight(init, folder: str) -> np.ndarray:
    """A float32 initializer's values, read from its external data file if it has one (one weight at a time:
    the worker does not hold the model's weights)."""
    from onnx import numpy_helper

    from ..graphs.external_data import file_pointer

    location, offset, _ = file_pointer(init)
    if location is None:  # a small weight kept inside the graph
        return numpy_helper.to_array(init)
    count = int(np.prod(init.dims))
    return np.fromfile(os.path.join(folder, location), np.float32, count, offset=offset).reshape(tuple(init.dims))


def default_jobs(weights_bytes: int) -> int:
    """Worker processes for quantize_bundle: one per core, at most MAX_JOBS, and no more than the available
    memory holds. A worker peaks at about WORKER_PEAK times its model's float weights file (SmolLM2, 651 MB:
    1.41 GB over 3 graphs; onnxruntime's quantizer holds the float model, the quantized one and its own copies)."""
    cores = os.cpu_count() or 1
    available = _available_memory()
    by_memory = int(available // (WORKER_PEAK * max(weights_bytes, 1))) if available else cores
    return max(1, min(MAX_JOBS, cores, by_memory))


def _available_memory() -> int | None:
    """Bytes the kernel can give without swapping (Linux MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _quantize_in_workers(paths: list[str], ranges_file: str, scratch: str, jobs: int, consume) -> None:
    """quantize_graph for every path in `jobs` child processes (worker k takes paths k, k + jobs, ...);
    `consume(path, model)` gets the results in the order of `paths`.

    onnxruntime's quantizer is pure Python and single-threaded (most of its time goes to scanning the node list
    once per quantized tensor), so graphs quantize in parallel in separate processes. The workers are plain
    `python -m` children rather than multiprocessing's, which would import the caller's __main__ again: an
    embedding script without a main guard would run twice. A worker reports each graph done with a marker file
    (export/qdq_worker.py)."""
    import subprocess
    import sys
    import time

    import onnx

    from ..runtime.backends import trim_heap
    from .qdq_worker import DONE

    jobs = min(jobs, len(paths))
    folders = [os.path.join(scratch, f"graph{i}") for i in range(len(paths))]
    workers = []  # (process, log file)
    try:
        for k in range(jobs):
            args = []
            for i in range(k, len(paths), jobs):
                os.makedirs(folders[i])
                args += [paths[i], folders[i]]
            log = open(os.path.join(scratch, f"worker{k}.log"), "w+")
            workers.append((subprocess.Popen([sys.executable, "-m", "specedge.export.qdq_worker", ranges_file, *args],
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT), log))
        for i, path in enumerate(paths):
            proc, log = workers[i % jobs]
            while not os.path.exists(os.path.join(folders[i], DONE)):
                rc = proc.poll()
                if rc is not None and not os.path.exists(os.path.join(folders[i], DONE)):
                    log.seek(0)
                    lines = log.read().strip().splitlines()
                    why = (f"killed by signal {-rc} (out of memory? export with fewer --jobs)" if rc < 0 else
                           lines[-1] if lines else f"exit status {rc}")
                    raise ExportError(f"quantizing {os.path.basename(path)} failed: {why}")
                time.sleep(0.05)
            consume(path, onnx.load(os.path.join(folders[i], QUANTIZED)))
            shutil.rmtree(folders[i])
            trim_heap()  # the loaded graph's weights, freed: glibc would keep their pages (SmolLM2: ~190 MB)
    finally:
        for proc, log in workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()


def quantize_bundle(bundle: str, manifest, calibration: Calibration, progress=None, jobs: int | None = None) -> dict:
    """Replace the float32 graphs and weights of `bundle` (written by export_bundle) with QDQ ones; returns the
    calibration record for the manifest. `jobs`: graphs quantized at once, in worker processes (default_jobs)."""
    import onnx
    from onnx import numpy_helper

    from ..graphs.manifest import weights_index_file, write_index
    from ..runtime.backends import trim_heap
    from ..runtime.tokenizer import Tokenizer
    from .weights import write_weights

    tokenizer = Tokenizer.from_bundle(bundle, manifest)
    prompts = load_prompt_ids(calibration.prompts, tokenizer, calibration.count)
    recorded = record_feeds(bundle, manifest, prompts)
    per_graph = {}
    model_ranges: dict[str, dict[str, tuple[float, float]]] = {}
    for name, entry in manifest.models.items():
        # One range per tensor name over all graphs of the model: their step graphs have the same nodes under
        # the same names (build_step_graph same_ops), so a verify row is quantized exactly like a decode step.
        ranges = model_ranges[name] = {}
        for graph in entry.graphs:
            feeds = _graph_feeds(graph, entry.dims, recorded, entry.graphs, calibration.samples_per_graph)
            if not feeds:
                raise ExportError(f"no calibration data reached {graph.file}: the calibration prompts are too "
                                  f"short for its {graph.tokens}-token steps; use longer prompts")
            per_graph[graph.file] = len(feeds)
            for t, (lo, hi) in _calibrate(os.path.join(bundle, graph.file), feeds).items():
                old = ranges.get(t, (lo, hi))
                ranges[t] = (min(old[0], lo), max(old[1], hi))
            if progress:
                progress.update(graph.file)
    recorded = feeds = None  # the recorded feeds (every sample's past K/V) would sit idle next to the workers
    trim_heap()  # and glibc would keep their pages and the calibration sessions' (SmolLM2: 760 -> 400 MB RSS)

    stored: dict[str, dict[str, np.ndarray]] = {}  # weights file -> shared initializers
    models: dict[str, list] = {}  # weights file -> [(graph path, quantized model)]
    scratch = tempfile.mkdtemp(prefix=".qdq-", dir=bundle)
    try:
        for name, entry in manifest.models.items():
            shared = stored.setdefault(entry.weights, {})

            def keep(path, q, weights=entry.weights, shared=shared):
                external = set()
                for init in q.graph.initializer:
                    if int(np.prod(init.dims)) < _STORE_MIN:
                        continue
                    value = numpy_helper.to_array(init)
                    if init.name in shared and not np.array_equal(shared[init.name], value):
                        continue  # same name, other values: stays inside this graph
                    shared.setdefault(init.name, value)
                    external.add(init.name)
                    _drop_data(init)  # the bytes live in `shared` now
                models.setdefault(weights, []).append((path, _reparsed(q), external))
                if progress:
                    progress.update(os.path.basename(path))

            ranges_file = os.path.join(scratch, f"{name}.ranges.json")
            with open(ranges_file, "w") as f:
                json.dump(model_ranges[name], f)
            _quantize_in_workers([os.path.join(bundle, g.file) for g in entry.graphs], ranges_file, scratch,
                                 jobs or default_jobs(os.path.getsize(os.path.join(bundle, entry.weights))), keep)
        for weights, graphs in models.items():
            refs = write_weights(os.path.join(bundle, weights), sorted(stored[weights].items()))
            write_index(os.path.join(bundle, weights_index_file(weights)), refs)
            for path, q, external in graphs:
                _point_at(q, refs, external, weights)
                onnx.save(q, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"prompts": os.path.basename(calibration.prompts), "prompt_count": len(prompts),
            "method": "minmax", "samples": sum(per_graph.values()), "samples_per_graph": per_graph}


def graph_logits_scale(path: str) -> float | None:
    """The scale of the DequantizeLinear that writes a QDQ graph's logits output (None: no logits output, or not
    written by one). Every step graph of a model has the same (one range per tensor name), which the manifest
    records as the grid the runtime snaps logits onto (runtime/model.snap_to_grid)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path, load_external_data=False)
    writer = next((n for n in model.graph.node if C.LOGITS in n.output), None)
    if writer is None or writer.op_type != "DequantizeLinear":
        return None
    scale = next((i for i in model.graph.initializer if i.name == writer.input[1]), None)
    return None if scale is None else float(numpy_helper.to_array(scale))


def logits_scales(bundle: str, manifest) -> dict[str, float]:
    """Model name -> the scale of its step graphs' logits (graph_logits_scale), which they all share."""
    out = {}
    for name, entry in manifest.models.items():
        scales = {graph_logits_scale(os.path.join(bundle, g.file)) for g in entry.graphs if g.role == C.STEP}
        if len(scales) != 1 or None in scales:
            raise ExportError(f"the {name} step graphs' logits are not on one quantization grid: "
                              f"{sorted(map(str, scales))}")
        out[name] = scales.pop()
    return out


def _reparsed(model):
    """`model` parsed again from its bytes: a parsed message keeps its whole allocation while it lives, whatever
    fields are cleared, so each quantized SmolLM2 graph held on to its 190 MB of weights (16 graphs: +3 GB)."""
    import onnx

    light = onnx.ModelProto()
    light.ParseFromString(model.SerializeToString())
    return light


def _drop_data(init) -> None:
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        init.ClearField(field)


def _point_at(model, refs, external: set[str], weights_file: str) -> None:
    """Make the model's shared initializers (`external`, their data already dropped) external data entries into
    `weights_file` (in place).

    A runtime hands every tensor of the weights file to every session by name (AddInitializer), and that
    replaces a graph's own initializer of the same name. Graph constants are named per graph (const_16 of a
    one-token step is not const_16 of a prefill), so an initializer that kept its own value under a name the
    weights file also uses is renamed here, or the session would compute with the other graph's tensor."""
    from ..graphs.external_data import point_at_file

    renamed = {}
    for init in model.graph.initializer:
        if init.name not in refs:
            continue
        if init.name not in external:
            renamed[init.name] = init.name = f"{init.name}.own"
            continue
        point_at_file(init, weights_file, refs[init.name].offset, refs[init.name].length)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
