"""Speculation where a bundle's verify rows are not known to equal decode rows bit for bit (runtime/exactness.py)
runs, and says so once: float16 graphs on onnxruntime's CPU kernels, the portable flavour on QNN, backends the
suite cannot run. Where the suite proves the rows exact (float32 on the CPU, the QNN flavours on QNN), nothing."""
from __future__ import annotations

import importlib.util
import json
import platform
import warnings
from types import SimpleNamespace

import pytest
from conftest import CHUNK

from specedge.cli import main
from specedge.export.bundle import ExportOptions, export_bundle
from specedge.graphs.manifest import load_manifest
from specedge.graphs.quant import DEFAULT_BLOCK
from specedge.runtime import kernel_probe
from specedge.runtime.batch import BatchGenerator
from specedge.runtime.exactness import InexactRowsWarning, unverified_rows
from specedge.runtime.generator import Generator

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5]


@pytest.fixture(scope="module")
def fp16_bundles(tiny_models, tmp_path_factory):
    """The tiny llama as float16 graphs, batch 1 and batch 2, and in the qnn-fp16 flavour."""
    root = tmp_path_factory.mktemp("fp16")
    out = {}
    for name, options in (("b1", {}), ("b2", {"batch": 2}), ("qnn-fp16", {"flavour": "qnn-fp16"})):
        out[name] = str(root / name)
        export_bundle(tiny_models["llama"][0], out[name], ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(2,),
                                                                        dtype="float16", **options), progress=False)
    return out


def _model(quant: dict | None, steps: tuple[int, ...] = (1, 3)) -> SimpleNamespace:
    """What kernel_probe reads of a manifest's model: its quant record and step graphs (by default, those of
    --gamma 2: no T=2 graph to decode in two rows)."""
    return SimpleNamespace(quant=quant, layers_of=None, step_tokens=lambda: list(steps))


def _manifest(flavour: str, dtype: str, quant: dict | None = None) -> SimpleNamespace:
    """What unverified_rows reads of a manifest."""
    target = _model(quant)
    target.dims = SimpleNamespace(dtype=dtype)
    return SimpleNamespace(export={"flavour": flavour}, target=target)


@pytest.mark.parametrize("flavour,dtype,backend,verified", [
    ("portable", "float32", "cpu", True), ("portable", "float32", "ort", True),
    ("portable", "float16", "cpu", False), ("qnn-fp16", "float16", "cpu", False),
    ("qnn-qdq16", "float32", "cpu", False), ("portable", "float32", "qnn", False),
    ("qnn-fp16", "float16", "qnn", True), ("qnn-qdq16", "float32", "qnn", True),
    ("portable", "float32", "cuda", False), ("portable", "float16", "tensorrt", False)])
def test_which_rows_are_verified(flavour, dtype, backend, verified):
    """The table follows what the suite checks: float32 on the CPU (test_graph_parity, test_quant: every row
    exact, quantized bundles included), the QNN flavours on QNN (test_qnn, test_qnn_qdq)."""
    assert (unverified_rows(_manifest(flavour, dtype), backend) is None) == verified


