"""The qnn-qdq16 flavour (`specedge export --for qnn-qdq16`): QDQ graphs with uint16 activations and int8 weights,
calibrated on real step inputs, run by the Qualcomm HTP emulator of the onnxruntime-qnn wheel.

Where nodes ran is read from onnxruntime's graph-assignment record (as in test_qnn.py). The tiny llama's tokenizer
is a word list ("t0".."t999") that maps the prompt suite's text to unknown tokens, so its calibration prompts are
token ids (a JSONL of {"prompt_ids"}): the same kind of random text the tests feed it.
"""
import json
import os
import shutil
import sys

import numpy as np
import onnx
import pytest
from conftest import CHUNK
from test_qnn import _backend_for, assert_speculation_equals_plain_on_qnn, teacher_forced

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.graphs import contract as C
from specedge.graphs.manifest import load_manifest, read_index, weights_index_file
from specedge.runtime.backends.qnn import EP
from specedge.runtime.generator import Generator

# The tiny llama's logits span about +-0.5; uint16 activations and int8 per-channel weights moved them by 0.009 at
# most against CPU float32 in the runs that set this bound (every step graph of a model shares its tensors' scales,
# see export/qdq.py). About twice the measured error, still far below the spread of the logits.
QDQ_LOGITS_ATOL = 0.02
TREES = (5, 8)  # tree graphs of the qdq bundle

pytestmark = pytest.mark.usefixtures("qnn_cache")


@pytest.fixture(scope="module")
def calibration_ids(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibration") / "ids.jsonl"
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(4):
            head = rng.integers(2, 1000, 40).tolist()
            f.write(json.dumps({"prompt_ids": head + head}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def qdq_bundle(tiny_models, calibration_ids, tmp_path_factory):
    """The tiny llama in the qnn-qdq16 flavour, with a one-layer draft and tree graphs: T=5 (also a chain size,
    so chains run in it with the causal mask) and T=8 (trees only)."""
    out = str(tmp_path_factory.mktemp("bundles") / "tiny_qnn_qdq16")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK, draft_layers=1,
                                                             flavour="qnn-qdq16", calibration_prompts=calibration_ids,
                                                             tree_sizes=TREES),
                  progress=False)
    return out


@pytest.mark.parametrize("count", [None, 1])
def test_default_graphs_in_two_buckets_all_get_calibration_data(tiny_models, calibration_ids, tmp_path, count):
    """The default prefill chunks and gammas, in buckets of 128 and 256 slots: every graph gets calibration data.
    Before, every prompt walked the cache largest prefill chunk first and reached the steps only past 120 slots,
    and the export failed with "no calibration data reached target.step1.s128.onnx"."""
    out = str(tmp_path / "bundle")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=256, flavour="qnn-qdq16", calibration_count=count,
                                                             calibration_prompts=calibration_ids), progress=False)
    manifest = load_manifest(out)
    assert manifest.target.buckets() == [128, 256]
    samples = manifest.export["qnn"]["calibration"]["samples_per_graph"]
    assert set(samples) == {g.file for m in manifest.models.values() for g in m.graphs}
    assert min(samples.values()) > 0


def test_a_batch_bundle_calibrates_its_row_graphs(tiny_models, calibration_ids, tmp_path):
    """--batch 2: the row graphs (batch 1: prefill, and steps of a row alone) take the first row of their batch
    twins' calibration runs (before, feeding them two rows failed the export), and run: every row's tokens
    equal its run alone."""
    from specedge.runtime.batch import BatchGenerator

    out = str(tmp_path / "bundle")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=64, prefill_chunk=CHUNK, batch=2, gammas=(2,),
                                                             flavour="qnn-qdq16", calibration_prompts=calibration_ids),
                  progress=False)
    manifest = load_manifest(out)
    assert {g.role for g in manifest.target.graphs if g.batch == 1} == {C.PREFILL, C.STEP}
    samples = manifest.export["qnn"]["calibration"]["samples_per_graph"]
    assert min(samples[g.file] for g in manifest.target.graphs if g.batch == 1) > 0
    prompts = [[5, 6, 7, 8, 9], [3, 1, 4]]
    g = BatchGenerator.load(out)
    try:
        together = g.generate_batch(prompts, 8, proposer="ngram", gamma=2, stop_ids=[])
        alone = [g.generate_batch([p], 8, proposer="ngram", gamma=2, stop_ids=[])[0] for p in prompts]
        assert [r.tokens for r in together] == [r.tokens for r in alone]
    finally:
        g.close()


