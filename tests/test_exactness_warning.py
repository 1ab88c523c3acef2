"""Speculation where a bundle's verify rows are not known to equal decode rows bit for bit (runtime/exactness.py)
runs, and says so once: float16 graphs on onnxruntime's CPU kernels, the portable flavour on QNN, backends the
suite cannot run. Where the suite proves the rows exact (float32 on the CPU, the QNN flavours on QNN), nothing."""
from __future__ import annotations

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


def _manifest(flavour: str, dtype: str, quant: dict | None = None) -> SimpleNamespace:
    """What unverified_rows reads of a manifest."""
    return SimpleNamespace(export={"flavour": flavour},
                           target=SimpleNamespace(dims=SimpleNamespace(dtype=dtype), quant=quant))


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
    its layout like a multi-row one (runtime/kernel_probe.py asks the machine; here its answer is set)."""
    asked = []

    def rows_alike(bits, block):  # with alike False: only int4 in blocks of 32 and 64 differ here
        asked.append((bits, block))
        return alike or (bits, block) not in ((4, 32), (4, 64))
    monkeypatch.setattr(kernel_probe, "rows_alike", rows_alike)
    why = unverified_rows(_manifest("portable", "float32", {"bits": 4, "block": 32, "head_bits": 8}), "cpu")
    assert {(4, 32), (8, 32)} <= set(asked)
    assert (why is None) == alike
    if not alike:  # what to export instead is what the machine computes alike: int8, int4 in its smallest block
        assert "int4 in blocks of 32" in why and "int8 in" not in why
        assert why.endswith("re-export with --quant int8 or --quant int4 --quant-block 16")


def test_the_advice_follows_what_the_machine_computes_alike(monkeypatch):
    """On a CPU where int4 in blocks of 16 is the layout that differs (onnxruntime 1.32's aarch64 kernels, under
    emulation: benchmarks/arm/README.md), the advice is blocks of 32; where no layout is alike, float32."""
    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block: (bits, block) != (4, 16))
    why = kernel_probe.why_inexact({"bits": 4, "block": 16, "head_bits": 8})
    assert "int4 in blocks of 16" in why and why.endswith("--quant int8 or --quant int4 --quant-block 32")
    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block: False)
    why = kernel_probe.why_inexact({"bits": 8, "block": 32, "head_bits": 8})
    assert "int8 in blocks of 32" in why and why.endswith("a float32 bundle is")


@pytest.mark.parametrize("alike", [True, False])
def test_export_notes_a_layout_this_machine_computes_inexactly(tiny_models, tmp_path, monkeypatch, capsys, alike):
    """`specedge export` says at once when the machine it runs on would not compute the new bundle's rows
    alike (the probe's answer set here both ways); the bundle is written all the same."""
    monkeypatch.setattr(kernel_probe, "rows_alike", lambda bits, block: alike or bits == 8)
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
    """The tiny llama as int4 graphs in blocks of 32 and of 16 (the default)."""
    root = tmp_path_factory.mktemp("int4")
    out = {}
    for block in (32, None):
        out[block] = str(root / f"int4-{block}")
        export_bundle(tiny_models["llama"][0], out[block], ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(2,),
                                                                         quant="int4", quant_block=block),
                      progress=False)
    return out


def test_int4_rows_are_measured_on_this_machine(int4_bundles):
    """Which kernel computes a one-row int4 product depends on the CPU: with AVX-512 one kernel takes every row
    count; on AVX2-only x86 a one-row product in blocks of 32 has a kernel of its own; on aarch64 (emulated) four
    rows of blocks of 16 do. The probe's verdicts agree with `specedge check`'s measurement of a bundle's rows,
    and speculation warns exactly where they are not exact. Blocks of 16 (the default) are exact, and silent,
    on both kinds of x86."""
    from specedge.tools.check import check_bundle

    b32_alike, default_alike = kernel_probe.rows_alike(4, 32), kernel_probe.rows_alike(4, DEFAULT_BLOCK[4])
    print(f"int4 rows alike on this machine: in blocks of 32 {b32_alike}, of {DEFAULT_BLOCK[4]} {default_alike}")
    assert default_alike or platform.machine().lower() not in ("x86_64", "amd64")  # exact on every x86 measured
    for block, exact in ((32, b32_alike), (None, default_alike)):
        report = check_bundle(int4_bundles[block])
        assert [ok for ok, text in report.lines if "exact rows" in text] == [exact], report.render()
        assert exact or "re-export with --quant int8" in report.render()
        gen = Generator.load(int4_bundles[block])
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                res = gen.generate(PROMPT, 8, proposer="ngram", gamma=2, stop_ids=[], adaptive=False)
        finally:
            gen.close()
        warned = [str(w.message) for w in caught if issubclass(w.category, InexactRowsWarning)]
        assert len(warned) == (0 if exact else 1), warned
        assert all(f"int4 in blocks of {block or DEFAULT_BLOCK[4]}" in w and "--quant int8" in w for w in warned)
        assert res.stats.proposed > 0


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