@pytest.mark.parametrize("alike", [True, False])
def test_quantized_rows_are_verified_where_the_machine_computes_them_alike(monkeypatch, alike):
    """A quantized bundle's rows are exact on the CPU where onnxruntime's kernels compute a one-row product of
    its layout like a multi-row one (runtime/kernel_probe.py asks the machine; here its answer is set), as the
    backend loads it: int4 in blocks of 32 where only blocks of 16 are alike is loaded re-blocked into 16."""
    asked = []

    def rows_alike(bits, block, least=1):  # with alike False: int4 is alike in blocks of 16 only
        asked.append((bits, block))
        return alike or bits == 8 or block == 16
    monkeypatch.setattr(kernel_probe, "rows_alike", rows_alike)
    assert unverified_rows(_manifest("portable", "float32", {"bits": 4, "block": 32, "head_bits": 8}), "cpu") is None
    assert {(4, 32), (8, 32)} <= set(asked) and ((4, 16) in asked) != alike
    plan = kernel_probe.row_plan(_model({"bits": 4, "block": 128, "head_bits": 8}), "cpu")
    assert plan == kernel_probe.RowPlan(int4_block=None if alike else 16)
    # int8 is never re-blocked, and other backends than onnxruntime's CPU ones load graphs as they are
    assert kernel_probe.row_plan(_model({"bits": 8, "block": 128, "head_bits": 8}), "cpu") == kernel_probe.RowPlan()
    assert kernel_probe.row_plan(_model({"bits": 4, "block": 128, "head_bits": 8}), "cuda") == kernel_probe.RowPlan()


def test_two_row_decode_comes_before_re_blocking(monkeypatch):
    """Where only the one-row product differs (int4 in blocks of 32 on an AVX2-only CPU: every product of two
    rows or more computes each row alike) and the model has a T=2 step graph, it decodes in two rows in its own
    layout; without that graph it is re-blocked. A draft decodes in one-row steps (its rows only propose), one cut
    from the target's layers in the target's layout (they share packed weights), a draft model as exported."""
    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block, least=1: bits == 8 or block == 16 or least == 2)
    quant = {"bits": 4, "block": 32, "head_bits": 8}
    target = _model(quant, steps=(1, 2, 3, 5, 9))
    assert kernel_probe.row_plan(target, "cpu") == kernel_probe.RowPlan(min_rows=2)
    assert kernel_probe.row_plan(target, "ort") == kernel_probe.RowPlan(min_rows=2)
    assert kernel_probe.row_plan(_model(quant, steps=(1, 5, 9)), "cpu") == kernel_probe.RowPlan(int4_block=16)
    draft = _model(quant, steps=(1, 2))
    draft.layers_of = "target"
    assert kernel_probe.row_plan(draft, "cpu", _model(quant, steps=(1, 5))) == kernel_probe.RowPlan(int4_block=16)
    assert kernel_probe.row_plan(draft, "cpu", target) == kernel_probe.RowPlan()
    draft.layers_of = None  # a draft model of its own, in blocks of 32 like the target
    assert kernel_probe.row_plan(draft, "cpu", _model(quant, steps=(1, 5))) == kernel_probe.RowPlan()
    assert kernel_probe.row_plan(draft, "cpu") == kernel_probe.RowPlan(min_rows=2)  # planned as a target
    assert kernel_probe.RowPlan(min_rows=2).min_tokens(1) == 2 and kernel_probe.RowPlan(min_rows=2).min_tokens(4) == 1
    target.dims = SimpleNamespace(dtype="float32")
    assert unverified_rows(SimpleNamespace(export={}, target=target), "cpu") is None  # exact as the runtime runs it


@pytest.mark.parametrize("onnx_installed", [True, False])
def test_rows_no_smaller_block_makes_exact_are_not_verified(monkeypatch, onnx_installed):
    """Where no block that divides the bundle's is alike (int4 in blocks of 16 on aarch64, every int4 block on a
    Cortex-A72: benchmarks/arm/README.md), or the onnx package the rewrite needs is missing, the rows are not
    verified, and the advice names the layouts this machine computes alike."""
    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block, least=1: bits == 8 or block == 32)
    if not onnx_installed:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else real(name, *a))
    why = unverified_rows(_manifest("portable", "float32", {"bits": 4, "block": 16, "head_bits": 8}), "cpu")
    assert "int4 in blocks of 16" in why and "int8 in" not in why
    assert why.endswith("re-export with --quant int8 or --quant int4 --quant-block 32")
    why = unverified_rows(_manifest("portable", "float32", {"bits": 4, "block": 64, "head_bits": 8}), "cpu")
    assert (why is None) == onnx_installed  # 64 is loaded as 32 where the rewrite can be done
    if not onnx_installed:
        assert "int4 in blocks of 64" in why and why.endswith("pip install onnx: the runtime then loads its int4 "
                                                             "products in blocks of 32, exact here)")