def test_calibration_ranges_equal_onnxruntimes_minmax_calibrator(tiny_bundle, tmp_path):
    """export.qdq's own MinMax pass (every float tensor as an output, reduced in numpy) gives the ranges that
    onnxruntime's MinMax calibrator gives, for every tensor of every graph of the tiny float32 bundle."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    from specedge.export.qdq import _calibrate, _graph_feeds, record_feeds

    bundle = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, bundle)  # _calibrate writes its augmented graph next to the graph
    manifest = load_manifest(bundle)
    rng = np.random.default_rng(1)
    recorded = record_feeds(bundle, manifest, [rng.integers(2, 1000, 60).tolist() for _ in range(2)])
    compared = 0
    for entry in manifest.models.values():
        for graph in entry.graphs:
            feeds = _graph_feeds(graph, entry.dims, recorded, entry.graphs, 6)
            assert feeds, graph.file
            ours = _calibrate(os.path.join(bundle, graph.file), feeds)

            class Reader:
                def __init__(self):
                    self.left = list(feeds)

                def get_next(self):
                    return self.left.pop(0) if self.left else None

            calibrator = create_calibrator(os.path.join(bundle, graph.file), None,
                                           augmented_model_path=str(tmp_path / "augmented.onnx"),
                                           calibrate_method=CalibrationMethod.MinMax, use_external_data_format=True)
            calibrator.collect_data(Reader())
            theirs = {name: (float(np.min(d.range_value[0])), float(np.max(d.range_value[1])))
                      for name, d in calibrator.compute_data().items()}
            del calibrator
            assert ours.keys() == theirs.keys(), (graph.file, ours.keys() ^ theirs.keys())
            assert ours == theirs, graph.file
            compared += len(ours)
    assert compared > 100
    assert sorted(os.listdir(bundle)) == sorted(os.listdir(tiny_bundle))  # the augmented graphs are gone


def test_calibration_runs_token_trees_in_the_tree_graphs(tiny_models, tmp_path):
    """A tree graph is calibrated on what it verifies at run time: token trees (a spine plus leaves, rows at
    their depths), besides chains under the causal mask; every run's tree passes the loop's own checks."""
    from specedge.export.qdq import record_feeds
    from specedge.runtime.tree import spine_plus_leaves

    out = str(tmp_path / "float")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK, gammas=(4,),
                                                             tree_sizes=(5, 8)), progress=False)
    manifest = load_manifest(out)
    prompts = [np.random.default_rng(s).integers(2, 1000, 70).tolist() for s in range(2)]
    recorded = record_feeds(out, manifest, prompts)
    causal = {T: np.tril(np.ones((T, T), bool)) for T in (5, 8)}
    for graph in (g for g in manifest.target.graphs if g.step_mask):
        feeds = recorded[graph.file]
        T = graph.tokens
        trees = [f for f in feeds if not np.array_equal(f[C.STEP_MASK][0], causal[T])]
        assert trees and len(trees) < len(feeds), graph.file  # trees and chains both
        for f in trees:
            sees, positions = f[C.STEP_MASK][0], f[C.POSITION_IDS][0]
            parents = [int(np.flatnonzero(sees[i, :i])[-1]) for i in range(1, T)]  # the nearest ancestor's row
            assert spine_plus_leaves(parents)
            depth = sees.sum(axis=1) - 1
            np.testing.assert_array_equal(positions, f[C.CACHE_LEN][0] + depth)


def test_manifest_records_the_flavour_and_graphs_keep_the_contract(qdq_bundle):
    manifest = load_manifest(qdq_bundle)
    assert manifest.export["flavour"] == "qnn-qdq16"
    record = manifest.export["qnn"]
    assert record["activations"] == "uint16" and record["weights"].startswith("int8")
    calibration = record["calibration"]
    assert calibration["prompts"] == "ids.jsonl" and calibration["prompt_count"] == 4
    graphs = [g.file for m in manifest.models.values() for g in m.graphs]
    assert sorted(calibration["samples_per_graph"]) == sorted(graphs)
    assert all(n > 0 for n in calibration["samples_per_graph"].values())
    assert calibration["samples"] == sum(calibration["samples_per_graph"].values())
    from specedge.export.qdq import graph_logits_scale

    for name, entry in manifest.models.items():
        assert entry.dims.dtype == "float32"  # the runtime's buffers do not change
        scale = manifest.logits_scale(name)
        assert scale == record["logits_scale"][name] and 0 < scale < 1e-3
        steps = [g for g in entry.graphs if g.role == C.STEP]
        assert {graph_logits_scale(os.path.join(qdq_bundle, g.file)) for g in steps} == {scale}
        index = read_index(os.path.join(qdq_bundle, weights_index_file(entry.weights)))
        assert index["layers.0.qkv_quantized"].dtype == "int8"
        for graph in entry.graphs:
            model = onnx.load(os.path.join(qdq_bundle, graph.file), load_external_data=False)
            scale = next(i for i in model.graph.initializer if i.name == "layers.0.qkv_scale")
            assert tuple(scale.dims) == (index["layers.0.qkv_quantized"].shape[1],)  # one per output channel
            want = {s.name: s for s in C.step_inputs(entry.dims, graph.tokens, graph.step_mask, graph.context)}
            got = {i.name: i for i in model.graph.input}
            assert set(got) == set(want)
            for name, spec in want.items():  # float32 / int64 / bool at the boundary, QDQ inside
                t = got[name].type.tensor_type
                assert onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name == spec.dtype
                assert tuple(d.dim_value for d in t.shape.dim) == spec.shape
            ops = {n.op_type for n in model.graph.node}
            assert {"QuantizeLinear", "DequantizeLinear"} <= ops
            assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)


def test_every_node_of_every_graph_runs_on_qnn(qdq_bundle):
    manifest = load_manifest(qdq_bundle)
    assert sorted(g.tokens for g in manifest.target.graphs if g.step_mask) == list(TREES)  # trees' nodes too
    for name, entry in manifest.models.items():
        backend, weights = _backend_for(qdq_bundle, name, cache=False)
        for graph in entry.graphs:
            backend.load(os.path.join(qdq_bundle, graph.file), weights)
            record = backend.loads[-1]
            assert record.all_on_qnn and record.placement[EP] > 100, (graph.file, record.placement)
        backend.close()


def test_logits_close_to_cpu_float32(qdq_bundle, gen):
    """Teacher-forced through the runtime, one-token and five-token steps, against the CPU float32 bundle
    (`gen`, conftest's Generator on the tiny float32 bundle)."""
    qnn_gen = Generator.load(qdq_bundle, backend="qnn")
    try:
        worst, agree, rows, margin = teacher_forced(qnn_gen, gen)
        print(f"tiny qnn-qdq16 on QNN vs CPU float32: max |logit error| {worst:.4f}, top-1 {agree}/{rows}, "
              f"widest margin of a disagreeing row {margin:.4f}", file=sys.stderr)
        assert worst <= QDQ_LOGITS_ATOL, worst
        # A flipped argmax only where float32's own top two are within the two logits' errors: a near tie.
        assert agree >= rows - 1 and margin <= 2 * worst, (agree, rows, margin)
        assert all(r.all_on_qnn for r in qnn_gen.backend.loads)
    finally:
        qnn_gen.close()


def test_greedy_speculative_equals_plain_greedy_on_qnn(qdq_bundle):
    """ngram and the layer draft, fixed gammas, chains and token trees: equal to plain greedy on QNN for the same
    bundle, with drafts proposed, accepted and rejected."""
    gen = Generator.load(qdq_bundle, backend="qnn")
    try:
        assert_speculation_equals_plain_on_qnn(gen, trees=((TREES[0], 2), (TREES[1], 4)))
    finally:
        gen.close()


def test_tree_and_chain_rows_equal_decode_on_the_htp(qdq_bundle, monkeypatch):
    """`specedge check --backend qnn --exact-rows`: check's exact-rows comparison (every T-token graph against
    one-token steps; each tree graph also for a spine-plus-leaves tree, row by row against decode along its path)
    on the emulated HTP, logits on the manifest's grid as the runtime reads them: bit for bit, both models. This
    needs every step graph to quantize each tensor with the same scale (the chains are built with the tree graphs'
    nodes and names, and calibration gives one range per name), the new K/V at the cache's scale, norms that
    divide by full-width tensors (graphs/llama.py), and the snapping (a step of 8 or more rows dequantizes the
    same uint16 levels 1-2 float32 ulps away from a one-token step)."""
    from specedge.tools import exact_rows
    from specedge.tools.check import check_bundle

    compared = []  # (model, its per-graph results) as check computed them, in the manifest's order
    check_model_rows = exact_rows.check_model_rows

    def recording(bundle, model, *args, **kwargs):
        compared.append((model, check_model_rows(bundle, model, *args, **kwargs)))
        return compared[-1][1]

    monkeypatch.setattr(exact_rows, "check_model_rows", recording)
    report = check_bundle(qdq_bundle, backend="qnn", exact_rows=True).render()
    assert "FAIL" not in report, report
    multi_token = [g for g in load_manifest(qdq_bundle).target.graphs if g.tokens > 1]
    assert (f"target: exact rows on qnn: {len(multi_token)} graphs compute each row bit for bit as decode does, "
            f"{len(TREES)} of them also a token tree's rows") in report, report
    assert "draft: exact rows on qnn: " in report, report
    (target, results), (draft, _) = compared
    assert target.layers_of is None and draft.layers_of == "target"
    assert any(r.graph.step_mask and not r.tree for r in results)  # a tree graph's causal-chain comparison ran
    assert [(r.graph.file, r.reference, r.max_diff) for r in results if not r.exact] == []


def test_the_runtimes_verify_rows_equal_its_decode_rows_on_the_htp(qdq_bundle):
    """Through the runtime (ModelRunner, which snaps logits onto the manifest's grid): every row of a chain
    verify step (T = 9, 5) and of a token tree equals the one-token decode of the same tokens bit for bit, logits
    included, on the emulated HTP. Without the snapping the 9-row step's logits were 1.2e-7 away (the HTP
    dequantizes the same uint16 levels differently in a step of 8 or more rows)."""
    from specedge.runtime.tree import TreeLayout, spine_and_leaves

    gen = Generator.load(qdq_bundle, backend="qnn")
    target = gen.target
    rng = np.random.default_rng(4)
    prompt = rng.integers(2, 1000, 30).tolist()

    def decode(tokens):  # the logits of the last token, decoded one token at a time after the prompt
        target.reset()
        target.prefill(prompt)
        for t in tokens:
            logits = target.run([t]).copy()
        return logits[0]

    try:
        for T in (9, 5):
            tokens = rng.integers(2, 1000, T).tolist()
            target.reset()
            target.prefill(prompt)
            verify = target.run(tokens).copy()
            for i in range(T):
                np.testing.assert_array_equal(verify[i], decode(tokens[:i + 1]), err_msg=f"T={T} row {i}")
        nodes = rng.integers(2, 1000, TREES[1] - 1).tolist()
        tree = TreeLayout.build(prompt[-1], nodes, spine_and_leaves(len(nodes)))
        target.reset()
        target.prefill(prompt[:-1])
        rows = target.run_tree(tree).copy()
        prompt = prompt[:-1]
        for i in range(len(tree.tokens)):
            path = [tree.tokens[j] for j in np.flatnonzero(tree.sees[i])]
            np.testing.assert_array_equal(rows[i], decode(path), err_msg=f"tree row {i}")
    finally:
        gen.close()


def test_bad_flavour_options_are_one_line_and_leave_nothing(tiny_models, tmp_path, capsys):
    from specedge.cli import main

    out = tmp_path / "bundle"
    assert main(["export", "--target", tiny_models["llama"][0], "--out", str(out), "--for", "qnn-qdq16",
                 "--quant", "int4", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--for qnn-qdq16" in err and "--quant int4" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []
    assert main(["export", "--target", tiny_models["llama"][0], "--out", str(out), "--for", "qnn-qdq16",
                 "--jobs", "0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--jobs must be at least 1" in err and len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []
    assert main(["export", "--target", tiny_models["llama"][0], "--out", str(out), "--jobs", "2", "--quiet"]) == 2
    err = capsys.readouterr().err  # the float flavours quantize nothing: --jobs would be silently ignored
    assert "--jobs applies only to --for qnn-qdq16" in err and len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(Exception, match="cannot read the calibration prompts"):
        export_bundle(tiny_models["llama"][0], str(out), ExportOptions(context=128, prefill_chunk=CHUNK,
                                                                       flavour="qnn-qdq16", calibration_prompts=missing),
                      progress=False)
    assert os.listdir(tmp_path) == []


def test_one_worker_or_several_write_the_same_bundle(qdq_bundle, tiny_models, calibration_ids, tmp_path):
    """Graphs are quantized in worker processes, several at once (qdq_bundle: the default, one per core); their
    results are taken in the graphs' order, so the bundle does not depend on how many ran or which finished
    first: every graph and weights file is byte for byte the same with one worker and with three."""
    out = str(tmp_path / "one_worker")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK, draft_layers=1,
                                                             flavour="qnn-qdq16", calibration_prompts=calibration_ids,
                                                             jobs=1, tree_sizes=TREES), progress=False)
    three = str(tmp_path / "three_workers")
    export_bundle(tiny_models["llama"][0], three, ExportOptions(context=128, prefill_chunk=CHUNK, draft_layers=1,
                                                               flavour="qnn-qdq16", calibration_prompts=calibration_ids,
                                                               jobs=3, tree_sizes=TREES), progress=False)
    files = sorted(f for f in os.listdir(qdq_bundle) if f != "manifest.json" and not f.startswith("tokenizer"))
    assert any(f.endswith(".onnx") for f in files) and any(not f.endswith(".onnx") for f in files)
    for bundle in (out, three):
        assert sorted(f for f in os.listdir(bundle) if f != "manifest.json" and not f.startswith("tokenizer")) == files
        for f in files:
            with open(os.path.join(qdq_bundle, f), "rb") as a, open(os.path.join(bundle, f), "rb") as b:
                assert a.read() == b.read(), f


def test_a_failing_worker_is_one_clear_error(tmp_path):
    """A worker that fails (here: a graph file that is not there) ends the export with one ExportError naming
    the graph and the worker's own last line, and no worker is left running: its sibling, which reads a FIFO
    that nobody writes and so never finishes, is stopped (Linux: /proc lists a process's children)."""
    from specedge.errors import ExportError
    from specedge.export.qdq import _quantize_in_workers

    ranges = tmp_path / "ranges.json"
    ranges.write_text("{}")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    endless = str(tmp_path / "endless.onnx")
    os.mkfifo(endless)
    got = []

    def children():
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            return set(f.read().split())

    before = children()
    with pytest.raises(ExportError, match=r"quantizing missing\.onnx failed: .*missing\.onnx"):
        _quantize_in_workers([str(tmp_path / "missing.onnx"), endless, endless], str(ranges), str(scratch), 2,
                             lambda path, model: got.append(path))
    assert got == [] and children() == before


def test_check_passes_and_no_graph_constant_is_shadowed_by_the_weights_file(qdq_bundle, tmp_path):
    """`specedge check` on a qnn-qdq16 bundle. Its weights file holds every large initializer once, by name;
    a runtime hands those to every session, and that replaces a graph's own initializer of the same name. A
    graph constant that kept its own value under such a name (const_16 of a one-token step is not const_16 of
    a prefill) must have been renamed: this failed SmolLM2's bundle, whose one-token step then computed with a
    prefill graph's tensor."""
    from specedge.tools.check import check_bundle

    report = check_bundle(qdq_bundle)
    assert report.ok, report.render()
    assert "target: logits on the recorded uint16 grid" in report.render()
    # a manifest whose logits grid is not the graphs' is caught
    moved = str(tmp_path / "moved")
    shutil.copytree(qdq_bundle, moved)
    raw = json.load(open(os.path.join(moved, "manifest.json")))
    raw["export"]["qnn"]["logits_scale"]["target"] *= 2
    json.dump(raw, open(os.path.join(moved, "manifest.json"), "w"))
    report = check_bundle(moved, load=False)
    assert not report.ok and "dequantize their logits with another scale than the manifest's" in report.render()
    # a shadowed initializer is caught: a graph that embeds its own tensor under a name of the weights file
    bad = str(tmp_path / "bad")
    shutil.copytree(qdq_bundle, bad)
    entry = load_manifest(bad).target
    path = os.path.join(bad, entry.graph("step", 1).file)
    model = onnx.load(path, load_external_data=False)
    shared = next(i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL)
    taken = shared.name
    own = onnx.numpy_helper.from_array(np.zeros(tuple(shared.dims), onnx.helper.tensor_dtype_to_np_dtype(
        shared.data_type)), taken)
    model.graph.initializer.remove(shared)
    model.graph.initializer.append(own)
    onnx.save(model, path)
    report = check_bundle(bad, load=False)
    assert not report.ok and f"{taken} is embedded, but the weights file's {taken} would replace it" in report.render()


@pytest.mark.slow
def test_smollm2_qdq16_keeps_the_residual_stream_in_float_and_agrees_with_float32(smollm2_path, tmp_path_factory):
    """SmolLM2 in the qnn-qdq16 flavour, teacher-forced over 16 tokens of CPU float32 greedy output, on the CPU
    (onnxruntime runs the QDQ graphs with the same quantized values; the emulated HTP takes minutes per
    prompt). With every tensor in uint16 this agreed 0/32 (logits correlation 0.14): a few residual channels
    near 2.5e4 share one scale with values near 1. The residual adds and RMSNorm statistics stay float (fp16 on
    the HTP). On the emulated HTP, every node placed, this flavour agrees 32/32 over two prompts (measured by
    hand: about 5 s per emulated step; 9/16 before the values went to their product as int16 and the norm
    stopped dividing by max|x|)."""
    from specedge.export.qdq import float_nodes

    root = tmp_path_factory.mktemp("smollm2_qdq")
    # One context bucket: each graph is calibrated and quantized on its own (about a minute apiece here), and the
    # prompt and its 16 tokens fit in 128 slots.
    small = dict(context=128, prefill_chunk=32, gammas=(4,))
    cpu_bundle, qdq = str(root / "cpu"), str(root / "qdq")
    export_bundle(smollm2_path, cpu_bundle, ExportOptions(**small), progress=False)
    export_bundle(smollm2_path, qdq, ExportOptions(**small, flavour="qnn-qdq16"), progress=False)
    step = onnx.load(os.path.join(qdq, load_manifest(qdq).target.graph("step", 1).file), load_external_data=False)
    residual = [n for n in float_nodes(step) if n.endswith("_residual")]
    assert len(residual) == 2 * 30
    stream = {o for k in step.graph.node if k.name in residual for o in k.output}
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] in stream for n in step.graph.node)  # never uint16
    cpu, q = Generator.load(cpu_bundle), Generator.load(qdq)
    try:
        prompt = cpu.tokenizer.apply_chat_template([{"role": "user", "content": "Rewrite in Python 3: print 'hello %s' % name"}])
        want = cpu.generate(prompt, 16, proposer="none", stop_ids=[]).tokens
        q.target.prefill(prompt[:-1])
        got = [int(q.target.run([t]).argmax()) for t in [prompt[-1]] + want[:-1]]
        agree = sum(a == b for a, b in zip(got, want))
        print(f"SmolLM2 qnn-qdq16 on the CPU, top-1 agreement with float32: {agree}/16", file=sys.stderr)
        assert agree >= 14, (got, want)
    finally:
        cpu.close()
        q.close()


def test_a_product_of_two_activations_is_exact_enough_on_the_htp(tmp_path):
    """The emulated HTP computes a uint16 x uint16 MatMul whose second operand has a zero point far from 0 badly
    wrong: SmolLM2's layer-0 probabilities x values (values uint16 with zero point 38000) came out 26% off, against
    0.01% on the CPU for the same quantized inputs. The flavour's quantization (export/qdq.py) hands the second
    operand of every product of two activations to it as symmetric int16. One such product, built like
    attention's (peaked probabilities; values in an off-centre range, as SmolLM2's layer 0 has), quantized by the
    flavour's own code, then agrees with float on the HTP within 0.1% (as uint16 with its zero point: 6.7%)."""
    from onnx import TensorProto, helper

    from specedge.export.qdq import quantize_graph
    from specedge.runtime.backends.qnn import QnnBackend, QnnOptions

    rng = np.random.default_rng(0)
    scores = rng.standard_normal((1, 3, 96, 128)) * 4
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    values = rng.uniform(-0.54, 0.38, (1, 3, 128, 64)).astype(np.float32)
    want = probs @ values
    graph = helper.make_graph([helper.make_node("MatMul", ["probs", "values"], ["out"], name="pv")], "pv", [
        helper.make_tensor_value_info("probs", TensorProto.FLOAT, probs.shape),
        helper.make_tensor_value_info("values", TensorProto.FLOAT, values.shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, want.shape)])
    path = str(tmp_path / "pv.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), path)
    # The values' range is the one they share with the cache (past_value, ScatterElements), wider than a step's.
    ranges = {"probs": (0.0, 1.0), "values": (-10.0, 7.27), "out": (float(want.min()), float(want.max()))}
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    quantized = onnx.load(quantize_graph(path, ranges, str(scratch))).SerializeToString()

    import onnxruntime as ort
    backend = QnnBackend(None, QnnOptions(soc_model="60"))
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    options.add_provider_for_devices(backend._devices, backend.provider_options())
    feeds = {"probs": probs, "values": values}
    on_htp = ort.InferenceSession(quantized, options).run(None, feeds)[0]
    on_cpu = ort.InferenceSession(quantized, providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    def rel(x):
        return float(np.linalg.norm(x - want) / np.linalg.norm(want))

    assert rel(on_cpu) < 0.01 and rel(on_htp) < 0.01, (rel(on_cpu), rel(on_htp))


def test_weight_scales_follow_onnxruntimes_per_channel_rule():
    """The scales the export hands onnxruntime's quantizer (all channels at once) are the ones it computes itself
    one channel at a time (compute_data_quant_params, symmetric int8, the QNN config's MinimumRealRange): so the
    graphs are what its own per-channel quantization writes. Columns: random, all negative, all zero, tiny,
    all positive, constant."""
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import compute_data_quant_params

    from specedge.export.qdq import MIN_REAL_RANGE, weight_scales

    rng = np.random.default_rng(3)
    weight = rng.standard_normal((64, 9)).astype(np.float32) * rng.uniform(1e-3, 3, 9).astype(np.float32)
    weight[:, 1] = -np.abs(weight[:, 1])
    weight[:, 2] = 0
    weight[:, 3] *= np.float32(1e-7)
    weight[:, 4] = np.abs(weight[:, 4]) + 1
    weight[:, 5] = 1  # ranges include 0 before the minimum range applies
    expected = [compute_data_quant_params(weight[:, j].copy(), TensorProto.INT8, True,
                                          min_real_range=MIN_REAL_RANGE)[1] for j in range(weight.shape[1])]
    got = weight_scales(weight)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array(expected, np.float32))
