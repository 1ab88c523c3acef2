"""Bundles on onnxruntime's QNN execution provider, run by the Qualcomm HTP emulator of the onnxruntime-qnn wheel.

Where nodes ran is read from onnxruntime's graph-assignment record, never session.get_providers() (which lists
QNN even when QNN placed nothing). The emulated HTP computes float graphs in fp16, so QNN logits differ from the
CPU float32 graph's in the last bits: they are compared with a tolerance, and greedy speculation on QNN is
compared with plain greedy decoding on QNN.
"""
import os
import shutil
import sys

import numpy as np
import onnx
import pytest
from conftest import CHUNK
from models import GEMMA_CASES, make_hf_model

from specedge.errors import BackendError, PlacementError
from specedge.export.bundle import ExportOptions, export_bundle
from specedge.graphs import contract as C
from specedge.graphs.manifest import load_manifest, read_index, weights_index_file
from specedge.runtime.backends import create_backend
from specedge.runtime.backends.qnn import EP, QnnBackend, QnnOptions
from specedge.runtime.backends.qnn_cache import CONTEXT_FILE, DIGEST_FILE, PLACEMENT_FILE
from specedge.runtime.generator import Generator
from specedge.tools.exact_rows import GraphDriver, one_token_steps, tree_rows
from specedge.tools import cache as cache_tool

# Logits of the tiny llama are about +-0.7; fp16 compute on the HTP moved them by at most 1.3e-3 (float32
# bundle) and 4e-3 (float16 bundle, whose weights are rounded too) in the runs that set this bound.
LOGITS_ATOL = 1e-2
NEW = 24


pytestmark = pytest.mark.usefixtures("qnn_cache")


@pytest.fixture(scope="module")
def qnn_fp16_bundle(tiny_models, tmp_path_factory):
    """The tiny llama in the qnn-fp16 flavour (`specedge export --for qnn`), with a one-layer draft and a tree
    graph (placement covers its step_mask nodes)."""
    out = str(tmp_path_factory.mktemp("bundles") / "tiny_qnn_fp16")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK, draft_layers=1,
                                                             dtype="float16", flavour="qnn-fp16", tree_sizes=(8,)),
                  progress=False)
    return out


@pytest.fixture(scope="module")
def cpu_gen(tiny_bundle):
    g = Generator.load(tiny_bundle)
    yield g
    g.close()


def _backend_for(bundle: str, model: str = "target", **options) -> tuple[QnnBackend, str]:
    backend = QnnBackend(None, QnnOptions(soc_model="60", **options))
    entry = load_manifest(bundle).models[model]
    weights = os.path.join(bundle, entry.weights)
    backend.add_weights_file(weights, read_index(os.path.join(bundle, weights_index_file(entry.weights))))
    return backend, weights