def test_the_advice_follows_what_the_machine_computes_alike(monkeypatch):
    """On a CPU where int4 in blocks of 16 is the layout that differs (onnxruntime 1.32's aarch64 kernels, under
    emulation: benchmarks/arm/README.md), the advice is blocks of 32; where no layout is alike, float32."""
    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block, least=1: (bits, block) != (4, 16))
    why = kernel_probe.why_inexact(_model({"bits": 4, "block": 16, "head_bits": 8}))
    assert "int4 in blocks of 16" in why and why.endswith("--quant int8 or --quant int4 --quant-block 32")
    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block, least=1: False)
    why = kernel_probe.why_inexact(_model({"bits": 8, "block": 32, "head_bits": 8}))
    assert "int8 in blocks of 32" in why and why.endswith("a float32 bundle is")
    # two rows alike, no smaller block alike, no T=2 graph to decode in: the advice names the export that has one
    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block, least=1: bits == 8 or least == 2)
    why = kernel_probe.why_inexact(_model({"bits": 4, "block": 32, "head_bits": 8}))
    assert why.endswith("(or re-export with 1 among --gamma: decode then runs in its two-token step graph, exact here)")
    assert kernel_probe.why_inexact(_model({"bits": 4, "block": 32, "head_bits": 8}, steps=(1, 2, 3))) is None


@pytest.mark.parametrize("alike", [True, False])
def test_export_notes_a_layout_this_machine_computes_inexactly(tiny_models, tmp_path, monkeypatch, capsys, alike):
    """`specedge export` says at once when the machine it runs on would not compute the new bundle's rows
    alike (the probe's answer set here both ways); the bundle is written all the same."""
    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block, least=1: alike or bits == 8)
    out = tmp_path / "int4-32"
    assert main(["export", "--target", tiny_models["llama"][0], "--out", str(out), "--context", "64", "--gamma", "2",
                 "--prefill-chunk", str(CHUNK), "--quant", "int4", "--quant-block", "32", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert (out / "manifest.json").exists()
    if alike:
        assert "note:" not in err
    else:
        assert "speculation on target will not be exact here" in err
        assert "int4 in blocks of 32" in err and "int8 in" not in err and "--quant int8" in err


@pytest.fixture(scope="module")
def int4_bundles(tiny_models, tmp_path_factory):
    """The tiny llama as int4 graphs in blocks of 32 (the default) and of 16 with --gamma 2 (step graphs T=1
    and 3), and in blocks of 32 with --gamma 1,2 ("two-row": a T=2 step graph too)."""
    root = tmp_path_factory.mktemp("int4")
    out = {}
    for key, block, gammas in ((None, None, (2,)), (16, 16, (2,)), ("two-row", None, (1, 2))):
        out[key] = str(root / f"int4-{key}")
        export_bundle(tiny_models["llama"][0], out[key], ExportOptions(context=64, prefill_chunk=CHUNK, gammas=gammas,
                                                                       quant="int4", quant_block=block),
                      progress=False)
    return out


def test_int4_rows_are_measured_on_this_machine(int4_bundles):
    """Which kernel computes a one-row int4 product depends on the CPU: with AVX-512 one kernel takes every row
    count; on AVX2-only x86 a one-row product in blocks of 32 has a kernel of its own, so a bundle in blocks of
    32 decodes in two-row steps there, or without a T=2 graph is loaded re-blocked into 16; on aarch64
    (emulated) four rows of blocks of 16 differ. The probe's verdicts agree with `specedge check`'s measurement
    of a bundle's rows as the runtime loads and runs them, and speculation warns exactly where they are not
    exact. The bundles are exact, and silent, on both kinds of x86 (aarch64 is another story: with the int8 dot
    product blocks of 32 are exact and 16 are not)."""
    from specedge.tools.check import check_bundle

    for key in (None, 16, "two-row"):
        bundle = int4_bundles[key]
        target = load_manifest(bundle).target
        block = target.quant["block"]
        assert block == (16 if key == 16 else DEFAULT_BLOCK[4])
        plan = kernel_probe.row_plan(target, "cpu")
        loaded = plan.int4_block or block
        exact = kernel_probe.rows_alike(4, loaded, plan.min_rows)
        print(f"int4 in blocks of {block}, step graphs {target.step_tokens()}: {plan}, rows alike {exact}")
        assert exact or platform.machine().lower() not in ("x86_64", "amd64")  # exact on every x86 measured
        report = check_bundle(bundle)
        assert [ok for ok, text in report.lines if "exact rows" in text] == [exact], report.render()
        assert exact or "re-export with --quant int8" in report.render()
        gen = Generator.load(bundle)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                res = gen.generate(PROMPT, 8, proposer="ngram", gamma=2, stop_ids=[], adaptive=False)
        finally:
            gen.close()
        warned = [str(w.message) for w in caught if issubclass(w.category, InexactRowsWarning)]
        assert len(warned) == (0 if exact else 1), warned
        assert all(f"int4 in blocks of {loaded}" in w and "--quant int8" in w for w in warned)
        assert res.stats.proposed > 0


@pytest.mark.parametrize("backend,cache", [("cpu", True), ("cpu", False), ("ort", False)])
def test_an_inexact_int4_block_is_loaded_in_a_smaller_exact_one(int4_bundles, tmp_path, monkeypatch, backend, cache):
    """With the probe's answer set as on an AVX2-only CPU (int4 in blocks of 32 differs, of 16 is alike), a
    bundle in blocks of 32 (the default) is loaded re-blocked into blocks of 16 (runtime/reblock.py), through
    the optimized-graph cache, without it, and on the Python API backend: its rows are exact as `specedge check` measures
    them on this machine, speculation says nothing, and its greedy output equals plain decode's with drafts
    accepted and rejected."""
    from specedge.runtime import reblock
    from specedge.tools.check import check_bundle

    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block, least=1: bits == 8 or block == 16)
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECEDGE_ORT_CACHE", "1" if cache else "0")
    rewritten = []
    real = reblock.reblock_int4
    monkeypatch.setattr(reblock, "reblock_int4", lambda model, block: rewritten.append(block) or real(model, block))
    assert load_manifest(int4_bundles[None]).target.quant["block"] == 32
    report = check_bundle(int4_bundles[None], backend=backend, exact_rows=True)
    assert report.ok and [ok for ok, text in report.lines if "exact rows" in text] == [True], report.render()
    assert "int4 loaded in blocks of 16 on this machine, the bundle's 32 re-blocked" in report.render()
    assert rewritten and set(rewritten) == {16}
    gen = Generator.load(int4_bundles[None], backend=backend)
    try:
        plain = gen.generate(PROMPT, 24, proposer="none", stop_ids=[]).tokens
        with warnings.catch_warnings():
            warnings.simplefilter("error", InexactRowsWarning)
            spec = gen.generate(PROMPT, 24, proposer="ngram", gamma=2, stop_ids=[], adaptive=False)
    finally:
        gen.close()
    assert spec.tokens == plain
    assert spec.stats.proposed > 0 and spec.stats.accepted > 0 and spec.stats.proposed > spec.stats.accepted


@pytest.mark.parametrize("backend,cache", [("cpu", True), ("cpu", False), ("ort", False)])
def test_a_lone_inexact_row_decodes_as_two_rows(int4_bundles, tmp_path, monkeypatch, backend, cache):
    """With the probe's answer set as on an AVX2-only CPU (int4 in blocks of 32 computes a lone row unlike the
    rows of a multi-row product, and those alike at every count), a bundle in blocks of 32 with a T=2 step graph
    is loaded as it is and decodes each token as a two-row step: no graph is re-blocked, no T=1 graph is ever
    loaded, `specedge check` measures its rows exact as the runtime runs them, speculation says nothing, and
    greedy output equals plain decode's with drafts accepted and rejected. On this machine's real kernels (an
    AVX2 one: one-row products in blocks of 32 differ) this is the exactness that the plan buys."""
    from specedge.runtime import reblock
    from specedge.tools.check import check_bundle

    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block, least=1: bits == 8 or least == 2)
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECEDGE_ORT_CACHE", "1" if cache else "0")
    monkeypatch.setattr(reblock, "reblock_int4", lambda model, block: pytest.fail("re-blocked"))
    bundle = int4_bundles["two-row"]
    report = check_bundle(bundle, backend=backend, exact_rows=True)
    assert report.ok and [ok for ok, text in report.lines if "exact rows" in text] == [True], report.render()
    assert "decode as two-row steps on this machine" in report.render()
    gen = Generator.load(bundle, backend=backend)
    try:
        assert gen.target.plan == kernel_probe.RowPlan(min_rows=2)
        plain = gen.generate(PROMPT, 24, proposer="none", stop_ids=[]).tokens
        with warnings.catch_warnings():
            warnings.simplefilter("error", InexactRowsWarning)
            spec = gen.generate(PROMPT, 24, proposer="ngram", gamma=2, stop_ids=[], adaptive=False)
        loaded = {(role, tokens) for role, tokens, _ in gen.target._steps}
    finally:
        gen.close()
    assert spec.tokens == plain
    assert spec.stats.proposed > 0 and spec.stats.accepted > 0 and spec.stats.proposed > spec.stats.accepted
    assert ("step", 2) in loaded and ("step", 3) in loaded and ("step", 1) not in loaded, loaded