def _prompt(seed: int, n: int = 20) -> list[int]:
    head = np.random.default_rng(seed).integers(2, 1000, n // 2).tolist()
    return head + head  # a repeat: prompt lookup finds something to copy


# -- placement -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flavour", ["float32", "qnn-fp16"])
def test_every_node_of_every_graph_runs_on_qnn(flavour, tiny_bundle, qnn_fp16_bundle):
    bundle = tiny_bundle if flavour == "float32" else qnn_fp16_bundle
    manifest = load_manifest(bundle)
    assert manifest.export["flavour"] == ("portable" if flavour == "float32" else "qnn-fp16")
    for name, entry in manifest.models.items():
        backend, weights = _backend_for(bundle, name, cache=False)
        for graph in entry.graphs:
            backend.load(os.path.join(bundle, graph.file), weights)
            record = backend.loads[-1]
            nodes = len(onnx.load(os.path.join(bundle, graph.file), load_external_data=False).graph.node)
            # Every node onnxruntime kept after its graph optimizations is on QNN. Some fold away as constants
            # (the causal step mask of a one-token QNN step: 12 of 263 nodes).
            assert record.placement == {EP: record.placement[EP]}, (graph.file, record.placement)
            assert 0.9 * nodes <= record.placement[EP] <= nodes, (graph.file, nodes, record.placement)
        backend.close()


def test_check_reports_placement_per_graph(qnn_fp16_bundle, tmp_path, capsys):
    from specedge.cli import main

    assert main(["check", qnn_fp16_bundle, "--backend", "qnn"]) == 0
    out = capsys.readouterr().out
    graphs = sum(len(m.graphs) for m in load_manifest(qnn_fp16_bundle).models.values())
    assert out.count("every node on QNN") == graphs, out
    odd = _with_unplaceable_node(qnn_fp16_bundle, str(tmp_path / "odd"))
    assert main(["check", odd, "--backend", "qnn"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "cannot run on QNN (HTP): Hardmax 'odd_hardmax'" in out, out


# -- numbers -------------------------------------------------------------------------------------------------

def teacher_forced(gen, cpu_gen) -> tuple[float, int, int, float]:
    """The same prompt and tokens through both generators' targets, one-token and five-token steps: the
    largest logit difference, the rows whose argmax agrees, the rows, and the widest margin by which the CPU
    preferred its own argmax at a row that disagrees (0 when all agree)."""
    prompt = _prompt(3, 2 * CHUNK + 3)
    worst, agree, rows, margin = 0.0, 0, 0, 0.0
    for g in (gen, cpu_gen):
        g.target.reset()
        g.target.prefill(prompt)
    for step in ([5], [7, 8, 9, 10, 11], [12]):
        got = gen.target.run(step).copy()
        want = cpu_gen.target.run(step)
        worst = max(worst, float(np.abs(got - want).max()))
        same = got.argmax(-1) == want.argmax(-1)
        agree += int(same.sum())
        rows += len(step)
        for r in np.flatnonzero(~same):
            margin = max(margin, float(want[r].max() - want[r, got[r].argmax()]))
    return worst, agree, rows, margin


@pytest.mark.parametrize("flavour", ["float32", "qnn-fp16"])
def test_logits_close_to_cpu_float32(flavour, tiny_bundle, qnn_fp16_bundle, cpu_gen):
    """Teacher-forced through the runtime: the same prompt and tokens on both, one-token and five-token steps."""
    gen = Generator.load(tiny_bundle if flavour == "float32" else qnn_fp16_bundle, backend="qnn")
    try:
        worst, agree, rows, _ = teacher_forced(gen, cpu_gen)
        assert worst <= LOGITS_ATOL, worst
        assert agree == rows
    finally:
        gen.close()


def rows_on_qnn(bundle: str) -> list:
    """check's exact-rows comparison of the bundle's target (tools/exact_rows.py), run on the emulated HTP, logits
    on the manifest's grid where it records one (qnn-qdq16), as the runtime reads them."""
    from specedge.tools.exact_rows import check_model_rows

    backend, _ = _backend_for(bundle, cache=False)
    manifest = load_manifest(bundle)
    try:
        return check_model_rows(bundle, manifest.target, backend, logits_scale=manifest.logits_scale("target"))
    finally:
        backend.close()


def test_qnn_fp16_rows_are_bit_exact_on_the_htp(qnn_fp16_bundle):
    """check's exact-rows comparison on the emulated HTP for the tiny llama in the qnn-fp16 flavour: every
    T-token graph (and the tree graph, also for a token tree) computes each row bit for bit as one-token decode
    steps do there. Its RMSNorm divides by the row statistics expanded to the row's full width: the HTP computes
    the reciprocal of a [rows, 1] tensor differently for a row of a T-token step than for a one-token step (rows
    came out up to 1e-3 apart), and a full-width one the same way at every T. (SmolLM2: the slow test below.)"""
    results = rows_on_qnn(qnn_fp16_bundle)
    assert any(r.tree for r in results) and any(r.graph.tokens == CHUNK for r in results)
    assert [(r.graph.file, r.reference, r.max_diff) for r in results if not r.exact] == []


def test_check_compares_rows_on_the_htp_when_asked(qnn_fp16_bundle, tiny_bundle, capsys, qnn_cache, monkeypatch):
    """`specedge check --backend qnn --exact-rows` runs check's exact-rows comparison on the HTP itself, where a
    device's rounding is what speculation depends on: the qnn-fp16 bundle passes there; the portable float32
    bundle, whose rows are bit-exact on the CPU, fails there (its one-token step has another layout than its
    verify steps, which the HTP rounds differently). Each graph is compiled once, into the context cache that
    the rows comparison (and later the runtime) loads it from, and a second check compiles nothing. Without
    the flag the comparison is left out on qnn, saying so."""
    from specedge.cli import main

    created = []  # every graph QNN compiles or loads, in order
    create = QnnBackend._create

    def recording_create(self, path, *args, **kwargs):
        created.append(path)
        return create(self, path, *args, **kwargs)

    monkeypatch.setattr(QnnBackend, "_create", recording_create)
    assert main(["check", qnn_fp16_bundle, "--backend", "qnn", "--exact-rows"]) == 0
    out = capsys.readouterr().out
    manifest = load_manifest(qnn_fp16_bundle)
    compiled = [p for p in created if not p.endswith(CONTEXT_FILE)]
    assert sorted(compiled) == sorted(os.path.join(qnn_fp16_bundle, g.file)
                                      for m in manifest.models.values() for g in m.graphs)
    multi_token = [g for g in manifest.target.graphs if g.tokens > 1]
    assert f"target: exact rows on qnn: {len(multi_token)} graphs compute each row bit for bit" in out, out
    graphs = sum(len(m.graphs) for m in manifest.models.values())
    assert out.count("every node on QNN") == out.count("; compiled in ") == graphs, out
    assert len(os.listdir(qnn_cache)) == graphs  # one context binary per graph, no second compile
    assert main(["check", qnn_fp16_bundle, "--backend", "qnn", "--exact-rows"]) == 0
    out = capsys.readouterr().out
    assert out.count("every node on QNN") == out.count("as compiled into the context cache") == graphs, out
    assert len(os.listdir(qnn_cache)) == graphs
    assert main(["check", tiny_bundle, "--backend", "qnn", "--exact-rows"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "target: exact rows on qnn: " in out and " differs from " in out, out
    assert main(["check", tiny_bundle, "--backend", "qnn"]) == 0
    assert "target: exact rows not checked on qnn by default" in capsys.readouterr().out


# -- speculation ---------------------------------------------------------------------------------------------

PHI3_WINDOW = ("phi3", {"partial_rotary_factor": 0.75, "sliding_window": 6})


@pytest.mark.parametrize("family, config", [*GEMMA_CASES, PHI3_WINDOW],
                         ids=["gemma", "gemma-exact-gelu", "gemma2", "gemma3", "phi3"])
def test_gemma_and_phi3_in_the_qnn_fp16_flavour(family, config, tmp_path):
    """What Gemma adds to the step graph (GeLU, exact or in its tanh form; the embedding scale; norms by 1 + w;
    Gemma 2's soft caps, sandwich norms and sliding layers; Gemma 3's q/k norms and local RoPE base) and Phi-3
    (partial rotary, a window) in the qnn-fp16 flavour, whose fp16 arithmetic on the HTP was untried for these:
    every node on the emulated HTP, teacher-forced logits within LOGITS_ATOL of the same model's float32 bundle
    on the CPU, and greedy speculation on QNN equal to plain greedy there (assert_speculation_equals_plain_on_qnn;
    prompt lookup only: one layer of these tiny Gemmas predicts all three's tokens, so a layer draft is never
    rejected)."""
    src = str(tmp_path / "m")
    make_hf_model(src, family, layers=3, tie=family != "phi3", **config)
    bundles = {}
    for flavour, dtype in (("portable", "float32"), ("qnn-fp16", "float16")):
        bundles[flavour] = str(tmp_path / flavour)
        export_bundle(src, bundles[flavour], ExportOptions(context=128, prefill_chunk=CHUNK, dtype=dtype,
                                                           flavour=flavour), progress=False)
    cpu, gen = Generator.load(bundles["portable"]), Generator.load(bundles["qnn-fp16"], backend="qnn")
    try:
        worst, agree, rows, _ = teacher_forced(gen, cpu)
        assert worst <= LOGITS_ATOL and agree == rows, (worst, agree, rows)
        assert_speculation_equals_plain_on_qnn(gen, proposers=("ngram",))
    finally:
        gen.close()
        cpu.close()


def test_greedy_speculative_equals_plain_greedy_on_qnn(tiny_bundle, cpu_gen):
    """ngram and the layer draft, with fixed gammas: equal to plain greedy on QNN, with drafts proposed,
    accepted and rejected; plain greedy on QNN agrees with CPU float32 at top-1 (fp16 may flip a near tie, none
    did on these prompts)."""
    gen = Generator.load(tiny_bundle, backend="qnn")
    try:
        plains = assert_speculation_equals_plain_on_qnn(gen)
        cpu = [cpu_gen.generate(_prompt(s), NEW, proposer="none", stop_ids=[]).tokens for s in (1, 2)]
        assert plains[:2] == cpu
    finally:
        gen.close()


def assert_speculation_equals_plain_on_qnn(gen, trees: tuple[tuple[int, int], ...] = (),
                                          proposers: tuple[str, ...] = ("ngram", "draft")) -> list[list[int]]:
    """`proposers` (ngram and the layer draft) at gammas 2 and 4, and as token trees for each (tree T, gamma) of
    `trees`,
    equal plain greedy on QNN for three prompts, with drafts proposed, accepted and rejected (and tree rounds
    run), and every graph fully on QNN; returns the plain outputs."""
    prompts = [_prompt(s) for s in (1, 2)]
    plains = [gen.generate(p, NEW, proposer="none", stop_ids=[]).tokens for p in prompts]
    # An echo prompt (a prompt, its greedy continuation, the prompt again) gives the layer draft text the
    # target repeats, so that some of its drafts are accepted.
    prompts.append(prompts[0] + plains[0] + prompts[0])
    plains.append(gen.generate(prompts[-1], NEW, proposer="none", stop_ids=[]).tokens)
    for proposer in proposers:
        for tree, gamma in [(0, 2), (0, 4), *trees]:
            proposed = accepted = tree_rounds = 0
            for p, want in zip(prompts, plains):
                out = gen.generate(p, NEW, proposer=proposer, gamma=gamma, tree=tree, stop_ids=[], adaptive=False)
                assert out.tokens == want, (proposer, gamma, tree)
                proposed, accepted = proposed + out.stats.proposed, accepted + out.stats.accepted
                tree_rounds += out.stats.tree_rounds
            assert 0 < accepted < proposed, (proposer, gamma, tree, accepted, proposed)
            assert (tree_rounds > 0) == (tree > 0), (proposer, gamma, tree, tree_rounds)
    assert {r.placement.get(EP, 0) > 0 and r.all_on_qnn for r in gen.backend.loads} == {True}
    return plains


# -- context binaries ----------------------------------------------------------------------------------------

def _run_once(session, dims: C.ModelDims, T: int) -> np.ndarray:
    inputs = {s.name: np.zeros(s.shape, s.dtype) for s in C.step_inputs(dims, T)}
    inputs[C.INPUT_IDS][:] = np.arange(3, 3 + T)
    inputs[C.POSITION_IDS][:] = np.arange(T)
    outputs = {s.name: np.zeros(s.shape, s.dtype) for s in C.step_outputs(dims, T)}
    session.bind(inputs, outputs)
    session.run()
    return outputs[C.LOGITS].copy()


def test_context_binary_is_reused_on_second_load(tiny_bundle, qnn_cache):
    graph = os.path.join(tiny_bundle, load_manifest(tiny_bundle).target.graph(C.STEP, 9).file)
    dims = load_manifest(tiny_bundle).target.dims
    first, weights = _backend_for(tiny_bundle)
    logits = _run_once(first.load(graph, weights), dims, 9)
    compiled = first.loads[-1]
    assert compiled.source == "compiled" and os.path.isfile(compiled.context)
    assert os.path.dirname(compiled.context).startswith(str(qnn_cache))
    entry = os.path.dirname(compiled.context)
    (listed,) = cache_tool.entries(os.path.dirname(qnn_cache))
    assert listed.path == entry and listed.source == os.path.abspath(graph)  # what `specedge cache list` says
    os.utime(entry, (1e9, 1e9))  # 2001: a load from the cache must mark it used again, for `cache prune`
    second, _ = _backend_for(tiny_bundle)
    again = _run_once(second.load(graph, weights), dims, 9)
    cached = second.loads[-1]
    assert cached.source == "cache" and cached.context == compiled.context
    assert os.path.getmtime(entry) > 1e9 + 1
    assert cached.seconds < compiled.seconds / 2, (cached.seconds, compiled.seconds)
    # The cached graph is one EPContext node; the record still reports where the bundle's nodes were placed.
    assert cached.placement == compiled.placement and cached.placement[EP] > 100, cached.placement
    np.testing.assert_array_equal(again, logits)  # the same binary computes the same bits


def test_changed_bundle_never_reuses_a_binary(tiny_bundle, tmp_path):
    """A rewritten weights file (same size, same names) gets its own binary, and the new weights take effect."""
    bundle = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, bundle)
    entry = load_manifest(bundle).target
    graph, dims = os.path.join(bundle, entry.graph(C.STEP, 1).file), entry.dims
    backend, weights = _backend_for(bundle)
    before = _run_once(backend.load(graph, weights), dims, 1)
    old = backend.loads[-1].context
    backend.close()
    ref = read_index(os.path.join(bundle, weights_index_file(entry.weights)))["norm"]
    data = np.memmap(weights, np.float32, "r+", offset=ref.offset, shape=ref.shape)
    data *= 2.0  # the final norm's scale: every logit doubles
    data.flush()
    del data
    backend, weights = _backend_for(bundle)
    after = _run_once(backend.load(graph, weights), dims, 1)
    assert backend.loads[-1].source == "compiled" and backend.loads[-1].context != old
    np.testing.assert_allclose(after, 2 * before, atol=LOGITS_ATOL)


@pytest.mark.parametrize("damage", ["truncated", "garbled", "refused", "placement"])
def test_damaged_binary_is_recompiled(damage, tiny_bundle):
    """truncated / garbled: the stored digest no longer matches, so the file never reaches QNN (which does not
    validate a context binary: a garbled one loads and then crashes the process at run time). refused: a file
    whose digest matches but that onnxruntime cannot load. placement: the record of where the compiled graph's
    nodes ran is unreadable. Each is dropped and compiled again, and the result is right."""
    entry = load_manifest(tiny_bundle).target
    graph, dims = os.path.join(tiny_bundle, entry.graph(C.STEP, 2).file), entry.dims
    backend, weights = _backend_for(tiny_bundle)
    want = _run_once(backend.load(graph, weights), dims, 2)
    ctx = backend.loads[-1].context
    if damage == "placement":
        with open(os.path.join(os.path.dirname(ctx), PLACEMENT_FILE), "w") as f:
            f.write('{"QNNExecutionProvider": ')
    else:
        _damage(ctx, damage)
    backend, weights = _backend_for(tiny_bundle)
    got = _run_once(backend.load(graph, weights), dims, 2)
    assert backend.loads[-1].source == "recompiled"
    assert os.path.basename(backend.loads[-1].context) == CONTEXT_FILE
    assert backend.loads[-1].placement[EP] > 100, backend.loads[-1].placement
    np.testing.assert_array_equal(got, want)


def _damage(ctx: str, damage: str) -> None:
    with open(ctx, "r+b") as f:
        if damage == "truncated":
            f.truncate(os.path.getsize(ctx) // 2)
        elif damage == "garbled":  # the middle, where the QNN context binary lies
            f.seek(os.path.getsize(ctx) // 2)
            f.write(b"\xff" * 4096)
        else:
            f.truncate(0)
            f.write(b"not an onnx model")
    if damage == "refused":
        from specedge.runtime.backends.digests import file_digest

        with open(os.path.join(os.path.dirname(ctx), DIGEST_FILE), "w") as f:
            f.write(file_digest(ctx))


# -- bad inputs ----------------------------------------------------------------------------------------------

def test_qnn_not_installed_is_one_clear_error(tiny_bundle, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime_qnn" else real(name, *a))
    with pytest.raises(BackendError, match="pip install onnxruntime-qnn"):
        create_backend("qnn")
    with pytest.raises(BackendError, match="onnxruntime-qnn"):
        Generator.load(tiny_bundle, backend="qnn")
    from specedge.cli import main

    assert main(["generate", tiny_bundle, "--prompt-ids", "5,6,7", "--backend", "qnn"]) == 2
    assert main(["check", tiny_bundle, "--backend", "qnn"]) == 2
    err = capsys.readouterr().err
    assert "pip install onnxruntime-qnn" in err and "Traceback" not in err


def _with_unplaceable_node(src: str, dst: str) -> str:
    """A copy of the bundle whose T=1 step ends in Hardmax (standard ONNX, same shape; QNN has no kernel)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, load_manifest(dst).target.graph(C.STEP, 1).file)
    model = onnx.load(path, load_external_data=False)
    for node in model.graph.node:
        node.output[:] = ["logits_raw" if o == C.LOGITS else o for o in node.output]
    model.graph.node.append(onnx.helper.make_node("Hardmax", ["logits_raw"], [C.LOGITS], name="odd_hardmax", axis=-1))
    onnx.save(model, path)
    return dst


def test_graph_with_unplaceable_nodes_names_them(tiny_bundle, tmp_path):
    bundle = _with_unplaceable_node(tiny_bundle, str(tmp_path / "odd"))
    graph = os.path.join(bundle, load_manifest(bundle).target.graph(C.STEP, 1).file)
    backend, weights = _backend_for(bundle)
    with pytest.raises(BackendError, match=r"1 of \d+ nodes cannot run on QNN \(HTP\): Hardmax 'odd_hardmax'"):
        backend.load(graph, weights)
    assert not os.listdir(backend.cache.root) or all(not n.startswith(".") for n in os.listdir(backend.cache.root))
    gen = Generator.load(bundle, backend="qnn")
    with pytest.raises(PlacementError, match="Hardmax 'odd_hardmax'") as e:  # not worded as a corrupt bundle
        gen.generate([5, 6, 7], 4, proposer="none")
    assert "corrupt" not in str(e.value)
    gen.close()
    # Asked for, CPU fallback runs it, and the placement says where each node went.
    backend, weights = _backend_for(bundle, cpu_fallback=True)
    backend.load(graph, weights)
    assert backend.loads[-1].placement["CPUExecutionProvider"] == 1 and backend.loads[-1].placement[EP] > 100


# -- SmolLM2 -------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_on_qnn_every_node_placed_and_top1_measured(smollm2_path, tmp_path_factory):
    """The real model in the qnn-fp16 flavour on the emulated HTP, teacher-forced over 16 tokens of CPU float32
    greedy output. Every node runs on QNN, and the top-1 choices are the CPU's: measured 16/16 on this prompt and
    another. It was 9/16 while the scaled RMSNorm divided by its row's max |x| m and added eps/m^2: the HTP
    divides by multiplying with the reciprocal and flushes fp16 subnormals, so 1/m for m > 16384 (SmolLM2's
    massive activation, |x| ~ 2.5e4) was 0, and m^2 overflowed to inf for m > 255, where the HTP's eps/inf is
    not 0 (a one-token step's norms came out 20x off). The float32 graphs without the flavour's scaled norm agree
    0/16: their squares overflow fp16."""
    root = tmp_path_factory.mktemp("smollm2_qnn")
    small = dict(context=256, prefill_chunk=32, gammas=(4,))
    cpu_bundle, qnn_bundle = str(root / "cpu"), str(root / "qnn")
    export_bundle(smollm2_path, cpu_bundle, ExportOptions(**small), progress=False)
    export_bundle(smollm2_path, qnn_bundle, ExportOptions(**small, dtype="float16", flavour="qnn-fp16", tree_sizes=(8,)),
                  progress=False)
    n = 16
    cpu, qnn = Generator.load(cpu_bundle), Generator.load(qnn_bundle, backend="qnn")
    try:
        prompt = cpu.tokenizer.apply_chat_template([{"role": "user", "content": "Rewrite in Python 3: print 'hello %s' % name"}])
        want = cpu.generate(prompt, n, proposer="none", stop_ids=[]).tokens
        fed = [prompt[-1]] + want[:-1]
        qnn.target.prefill(prompt[:-1])
        decoded = np.stack([qnn.target.run([t])[0].copy() for t in fed])
        got = decoded.argmax(-1).tolist()
        agree = sum(a == b for a, b in zip(got, want))
        print(f"SmolLM2 qnn-fp16 top-1 agreement with CPU float32: {agree}/{n}", file=sys.stderr)
        assert agree >= n - 1, (got, want)
        # A 5-token verify step over the same tokens computes the one-token steps' logits bit for bit on the HTP.
        # Before the flavour's one-token step was built with the verify step's ops (same_ops), its rows drifted
        # from layer 2 on (1.7 in the logits from a random cache).
        qnn.target.reset()
        qnn.target.prefill(prompt[:-1])
        np.testing.assert_array_equal(qnn.target.run(fed[:5]), decoded[:5])
        assert qnn.backend.loads and all(r.all_on_qnn for r in qnn.backend.loads)
        # An 8-row token tree (spine and leaves) computes each row as decode does along its path, from a random
        # cache (check's comparison, at a fill where it failed before): bit for bit since check fills a float16
        # cache's stale slots with 16, not 1e4, whose scores overflow float16 (at 1e4: 0.016 in the new K/V
        # and the logits of one row, from layer 21 on).
        entry = load_manifest(qnn_bundle).target
        tree8 = next(g for g in entry.graphs if g.step_mask and g.tokens == 8 and g.context == 128)
        driver = GraphDriver(qnn_bundle, entry, qnn.backend, seed=1)
        rows = tree_rows(driver, tree8, one_token_steps(entry)[128], 117)
        driver.close()
        assert rows.tree and rows.exact, rows
    finally:
        cpu.close()
        qnn.close()