@pytest.fixture(scope="module")
def int4_draft_bundles(tiny_models, tiny_near_draft_model, tmp_path_factory):
    """The tiny llama as int4 graphs in blocks of 32 with a T=2 step graph (--gamma 1,2), with a layer draft
    (its first layer) and with a draft model of its own (a perturbed copy, int4 too)."""
    root = tmp_path_factory.mktemp("int4_drafts")
    out = {}
    for kind, options, draft in (("layer", {"draft_layers": 1}, None), ("model", {}, tiny_near_draft_model[0])):
        out[kind] = str(root / kind)
        export_bundle(tiny_models["llama"][0], out[kind], ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(1, 2),
                                                                        quant="int4", **options),
                      draft_path=draft, progress=False)
    return out


@pytest.mark.parametrize("kind", ["layer", "model"])
def test_a_draft_decodes_in_one_row_steps_while_the_target_decodes_in_two(int4_draft_bundles, monkeypatch, kind):
    """A draft's rows only propose: with the probe's answer set as on an AVX2-only CPU (a lone int4 row in blocks
    of 32 differs), the target decodes in two rows and the draft, a layer draft or a draft model, in one-row steps
    through that kernel; greedy output still equals plain decode's, drafts accepted and rejected, and `specedge
    check --exact-rows` passes, saying where the draft's rows differ. On this machine's real kernels (on an AVX2
    one the one-row kernel is the lone row's, unlike the rest) that is a measured difference, not a set one."""
    from specedge.tools.check import check_bundle

    lone_row_alike = kernel_probe.rows_alike(4, DEFAULT_BLOCK[4])  # this machine's real answer
    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block, least=1: bits == 8 or least == 2)
    bundle = int4_draft_bundles[kind]
    assert load_manifest(bundle).draft.quant["bits"] == 4
    report = check_bundle(bundle, exact_rows=True)
    assert report.ok, report.render()
    draft_rows = [text for _, text in report.lines if text.startswith("draft: ") and "rows" in text]
    assert len(draft_rows) == 1 and draft_rows[0].startswith(
        "draft: exact rows" if lone_row_alike else "draft: rows differ from decode's"), draft_rows
    assert lone_row_alike or "a draft only proposes, so speculation stays exact" in draft_rows[0]
    gen = Generator.load(bundle)
    try:
        assert gen.target.plan == kernel_probe.RowPlan(min_rows=2) and gen.draft.plan == kernel_probe.RowPlan()
        plain = gen.generate(PROMPT, 24, proposer="none", stop_ids=[]).tokens
        with warnings.catch_warnings():
            warnings.simplefilter("error", InexactRowsWarning)
            spec = gen.generate(PROMPT, 24, proposer="draft", gamma=2, stop_ids=[], adaptive=False)
        target_steps = {tokens for role, tokens, _ in gen.target._steps if role == "step"}
        draft_steps = {tokens for role, tokens, _ in gen.draft._steps if role == "step"}
    finally:
        gen.close()
    assert spec.tokens == plain
    assert spec.stats.proposed > spec.stats.accepted > 0
    assert 1 not in target_steps and 1 in draft_steps, (target_steps, draft_steps)


def test_bundles_without_a_flavour_record_are_portable(tiny_bundle):
    manifest = load_manifest(tiny_bundle)
    manifest.export.pop("flavour", None)
    assert unverified_rows(manifest, "cpu") is None and "portable flavour" in unverified_rows(manifest, "qnn")


def test_speculation_on_float16_cpu_graphs_warns_once(fp16_bundles):
    gen = Generator.load(fp16_bundles["b1"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", InexactRowsWarning)
            plain = gen.generate(PROMPT, 8, proposer="none", stop_ids=[]).tokens  # plain decode is what it is
        with pytest.warns(InexactRowsWarning, match="float16 graphs on onnxruntime's CPU kernels") as caught:
            spec = gen.generate(PROMPT, 8, proposer="ngram", gamma=2, stop_ids=[], adaptive=False)
        assert len(caught) == 1 and "--backend cpu --exact-rows" in str(caught[0].message)
        assert spec.stats.proposed > 0  # it ran speculatively all the same
        assert len(spec.tokens) == len(plain) == 8
    finally:
        gen.close()


def test_speculation_on_verified_rows_is_silent(tiny_bundle):
    gen = Generator.load(tiny_bundle)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", InexactRowsWarning)
            gen.generate(PROMPT, 8, proposer="ngram", gamma=2, stop_ids=[])
    finally:
        gen.close()


def test_a_batch_warns_too(fp16_bundles):
    gen = BatchGenerator.load(fp16_bundles["b2"])
    try:
        with pytest.warns(InexactRowsWarning, match="float16"):
            results = gen.generate_batch([PROMPT, PROMPT[:7]], 6, proposer="ngram", gamma=2, stop_ids=[])
        assert [len(r.tokens) for r in results] == [6, 6]
    finally:
        gen.close()


def test_the_command_prints_one_line(fp16_bundles, capfd):
    """capfd: onnxruntime writes its own log lines to the process's stderr; at its warning level a float16 graph on
    the CPU added lines such as "Could not find a CPU kernel and hence can't constant fold Where node"."""
    args = ["generate", fp16_bundles["qnn-fp16"], "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6",
            "--json"]
    assert main(args + ["--proposer", "ngram", "--gamma", "2"]) == 0
    out, err = capfd.readouterr()
    assert len(json.loads(out)["tokens"]) == 6 and ":onnxruntime:" not in err, err
    (warned,) = [line for line in err.splitlines() if "warning" in line]
    assert warned.startswith("specedge generate: warning: speculation on backend cpu is not known to be exact")
    assert main(args + ["--proposer", "none"]) == 0
    assert "warning" not in capfd.readouterr().err
