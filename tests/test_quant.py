"""Weight-only quantized bundles (--quant int8|int4): layout, export, parity with a dequantized oracle, GGUF
blocks copied bit for bit, exact speculation on quantized graphs, and bad input.

The oracles are independent of the exporter: onnx's own int4 decoder for the packing, transformers running
the dequantized weights (read back from the bundle's weights file and dequantized here with numpy) for the
logits, gguf's own dequantizer for the GGUF blocks, and plain greedy decode for speculative output."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models import GEMMA_CASES, ContractDriver, make_hf_model

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.graphs import quant as Q
from specedge.graphs.manifest import load_manifest, read_index, weights_index_file
from specedge.runtime.generator import Generator
from specedge.tools.check import check_bundle

CHUNK = 16


# -- layout and numerics ------------------------------------------------------------------------------
def test_int4_packing_matches_onnx_decoder():
    rng = np.random.default_rng(0)
    for shape in [(64, 48), (7, 3), (1,)]:
        q = rng.integers(-8, 8, shape).astype(np.int8)
        packed = Q.pack_int4(q)
        t = helper.make_tensor("w", TensorProto.INT4, list(shape), packed.tobytes(), raw=True)
        np.testing.assert_array_equal(numpy_helper.to_array(t).astype(np.int8), q)
        np.testing.assert_array_equal(Q.unpack_int4(packed, shape), q)


def test_quantizing_by_chunks_of_columns_changes_nothing(monkeypatch):
    """graphs/quant.py quantizes COLUMNS columns at a time (the export's memory): the same integers, scales,
    offsets and reported error as the whole matrix at once, for a width that is not a multiple of the chunk."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((72, 50)) * rng.uniform(0.1, 3, 50)).astype(np.float32)
    monkeypatch.setattr(Q, "COLUMNS", 16)
    chunked = [Q.quantize_blocks(w, 4, 32), Q.quantize_blocks(w, 8, 32), Q.quantize_offset_blocks(w, 4, 32)]
    error = Q.relative_error(w, Q.Blocks(*chunked[0], 4, 32))
    monkeypatch.setattr(Q, "COLUMNS", 1 << 20)
    whole = [Q.quantize_blocks(w, 4, 32), Q.quantize_blocks(w, 8, 32), Q.quantize_offset_blocks(w, 4, 32)]
    for got, want in zip(chunked, whole):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    deq = Q.dequantize_blocks(*whole[0], 32)
    assert error == pytest.approx(np.linalg.norm(w - deq) / np.linalg.norm(w), rel=1e-6) and error > 0.01


@pytest.mark.parametrize("bits,block,K,search", [(4, 32, 64, True), (8, 32, 96, True), (4, 128, 576, True),
                                                 (8, 16, 40, True), (4, 32, 64, False)])
def test_quantize_blocks_rounds_to_nearest_on_a_symmetric_grid(bits, block, K, search):
    rng = np.random.default_rng(bits + block)
    w = rng.standard_normal((K, 24)).astype(np.float32)
    w[:block, 0] = 0  # an all-zero block stays exactly zero
    q, scale = Q.quantize_blocks(w, bits, block, search=search)
    lo, hi = (-8, 7) if bits == 4 else (-127, 127)
    assert q.dtype == np.int8 and scale.shape == (-(-K // block), 24)
    assert q.min() >= lo and q.max() <= hi and np.all(scale > 0)
    full = np.repeat(scale, block, axis=0)[:K]
    deq = q.astype(np.float32) * full
    assert np.all(deq[:block, 0] == 0)
    # every weight sits at the grid value nearest to it (within half a step, or clipped at an end of the grid)
    inside = (w >= lo * full) & (w <= hi * full)
    assert np.all(np.abs(w - deq)[inside] <= full[inside] / 2 * (1 + 1e-5))
    assert np.all(deq[~inside] == np.where(w[~inside] > 0, hi, lo).astype(np.float32) * full[~inside])
    if bits == 8 or not search:  # the block's largest magnitude is exact
        for b in range(-(-K // block)):
            rows = slice(b * block, min(K, (b + 1) * block))
            assert np.allclose(np.abs(deq[rows]).max(axis=0)[1:], np.abs(w[rows]).max(axis=0)[1:], rtol=1e-6)
    else:  # the searched scale never does worse, per block, than plain round-to-nearest with amax -> 7
        nb = -(-K // block)
        pad = np.zeros((nb * block, 24), np.float32)
        pad[:K] = w
        blocks = pad.reshape(nb, block, 24)
        amax = np.abs(blocks).max(axis=1)
        plain_s = np.where(amax > 0, amax / 7, 1)[:, None, :]
        plain_err = ((np.clip(np.rint(blocks / plain_s), -7, 7) * plain_s - blocks) ** 2).sum(axis=1)
        pad[:K] = deq
        ours_err = ((pad.reshape(nb, block, 24) - blocks) ** 2).sum(axis=1)
        assert np.all(ours_err <= plain_err * (1 + 1e-6))
        assert ours_err.sum() < 0.9 * plain_err.sum()  # and on Gaussian weights clearly better


def test_parse_quant_rejects_bad_values():
    assert Q.parse_quant("none", None) is None
    smooth = Q.DEFAULT_SMOOTH  # smoothed by default (graphs/quant.py), except the offset scheme's copied blocks
    assert Q.parse_quant("int4", None) == Q.QuantSpec(bits=4, block=32, head_bits=8, smooth=smooth)  # AVX2: 16
    assert Q.parse_quant("int8", None) == Q.QuantSpec(bits=8, block=32, head_bits=8, smooth=smooth)
    assert Q.parse_quant("int8", None, None, "rows") == Q.QuantSpec(bits=8, block=32, head_bits=8, rows=True,
                                                                    smooth=smooth)
    assert Q.parse_quant("int4", None, None, "offset") == Q.QuantSpec(bits=4, block=32, head_bits=8, offsets=True)
    assert Q.parse_quant("int4", None, None, None, 0.0).smooth == 0.0
    for args in [("int3", None), ("int4", 48), ("int4", 8), ("int8", 512), ("none", 32), ("int4", 32, "int2"),
                 ("int4", None, None, "rows"), ("int8", None, "int4", "rows"), ("int4", None, None, "offset", 0.5),
                 ("int8", None, None, None, -0.1), ("int8", None, None, None, 1.0), ("none", None, None, None, 0.5)]:
        with pytest.raises(ValueError):
            Q.parse_quant(*args)


# -- export of the tiny families ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quant_bundles(tiny_models, tmp_path_factory):
    """(family, mode) -> bundle, for every tiny family in int8, int4 and int4 with offsets (qwen2's head is
    tied)."""
    root = tmp_path_factory.mktemp("quant_bundles")
    out = {}
    for family, (path, _) in tiny_models.items():
        for mode in ("int8", "int4", "int4-offset"):
            bundle = str(root / f"{family}-{mode}")
            export_bundle(path, bundle, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,), quant=mode[:4],
                                                      quant_block=16 if family == "qwen3" else None,
                                                      quant_scheme=mode[5:] or None),
                          progress=False)
            out[family, mode] = bundle
    return out


def test_quantized_bundles_pass_check_and_are_standard_domain(quant_bundles):
    for (family, mode), bundle in quant_bundles.items():
        report = check_bundle(bundle)
        assert report.ok, f"{family} {mode}:\n{report.render()}"
        manifest = load_manifest(bundle)
        assert manifest.opset == Q.QUANT_OPSET
        quant = manifest.target.quant
        assert quant["weights"] == mode[:4] and quant["scheme"].startswith("offset" if "offset" in mode else "symmetric")
        assert quant["offsets"] == ("offset" in mode)
        for g in manifest.target.graphs:
            proto = onnx.load(os.path.join(bundle, g.file), load_external_data=False)
            assert {(o.domain, o.version) for o in proto.opset_import} == {("", Q.QUANT_OPSET)}
            assert all(n.domain == "" for n in proto.graph.node)
            dq = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
            matmul_inputs = {i for n in proto.graph.node if n.op_type == "MatMul" for i in n.input}
            # every weight product reads a DequantizeLinear of a stored int weight; no float weight matrix is left
            assert sum(n.output[0] in matmul_inputs for n in dq) == 4 * manifest.target.dims.num_layers + (g.role == "step")
            stored = {i.name: i.data_type for i in proto.graph.initializer}
            want = TensorProto.INT4 if mode.startswith("int4") else TensorProto.INT8
            assert all(stored[n.input[0]] == want for n in dq if n.output[0] in matmul_inputs and "lm_head" not in n.input[0])
            # the offsets' term: one Gemm per layer weight product, reading its float offsets [K/block, N]
            offsets = [n.input[1] for n in proto.graph.node if n.op_type == "Gemm" and n.input[1].endswith(".offset")]
            assert len(offsets) == (4 * manifest.target.dims.num_layers if "offset" in mode else 0)


def _dequantized_state(bundle: str, cfg) -> dict[str, np.ndarray]:
    """The bundle's stored weights, dequantized here with numpy and mapped back to transformers' names."""
    entry = load_manifest(bundle).target
    index = read_index(os.path.join(bundle, weights_index_file(entry.weights)))
    raw = np.fromfile(os.path.join(bundle, entry.weights), dtype=np.uint8)

    def tensor(name):
        ref = index[name]
        data = raw[ref.offset:ref.offset + ref.length]
        if ref.dtype == "int4":
            t = helper.make_tensor(name, TensorProto.INT4, list(ref.shape), data.tobytes(), raw=True)
            return numpy_helper.to_array(t).astype(np.float32)
        return data.view(ref.dtype).reshape(ref.shape).astype(np.float32)

    def deq(name, axis=0):  # blocks along `axis`, plus each block's offset where there is one
        q, s = tensor(name + ".q"), tensor(name + ".scale")
        rows = entry.quant.get("rows") and name != "embed"  # one scale per column: a block of the whole input
        block = q.shape[axis] if rows else entry.quant["block"]
        cut = tuple(slice(0, d) for d in q.shape)
        w = q * np.repeat(s, block, axis=axis)[cut]
        return w + np.repeat(tensor(name + ".offset"), block, axis=axis)[cut] if name + ".offset" in index else w

    return {"model.embed_tokens.weight": deq("embed", axis=1), **_hf_state(tensor, deq, cfg, lambda n: n in index)}


def _hf_state(tensor, matrix, cfg, has) -> dict[str, np.ndarray]:
    """Graph tensors mapped back to transformers' names (the head untied): `matrix(name)` gives a product's
    weight [in, out], `tensor(name)` any other tensor, `has(name)` whether the graph stores it. The norms and
    biases too, which a smoothed bundle changes (graphs/quant.py)."""
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    q_factor = 1.0 if cfg.model_type == "qwen3" else np.sqrt(D)  # the exporter folds 1/sqrt(D) into the queries
    state = {"lm_head.weight": matrix("lm_head").T, "model.norm.weight": tensor("norm")}
    for i in range(cfg.num_hidden_layers):
        p, a, m = f"layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = matrix(p + "qkv").T
        state[a + "q_proj.weight"] = qkv[:H * D] * q_factor
        state[a + "k_proj.weight"], state[a + "v_proj.weight"] = qkv[H * D:(H + Hkv) * D], qkv[(H + Hkv) * D:]
        if has(p + "qkv_bias"):
            bias = tensor(p + "qkv_bias")
            state[a + "q_proj.bias"] = bias[:H * D] * q_factor
            state[a + "k_proj.bias"], state[a + "v_proj.bias"] = bias[H * D:(H + Hkv) * D], bias[(H + Hkv) * D:]
        state[a + "o_proj.weight"] = matrix(p + "o").T
        gate_up = matrix(p + "gate_up").T
        state[m + "gate_proj.weight"], state[m + "up_proj.weight"] = np.split(gate_up, 2)
        state[m + "down_proj.weight"] = matrix(p + "down").T
        state[f"model.layers.{i}.input_layernorm.weight"] = tensor(p + "attn_norm")
        state[f"model.layers.{i}.post_attention_layernorm.weight"] = tensor(p + "mlp_norm")
    return state


def _oracle_logits(hf_model, bundle, tokens, input_hook=None, state=None):
    """transformers with the bundle's dequantized weights (an untied head: the head is quantized on its own),
    or with `state` (transformers' names) in their place; `input_hook`: a forward pre-hook for every linear
    layer."""
    import copy

    import torch

    model = copy.deepcopy(hf_model)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in (_dequantized_state(bundle, model.config) if state is None else state).items():
            params[name].copy_(torch.from_numpy(np.ascontiguousarray(value)))
        if input_hook is not None:
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.register_forward_pre_hook(input_hook)
        return model(torch.tensor([tokens])).logits[0].numpy()


def test_onnxruntime_runs_every_weight_product_as_matmulnbits(quant_bundles, tmp_path):
    """The speed of a quantized bundle rests on onnxruntime fusing each DequantizeLinear + MatMul into its
    MatMulNBits kernel under the manifest's session config; a weight left dequantized would run at float
    cost every step. Read the optimized graph onnxruntime actually runs."""
    import onnxruntime as ort

    for mode in ("int8", "int4"):
        bundle = quant_bundles["llama", mode]
        entry = load_manifest(bundle).target
        graph = entry.graph("step", 1)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        for key, value in entry.session_config.items():
            so.add_session_config_entry(key, value)
        so.optimized_model_filepath = str(tmp_path / f"{mode}.onnx")
        ort.InferenceSession(os.path.join(bundle, graph.file), so, providers=["CPUExecutionProvider"])
        nodes = onnx.load(so.optimized_model_filepath, load_external_data=False).graph.node
        ops = [n.op_type for n in nodes]
        assert ops.count("MatMulNBits") == 4 * entry.dims.num_layers + 1, (mode, sorted(set(ops)))
        # What stays DequantizeLinear is the embedding: rows gathered first, then dequantized (onnxruntime
        # duplicates that node per consumer); no stored weight is dequantized at run time.
        gathered = {n.output[0] for n in nodes if n.op_type == "Gather"}
        assert all(n.input[0] in gathered for n in nodes if n.op_type == "DequantizeLinear")


def _files(root) -> dict[str, int]:
    return {os.path.relpath(os.path.join(d, f), root): os.path.getmtime(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_optimized_graph_cache_computes_bit_for_bit_the_same(quant_bundles, tmp_path, monkeypatch, mode):
    """Quantized graphs load through the optimized-graph cache (runtime/backends/ort_cache.py): onnxruntime's
    MatMulNBits graph made once and its transformed weights shared by every session. The logits of every
    step must equal those of sessions that optimize the bundle's graph themselves, and a second process-like
    load must reuse the entry without writing anything."""
    from specedge.runtime.backends import ort_cache

    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    bundle = quant_bundles["qwen3", mode]  # qk-norm and untied head: the most node kinds
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, 100, n)) for n in (5, 21, 40)]

    def run(cached: bool):
        monkeypatch.setenv("SPECEDGE_ORT_CACHE", "1" if cached else "0")
        gen = Generator.load(bundle)
        out = []
        for p in prompts:
            out.append(gen.generate(p, 12, proposer="none", stop_ids=[]).tokens)
            out.append(gen.generate(p, 12, proposer="ngram", gamma=4, stop_ids=[]).tokens)
            out.append(gen.target.run([7, 8, 9]).copy())  # logits of a 3-token verify step after the run
        sessions = [s.session for s in gen.target._steps.values()]
        gen.close()
        return out, sessions

    reference, _ = run(cached=False)
    assert not os.path.exists(tmp_path / "cache" / "ort")
    cached, _ = run(cached=True)
    for a, b in zip(reference, cached):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    root = tmp_path / "cache" / "ort"
    (model_dir,) = os.listdir(root)  # one entry per weights file and config
    files = _files(root)
    graphs = [f for f in files if f.endswith(".onnx")]
    assert graphs and all(f.startswith(model_dir) for f in files)
    # the cached graphs run MatMulNBits and read no DequantizeLinear'd weight at run time
    ops = [n.op_type for g in graphs for n in onnx.load(os.path.join(root, g), load_external_data=False).graph.node]
    assert "MatMulNBits" in ops and "MatMul" in ops
    again, _ = run(cached=True)
    assert _files(root) == files  # reused: nothing new written, nothing rewritten
    for a, b in zip(reference, again):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # another weights file never meets this entry
    other = ort_cache.OptimizedGraphs(str(root)).model_dir(
        os.path.join(quant_bundles["llama", mode], "target.weights.bin"), load_manifest(bundle).target.session_config)
    assert os.path.basename(other) != model_dir


def test_an_unwritable_optimized_graph_cache_still_runs(quant_bundles, tmp_path, monkeypatch, capsys):
    """A read-only device (here: a cache path under a regular file) gets one line on stderr and sessions that
    optimize the graphs themselves, with the same tokens."""
    bundle = quant_bundles["llama", "int4"]
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECEDGE_CACHE", str(blocker / "cache"))
    prompt = [5, 9, 11, 4]
    gen = Generator.load(bundle)
    cached_off = gen.generate(prompt, 10, proposer="ngram", gamma=4, stop_ids=[]).tokens
    gen.close()
    err = capsys.readouterr().err
    assert err.count("no optimized-graph cache") == 1 and "SPECEDGE_CACHE" in err
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    gen = Generator.load(bundle)
    assert gen.generate(prompt, 10, proposer="ngram", gamma=4, stop_ids=[]).tokens == cached_off
    assert os.listdir(tmp_path / "cache" / "ort")
    gen.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", ["int8", "int4", "int4-offset"])
def test_quantized_graphs_match_dequantized_oracle(quant_bundles, tiny_models, family, mode):
    """Float activations (accuracy level 1): within 1e-5 of the logit scale (the issue asks 1e-3). With int8
    activations (level 4, what the runtime uses) each 32-wide block of every MatMul input is rounded to 1/254
    of its largest value: 2% of the logit scale bounds that error (measured 0.6-1.0%; float activations: 2-4e-7)."""
    bundle = quant_bundles[family, mode]
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 1000, 21).tolist()
    want = _oracle_logits(tiny_models[family][1], bundle, tokens)
    scale = np.abs(want).max()
    for level, tol in (("1", 1e-5), ("4", 2e-2)):
        drv = ContractDriver(bundle, session_config={**load_manifest(bundle).target.session_config,
                                                     "session.qdq_matmulnbits_accuracy_level": level})
        drv.step(tokens[:CHUNK], "prefill", CHUNK)
        got = drv.step(tokens[CHUNK:CHUNK + 5], "step", 5)[0]  # rows predict tokens CHUNK+1 .. CHUNK+5
        err = np.abs(got - want[CHUNK:CHUNK + 5]).max() / scale
        assert err < tol, f"{family} {mode} level {level}: max error {err:.2e} of the logit scale {scale:.1f}"


# -- GGUF blocks ----------------------------------------------------------------------------------------
def _write_gguf(path: str, types: dict[str, str], arch: str = "llama", E: int = 64, F: int = 128
                ) -> dict[str, np.ndarray]:
    """A one-layer llama GGUF (hidden E, 2 heads of E/2, 1 KV head, MLP width F) whose matrices have the given
    GGML types; returns the float tensors it holds, by GGUF name (K-quant ones, which gguf cannot quantize, are
    random super-blocks, dequantized by gguf). `arch` "phi3": q/k/v fused as attn_qkv, gate/up as ffn_up
    (llama.cpp's layout for Phi-3)."""
    import gguf

    rng = np.random.default_rng(3)
    V = 96
    shapes = {"token_embd.weight": (V, E), "blk.0.attn_q.weight": (E, E), "blk.0.attn_k.weight": (E // 2, E),
              "blk.0.attn_v.weight": (E // 2, E), "blk.0.attn_output.weight": (E, E),
              "blk.0.ffn_gate.weight": (F, E), "blk.0.ffn_up.weight": (F, E), "blk.0.ffn_down.weight": (E, F)}
    if arch == "phi3":
        for part in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
            del shapes[f"blk.0.{part}.weight"]
        shapes.update({"blk.0.attn_qkv.weight": (2 * E, E), "blk.0.ffn_up.weight": (2 * F, E)})
    w = gguf.GGUFWriter(path, arch)
    for key, value in (("block_count", 1), ("embedding_length", E), ("feed_forward_length", F),
                       ("attention.head_count", 2), ("attention.head_count_kv", 1), ("vocab_size", V)):
        getattr(w, "add_uint32")(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    made = {}
    for name, shape in shapes.items():
        t = rng.standard_normal(shape).astype(np.float32)
        made[name] = t
        kind = gguf.GGMLQuantizationType[types.get(name, "F32")]
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        elif kind.name.endswith("_K"):  # random bytes but for d and dmin: any such super-block is valid
            size = gguf.GGML_QUANT_SIZES[kind][1]
            raw = rng.integers(0, 256, (shape[0], shape[1] // 256, size), dtype=np.uint8)
            raw[:, :, :4] = rng.uniform(0.001, 0.05, (shape[0], shape[1] // 256, 2)).astype(np.float16).view(np.uint8)
            raw = raw.reshape(shape[0], -1)
            made[name] = gguf.quants.dequantize(raw, kind).reshape(shape)
            w.add_tensor(name, raw, raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, kind), raw_dtype=kind)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(E, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return made


LAYER_MATRICES = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
                  "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"]


def _native_blocks(tmp_path, types: dict[str, str], others: dict[str, str] | None = None, **sizes):
    """The tiny GGUF with these tensor types (and `others`); (its GGUFSource, the float tensors it was made
    from, [(gguf tensor, transformers name, the source's Blocks)] for the tensors in `types`)."""
    import gguf

    from specedge.export.sources import GGUFSource

    path = str(tmp_path / "tiny.gguf")
    made = _write_gguf(path, {**types, **(others or {})}, **sizes)
    src = GGUFSource(path)
    found = [(t, src._hf_name(t.name)) for t in gguf.GGUFReader(path).tensors if t.name in types]
    return src, made, [(t, name, src.blocks(name)) for t, name in found]


@pytest.mark.parametrize("block", [32, 16])
@pytest.mark.parametrize("kind,bits", [("Q4_0", 4), ("Q8_0", 8), ("Q5_0", 8)])
def test_gguf_symmetric_blocks_copy_bit_exactly(tmp_path, kind, bits, block):
    """Q4_0 / Q8_0 / Q5_0 tensors enter the ONNX layout without a dequantize/requantize round trip: their ints
    and scales, read from the file, dequantize to exactly what gguf's own dequantizer gives (Q5_0's 5-bit ints
    as int8). Into blocks of 16 each block of 32 is two blocks with its scale."""
    import gguf

    from specedge.graphs import llama

    src, _, found = _native_blocks(tmp_path, {n: kind for n in LAYER_MATRICES + ["token_embd.weight"]})
    for t, hf_name, b in found:
        assert (b.bits, b.block) == (bits, 32)
        # the reference: gguf's dequantizer, with the exporter's q/k row order (tensor() is that path)
        want = src.tensor(hf_name).T
        got = b.q.astype(np.float32) * np.repeat(b.scale, 32, axis=0)
        assert np.array_equal(got, want), hf_name
        if "attn_q" not in t.name and "attn_k" not in t.name:  # rows in file order: gguf's dequantizer directly
            assert np.array_equal(got.T, gguf.quants.dequantize(t.data, t.tensor_type).reshape(got.T.shape))

    # through the exporter's weight writer: every matrix copied natively, none requantized, ints unchanged
    spec = Q.QuantSpec(bits=bits, block=block, head_bits=bits)
    report = llama.QuantReport()
    stored = dict(llama.graph_weights(src.config, 64, "float32", src.tensor, quant=spec, native=src.blocks,
                                      report=report))
    # qkv, o, gate_up, down, the head, and the int8 embedding (Q4_0 ints widen to int8 exactly)
    assert not report.requantized and len(report.native) == 4 + 2
    down = stored["layers.0.down.q"]
    down = down.values() if bits == 4 else down
    source = src.blocks("model.layers.0.mlp.down_proj.weight")
    assert np.array_equal(down, source.q)
    scale = stored["layers.0.down.scale"]
    assert scale.shape[0] == down.shape[0] // block
    assert np.array_equal(down * np.repeat(scale, block, axis=0), source.q * np.repeat(source.scale, 32, axis=0))


@pytest.mark.parametrize("kind,bits", [("Q4_0", 4), ("Q8_0", 8)])
def test_gguf_phi3_fused_blocks_copy_bit_exactly(tmp_path, kind, bits):
    """A Phi-3 GGUF fuses q/k/v (attn_qkv) and gate/up (ffn_up). Blocks run along the input, so each part is its
    rows' blocks, copied as they are: the parts dequantize exactly to the rows of gguf's own dequantization of
    the fused tensor, and the exporter requantizes nothing."""
    import gguf

    from specedge.export.sources import GGUFSource
    from specedge.graphs import llama

    path = str(tmp_path / "phi3.gguf")
    _write_gguf(path, {n: kind for n in ("blk.0.attn_qkv.weight", "blk.0.ffn_up.weight", "blk.0.attn_output.weight",
                                         "blk.0.ffn_down.weight", "token_embd.weight")}, arch="phi3")
    src = GGUFSource(path)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    fused = {n: gguf.quants.dequantize(tensors[n].data, tensors[n].tensor_type).reshape(-1, 64)
             for n in ("blk.0.attn_qkv.weight", "blk.0.ffn_up.weight")}
    for part, name, rows in (("self_attn.q_proj", "blk.0.attn_qkv.weight", slice(0, 64)),
                             ("self_attn.k_proj", "blk.0.attn_qkv.weight", slice(64, 96)),
                             ("self_attn.v_proj", "blk.0.attn_qkv.weight", slice(96, 128)),
                             ("mlp.gate_proj", "blk.0.ffn_up.weight", slice(0, 128)),
                             ("mlp.up_proj", "blk.0.ffn_up.weight", slice(128, 256))):
        b = src.blocks(f"model.layers.0.{part}.weight")
        assert (b.bits, b.block) == (bits, 32), part
        assert np.array_equal(b.q.astype(np.float32) * np.repeat(b.scale, 32, axis=0), fused[name][rows].T), part
    report = llama.QuantReport()
    list(llama.graph_weights(src.config, 64, "float32", src.tensor, quant=Q.QuantSpec(bits=bits, block=32,
                             head_bits=bits), native=src.blocks, report=report))
    assert not report.requantized and len(report.native) == 4 + 2


@pytest.mark.parametrize("kind,bits", [("Q4_K", 4), ("Q5_K", 8), ("Q5_1", 8)])
def test_gguf_k_quant_and_q5_1_blocks_copy_exactly_into_the_offset_scheme(tmp_path, kind, bits):
    """Q4_K / Q5_K (super-blocks of 256 with 6-bit scales and minima for their 8 blocks of 32, value d * sc * q -
    dmin * mn; Q5_K's fifth bits in qh) and Q5_1 (value d * q5 + m per block of 32): random super-blocks (Q5_1:
    gguf's quantization of random weights) read as offset blocks of 32 dequantize to gguf's own values (to
    float32 rounding), q and k rows in the exporter's order included. The offset scheme copies them where their
    ints fit (4-bit into int4 and int8, 5-bit into int8); the symmetric scheme requantizes them."""
    from specedge.graphs import llama

    src, made, found = _native_blocks(tmp_path, {n: kind for n in LAYER_MATRICES}, E=256, F=512)
    low = -8 if kind.startswith("Q4") else -16  # 4-bit ints -8..7, 5-bit ones -16..15
    for t, hf_name, b in found:
        assert (b.bits, b.block) == (bits, 32) and b.q.min() == low and b.q.max() == -low - 1
        want = src.tensor(hf_name).T  # gguf's dequantizer, in the exporter's row order
        np.testing.assert_allclose(b.dequantized(), want, rtol=0, atol=1e-6 * np.abs(want).max(), err_msg=hf_name)
        assert len(np.unique(b.scale)) > 50  # the scales vary per block: all of them were unpacked
    for stored in (4, 8):
        report = llama.QuantReport()
        list(llama.graph_weights(src.config, 64, "float32", src.tensor,
                                 quant=Q.QuantSpec(stored, 32, 8, offsets=True), native=src.blocks, report=report))
        layers = ["layers.0.qkv", "layers.0.o", "layers.0.gate_up", "layers.0.down"]
        assert report.native == (layers if bits <= stored else []), stored
    report = llama.QuantReport()
    list(llama.graph_weights(src.config, 64, "float32", src.tensor, quant=Q.QuantSpec(4, 32, 8), native=src.blocks,
                             report=report))
    assert not report.native


@pytest.mark.parametrize("kind,quant", [("Q4_K", "int4"), ("Q5_K", "int8")])
def test_a_k_quant_gguf_exports_to_an_offset_bundle_that_computes_its_model(tmp_path, monkeypatch, kind, quant):
    """The whole path: a Q4_K (Q5_K) GGUF exported with --quant int4 (int8) --quant-scheme offset copies every
    layer weight, passes check, and its logits are the float32 bundle's of the same file within accuracy level
    4's int8 activations."""
    from specedge.export.sources import GGUFSource, TokenizerInfo

    monkeypatch.setattr(GGUFSource, "tokenizer",
                        lambda self: TokenizerInfo(bos_id=None, eos_ids=[1], chat_template=None))
    src, _, _ = _native_blocks(tmp_path, {n: kind for n in LAYER_MATRICES}, E=256, F=512)
    tokens = np.random.default_rng(9).integers(0, 96, CHUNK + 5).tolist()
    logits = {}
    for name, options in (("f32", {}), ("offset", {"quant": quant, "quant_scheme": "offset"})):
        out = str(tmp_path / name)
        export_bundle(src.path, out, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,), **options),
                      progress=False)
        assert check_bundle(out).ok
        drv = ContractDriver(out, session_config=load_manifest(out).target.session_config)
        drv.step(tokens[:CHUNK], "prefill", CHUNK)
        logits[name] = drv.step(tokens[CHUNK:], "step", 5)[0]
    assert load_manifest(str(tmp_path / "offset")).target.quant["source"]["native"] == 4  # the layers; not the F32 head
    err = np.abs(logits["offset"] - logits["f32"]).max() / np.abs(logits["f32"]).max()
    assert 0 < err < 0.03, err


def test_gguf_q4_1_blocks_copy_exactly_into_the_offset_scheme(tmp_path):
    """Q4_1 (scale d and minimum m per block, value d * nibble + m): the ints and scales are copied, the
    offset is m + 8d, and the blocks dequantize to gguf's own values (to float32 rounding). Under the offset
    scheme every layer weight is copied natively, nothing requantized; under the symmetric one they are
    requantized. Float tensors get min/max blocks under the offset scheme."""
    from specedge.graphs import llama

    src, made, found = _native_blocks(tmp_path, {n: "Q4_1" for n in LAYER_MATRICES}, {"token_embd.weight": "Q8_0"})
    for t, hf_name, b in found:
        assert (b.bits, b.block) == (4, 32) and b.q.min() >= -8 and b.q.max() <= 7
        want = src.tensor(hf_name).T  # gguf's dequantizer, in the exporter's row order
        np.testing.assert_allclose(b.dequantized(), want, rtol=0, atol=1e-6 * np.abs(want).max())
        assert np.abs(b.dequantized() - made[t.name].T).max() > 1e-3  # Q4_1 itself is lossy: the oracle is the file
    spec = Q.QuantSpec(bits=4, block=32, head_bits=8, offsets=True)
    report = llama.QuantReport()
    stored = dict(llama.graph_weights(src.config, 64, "float32", src.tensor, quant=spec, native=src.blocks,
                                      report=report))
    assert not report.requantized and len(report.native) == 4 + 2  # the layer weights, the Q8_0 embedding and head
    assert np.array_equal(stored["layers.0.down.q"].values(), src.blocks("model.layers.0.mlp.down_proj.weight").q)
    assert {"embed.offset", "lm_head.offset"}.isdisjoint(stored) and "layers.0.qkv.offset" in stored
    # into blocks of 16: each Q4_1 block is two, with its scale and offset
    report = llama.QuantReport()
    halves = dict(llama.graph_weights(src.config, 64, "float32", src.tensor, quant=Q.QuantSpec(4, 16, 8, offsets=True),
                                      native=src.blocks, report=report))
    assert not report.requantized and len(report.native) == 4 + 2
    for part in ("q", "scale", "offset"):
        whole, half = stored[f"layers.0.down.{part}"], halves[f"layers.0.down.{part}"]
        whole, half = (whole.values(), half.values()) if part == "q" else (whole, half)
        assert np.array_equal(half, whole if part == "q" else np.repeat(whole, 2, axis=0)), part
    report = llama.QuantReport()
    list(llama.graph_weights(src.config, 64, "float32", src.tensor, quant=Q.QuantSpec(4, 32, 8), native=src.blocks,
                             report=report))
    assert {"layers.0.qkv", "layers.0.o", "layers.0.gate_up", "layers.0.down"} <= set(report.requantized)


def test_offset_blocks_of_float_weights_round_min_max_to_nearest():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((80, 6)).astype(np.float32) + 3  # not centred: offsets matter; a short last block
    q, scale, offset = Q.quantize_offset_blocks(w, 4, 32)
    assert q.shape == w.shape and scale.shape == offset.shape == (3, 6) and q.min() >= -8 and q.max() <= 7
    got = Q.Blocks(q, scale, 4, 32, offset).dequantized()
    assert np.abs(got - w).max() <= 0.5 * np.repeat(scale, 32, axis=0)[:80].max() + 1e-6  # half a step at most
    for b in range(3):  # each block's min and max are grid points
        rows = slice(32 * b, min(32 * b + 32, 80))
        np.testing.assert_allclose(got[rows].min(axis=0), w[rows].min(axis=0), atol=1e-5)
        np.testing.assert_allclose(got[rows].max(axis=0), w[rows].max(axis=0), atol=1e-5)
    assert Q.quantize_offset_blocks(w, 4, 32)[0].dtype == np.int8
    sym = Q.dequantize_blocks(*Q.quantize_blocks(w, 4, 32), 32)
    assert np.abs(got - w).mean() < np.abs(sym - w).mean()  # an off-centre block is what offsets are for


def test_gguf_other_types_are_requantized_and_reported(tmp_path):
    from specedge.export.sources import GGUFSource
    from specedge.graphs import llama

    path = str(tmp_path / "tiny.gguf")
    made = _write_gguf(path, {"blk.0.ffn_down.weight": "Q4_1", "blk.0.ffn_up.weight": "Q8_0"})
    src = GGUFSource(path)
    assert src.blocks("model.layers.0.mlp.down_proj.weight").offset is not None  # Q4_1: offsets, not symmetric
    report = llama.QuantReport()
    list(llama.graph_weights(src.config, 64, "float32", src.tensor, quant=Q.QuantSpec(4, 32, 8), native=src.blocks,
                             report=report))
    # gate_up mixes F32 gate with Q8_0 up, so it is requantized too; int4 RTN errors sit near 0.1
    assert set(report.requantized) >= {"layers.0.down", "layers.0.gate_up", "layers.0.qkv"}
    assert all(0.01 < e < 0.2 for n, e in report.requantized.items() if n != "lm_head" and n != "embed")
    assert report.to_json()["worst"] in report.requantized
    del made


# -- exact speculation on quantized graphs ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["int8", "int4", "int4-offset", "int8-rows"])
def test_greedy_speculative_equals_plain_on_quantized_graphs(tiny_models, tmp_path, mode):
    """Verify rows of a k-row quantized MatMul equal k one-row decode steps bitwise (accuracy level 4; integer
    products in the rows scheme), so greedy speculation reproduces the quantized bundle's own plain greedy
    output exactly."""
    from test_generate import prompt_of

    out = str(tmp_path / mode)
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK, draft_layers=1,
                                                              quant=mode[:4], quant_scheme=mode[5:] or None),
                  progress=False)
    gen = Generator.load(out)
    try:
        proposed = accepted = rejected = 0
        for length in (1, CHUNK + 1, 3 * CHUNK + 5):
            prompt = prompt_of(length, seed=length)
            plain = gen.generate(prompt, 40, proposer="none", stop_ids=[]).tokens
            for proposer in ("ngram", "draft"):
                for gamma in (1, 2, 4, 8):
                    res = gen.generate(prompt, 40, proposer=proposer, gamma=gamma, stop_ids=[])
                    assert res.tokens == plain, (length, proposer, gamma)
                    proposed += res.stats.proposed
                    accepted += res.stats.accepted
                    rejected += res.stats.proposed - res.stats.accepted
        assert proposed > 0 and accepted > 0 and rejected > 0  # the speculative paths ran, both ways
    finally:
        gen.close()


# -- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,message", [
    (["--quant", "int3"], "--quant must be one of"),
    (["--quant", "int4", "--quant-block", "48"], "power of two"),
    (["--quant", "int4", "--quant-block", "512"], "power of two"),
    (["--quant", "int8", "--quant-block", "8"], "power of two"),
    (["--quant", "int4", "--dtype", "float16"], "needs --dtype float32"),
    (["--quant", "int4", "--quant-head", "fp8"], "--quant-head must be"),
    (["--quant-block", "64"], "need --quant"),
    (["--quant-scheme", "offset"], "need --quant"),
    (["--quant", "int4", "--quant-scheme", "zero-point"], "--quant-scheme must be one of"),
    (["--quant", "int4", "--quant-scheme", "rows"], "--quant-scheme rows is int8 only"),
    (["--quant", "int8", "--quant-head", "int4", "--quant-scheme", "rows"], "--quant-scheme rows is int8 only"),
    (["--quant", "int4", "--quant-scheme", "offset", "--quant-smooth", "0.5"],
     "does not apply to --quant-scheme offset"),
    (["--quant-smooth", "0.5"], "need --quant int8 or int4"),
    (["--quant", "int8", "--quant-scheme", "rows", "--quant-smooth", "1"], "--quant-smooth must be in [0, 1)"),
    (["--quant", "int8", "--quant-scheme", "rows", "--quant-smooth", "nan"], "--quant-smooth must be in [0, 1)"),
    (["--quant", "int8", "--calibration", "/nonexistent/prompts.jsonl"], "cannot read the calibration prompts"),
    (["--calibration-count", "3"], "apply only to --for qnn-qdq16 and to smoothed quantized"),
    (["--quant", "int4", "--calibration-count", "0"], "the calibration needs at least one prompt"),
])
def test_bad_quant_options_fail_cleanly(tiny_models, tmp_path, args, message):
    out = tmp_path / "bundle"
    r = subprocess.run([sys.executable, "-m", "specedge", "export", "--target", tiny_models["llama"][0],
                        "--out", str(out), "--context", "64", "--prefill-chunk", "16", "--quiet", *args],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() and os.listdir(tmp_path) == []  # nothing left behind


# -- the rows scheme: integer products ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def rows_bundles(tiny_models, tmp_path_factory):
    """family -> the tiny family as --quant int8 --quant-scheme rows (qwen2: a tied head and biases; qwen3: q/k
    norms)."""
    root = tmp_path_factory.mktemp("rows_bundles")
    out = {}
    for family in ("llama", "qwen2", "qwen3"):
        out[family] = str(root / family)
        export_bundle(tiny_models[family][0], out[family], ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,),
                                                                         quant="int8", quant_scheme="rows"),
                      progress=False)
    return out


def test_rows_bundles_are_integer_products_and_pass_check(rows_bundles):
    """Every weight product (and the head of a step graph) is a MatMulInteger of an int8 weight with one scale
    per output column; no stored weight is dequantized; check (exact rows included) passes."""
    for family, bundle in rows_bundles.items():
        report = check_bundle(bundle)
        assert report.ok, f"{family}:\n{report.render()}"
        entry = load_manifest(bundle).target
        assert entry.quant["rows"] and entry.quant["scheme"].startswith("rows")
        assert entry.quant["targets"] == ["onnxruntime"]
        for g in entry.graphs:
            proto = onnx.load(os.path.join(bundle, g.file), load_external_data=False)
            assert all(n.domain == "" for n in proto.graph.node)
            stored = {i.name: i for i in proto.graph.initializer}
            products = [n for n in proto.graph.node if n.op_type == "MatMulInteger"]
            assert len(products) == 4 * entry.dims.num_layers + (g.role == "step")
            for n in products:
                w, s = stored[n.input[1]], stored[n.input[1][:-len(".q")] + ".scale"]
                assert w.data_type == TensorProto.INT8 and list(s.dims) == [1, w.dims[1]]
            assert all(n.input[0] not in stored for n in proto.graph.node if n.op_type == "DequantizeLinear")


def test_onnxruntime_runs_every_rows_product_as_an_integer_product(rows_bundles, tmp_path):
    """The optimized graph onnxruntime runs keeps one MatMulInteger per weight product (the head's too) and no
    float product reads a stored weight: the speed of the scheme is its integer kernels'."""
    import onnxruntime as ort

    bundle = rows_bundles["llama"]
    entry = load_manifest(bundle).target
    so = ort.SessionOptions()
    so.log_severity_level = 3
    for key, value in entry.session_config.items():
        so.add_session_config_entry(key, value)
    so.optimized_model_filepath = str(tmp_path / "rows.onnx")
    ort.InferenceSession(os.path.join(bundle, entry.graph("step", 1).file), so, providers=["CPUExecutionProvider"])
    proto = onnx.load(so.optimized_model_filepath, load_external_data=False)
    stored = {i.name for i in proto.graph.initializer if i.name.endswith((".q", ".scale"))}
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("MatMulInteger") == 4 * entry.dims.num_layers + 1, sorted(set(ops))
    assert not [n.name for n in proto.graph.node if n.op_type in ("MatMul", "Gemm", "FusedMatMul", "MatMulNBits")
                and set(n.input) & stored]


def _rows_oracle_logits(hf_model, bundle, tokens):
    """_oracle_logits with every linear layer's input quantized per row as the rows scheme says (round(x / s) * s,
    s = max|x| / 127, half to even)."""
    import torch

    def per_row(module, args):
        x = args[0]
        s = x.abs().amax(dim=-1, keepdim=True) * np.float32(1 / 127)
        return (torch.round(x / s) * s,)

    return _oracle_logits(hf_model, bundle, tokens, input_hook=per_row)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_rows_graphs_match_a_per_row_quantized_oracle(rows_bundles, tiny_models, family):
    """The step graph's logits against transformers computing the scheme with the bundle's own integers: within
    1e-4 of the logit scale (float sums in another order can flip a rounding of x / s at .5, rarely). q/k/v
    quantized per row of the fused qkv input is the oracle's per-row quantization of the same input to each."""
    bundle = rows_bundles[family]
    tokens = np.random.default_rng(1).integers(0, 1000, 21).tolist()
    want = _rows_oracle_logits(tiny_models[family][1], bundle, tokens)
    drv = ContractDriver(bundle, session_config=load_manifest(bundle).target.session_config)
    drv.step(tokens[:CHUNK], "prefill", CHUNK)
    got = drv.step(tokens[CHUNK:CHUNK + 5], "step", 5)[0]
    err = np.abs(got - want[CHUNK:CHUNK + 5]).max() / np.abs(want).max()
    assert err < 1e-4, f"{family}: max error {err:.2e} of the logit scale"


def test_check_catches_a_quant_record_that_disagrees_with_the_graphs(quant_bundles, tmp_path):
    import shutil

    bundle = str(tmp_path / "copy")
    shutil.copytree(quant_bundles["llama", "int4"], bundle)
    path = os.path.join(bundle, "manifest.json")
    manifest = json.load(open(path))
    manifest["models"]["target"]["quant"]["block"] = 64
    json.dump(manifest, open(path, "w"))
    report = check_bundle(bundle, load=False)
    assert not report.ok and "block" in report.render()


def test_check_catches_a_rows_record_that_disagrees_with_the_graphs(rows_bundles, quant_bundles, tmp_path):
    """Integer-product graphs under a symmetric record, and MatMulNBits graphs under a rows record, fail."""
    import shutil

    for source, rows, fragment in ((rows_bundles["llama"], False, "integer products (MatMulInteger), but the"),
                                   (quant_bundles["llama", "int8"], True, "is not read by an integer product")):
        bundle = str(tmp_path / f"copy-{rows}")
        shutil.copytree(source, bundle)
        path = os.path.join(bundle, "manifest.json")
        manifest = json.load(open(path))
        manifest["models"]["target"]["quant"]["rows"] = rows
        json.dump(manifest, open(path, "w"))
        report = check_bundle(bundle, load=False)
        assert not report.ok and fragment in report.render(), report.render()


# -- smoothing (SmoothQuant folded into the weights of a rows bundle) -----------------------------------------
def _product_inputs(cfg) -> dict[str, int]:
    """Weight name -> its product's input width, for every product of a graph with a MatMul head."""
    widths = {"lm_head": cfg.hidden_size}
    for i in range(cfg.num_layers):
        widths.update({f"layers.{i}.qkv": cfg.hidden_size, f"layers.{i}.o": cfg.num_heads * cfg.head_dim,
                       f"layers.{i}.gate_up": cfg.hidden_size, f"layers.{i}.down": cfg.intermediate_size})
    return widths


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_smoothing_leaves_the_float_model_unchanged(tiny_models, family):
    """x @ W = (x / f) @ (f * W) with the division folded into the norms, the value and up projections and the
    final norm: transformers running the smoothed float tensors (mapped back to its names) gives the original
    model's logits, while the stored tensors moved by factors far from 1 (qwen2: biases; qwen3: q/k norms)."""
    from specedge.export.sources import open_source
    from specedge.graphs import llama

    src = open_source(tiny_models[family][0])
    cfg = src.config
    rng = np.random.default_rng(3)
    ranges = {name: rng.uniform(0.01, 30.0, k).astype(np.float32) for name, k in _product_inputs(cfg).items()}
    plain = dict(llama.graph_weights(cfg, 64, "float32", src.tensor, matmul_head=True))
    smoothed = dict(llama.graph_weights(cfg, 64, "float32", src.tensor, matmul_head=True, act_ranges=ranges,
                                        alpha=0.5))
    unsmoothed = dict(llama.graph_weights(cfg, 64, "float32", src.tensor, matmul_head=True, act_ranges=ranges,
                                          alpha=0.0))
    assert all(np.array_equal(plain[n], unsmoothed[n]) for n in plain)
    for name in ("layers.0.attn_norm", "layers.0.qkv", "layers.0.o", "layers.0.mlp_norm", "layers.0.gate_up",
                 "layers.0.down", "norm", "lm_head"):
        moved = np.abs(smoothed[name] - plain[name]) / np.maximum(np.abs(plain[name]), 1e-12)  # 0 stays 0
        assert moved.max() > 0.5, name
    hf_model = tiny_models[family][1]
    tokens = rng.integers(0, cfg.vocab_size, 20).tolist()
    want = _oracle_logits(hf_model, None, tokens, state=_hf_state(plain.__getitem__, plain.__getitem__,
                                                                  hf_model.config, plain.__contains__))
    got = _oracle_logits(hf_model, None, tokens, state=_hf_state(smoothed.__getitem__, smoothed.__getitem__,
                                                                 hf_model.config, smoothed.__contains__))
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("family,config", [("llama", None), ("qwen2", None), ("qwen3", None),
                                           ("gemma2", GEMMA_CASES[2][1]), ("gemma3", GEMMA_CASES[3][1]),
                                           ("phi3", {"partial_rotary_factor": 0.5})])
def test_activation_ranges_are_the_largest_inputs_transformers_sees(tiny_models, tmp_path, family, config):
    """export/smooth.py's ranges (the float32 step graphs with a tap per product, one layer at a time, the
    residual stream carried between them) against forward pre-hooks on transformers' linear layers, over the same
    windows, each a sequence of its own. Gemma 2/3: the embedding's scale, sandwich norms, sliding layers (a
    window of 4, shorter than the calibration windows) between full ones, Gemma 3's local RoPE base on them;
    Phi-3: fused q/k/v and gate/up."""
    import torch

    from specedge.export.smooth import activation_ranges, calibration_windows
    from specedge.export.sources import open_source

    if config is None:
        model_dir, model = tiny_models[family]
    else:
        model_dir = str(tmp_path / family)
        model = make_hf_model(model_dir, family, **config)
    src = open_source(model_dir)
    rng = np.random.default_rng(4)
    windows = calibration_windows([rng.integers(0, 1000, n).tolist() for n in (30, 25, 20)], window=24)
    assert [len(w) for w in windows] == [24, 24, 24]  # 75 ids: three whole windows, the rest dropped
    got = activation_ranges(src.config, src.tensor, windows)
    want, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for module, name in ((getattr(attn, "qkv_proj", None) or attn.q_proj, f"layers.{i}.qkv"),
                             (attn.o_proj, f"layers.{i}.o"),
                             (getattr(mlp, "gate_up_proj", None) or mlp.gate_proj, f"layers.{i}.gate_up"),
                             (mlp.down_proj, f"layers.{i}.down")):
            hooks.append((module, name))
    hooks.append((model.lm_head, "lm_head"))

    def record(name):
        def hook(module, args):
            m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).numpy()
            want[name] = np.maximum(want[name], m) if name in want else m
        return hook

    handles = [module.register_forward_pre_hook(record(name)) for module, name in hooks]
    try:
        with torch.no_grad():
            for w in windows:
                model(torch.tensor([w]))
    finally:
        for h in handles:
            h.remove()
    assert set(got) == set(want) == set(_product_inputs(src.config))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_rows_bundles_are_smoothed_by_default_and_record_it(rows_bundles, tiny_models, tmp_path):
    """The default rows export calibrates (the prompt suite) and records alpha and what it read; --quant-smooth 0
    writes the unsmoothed weights (different bytes), and both keep the graphs' function within the scheme."""
    entry = load_manifest(rows_bundles["llama"]).target
    assert entry.quant["smooth"] == Q.DEFAULT_SMOOTH == 0.5
    record = entry.quant["smoothing"]
    assert record["prompts"] == "suite.jsonl" and record["prompt_count"] >= 30 and record["tokens"] >= 1000
    out = str(tmp_path / "plain")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,),
                                                              quant="int8", quant_scheme="rows", quant_smooth=0.0),
                  progress=False)
    plain = load_manifest(out).target
    assert plain.quant["smooth"] == 0 and "smoothing" not in plain.quant
    smoothed_norm = _dequantized_state(rows_bundles["llama"], tiny_models["llama"][1].config)
    plain_norm = _dequantized_state(out, tiny_models["llama"][1].config)
    name = "model.layers.0.input_layernorm.weight"
    assert not np.allclose(smoothed_norm[name], plain_norm[name])
    assert check_bundle(out).ok


def test_a_rows_draft_model_is_smoothed_with_its_own_ranges(tiny_models, tiny_draft_model, tmp_path):
    """A separate draft model calibrates on the same prompts through its own float model; the bundle passes
    check and the record says so for both models."""
    out = str(tmp_path / "with-draft")
    options = ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,), quant="int8", quant_scheme="rows")
    export_bundle(tiny_models["llama"][0], out, options, draft_path=tiny_draft_model[0], progress=False)
    manifest = load_manifest(out)
    target, draft = manifest.models["target"], manifest.models["draft"]
    assert target.quant["smoothing"] == draft.quant["smoothing"] and draft.quant["smooth"] == 0.5
    assert check_bundle(out).ok


def test_smoothing_calibration_errors_are_one_line_and_leave_nothing(tiny_models, tmp_path):
    from specedge.errors import ExportError

    out = tmp_path / "bundle"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    for prompts, message in ((str(tmp_path / "missing.jsonl"), "cannot read the calibration prompts"),
                             (str(bad), "bad.jsonl:2: not a JSON object")):
        with pytest.raises(ExportError, match=message):
            export_bundle(tiny_models["llama"][0], str(out),
                          ExportOptions(context=64, prefill_chunk=CHUNK, quant="int8", quant_scheme="rows",
                                        calibration_prompts=prompts, calibration_count=5), progress=False)
        assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # no bundle, no temporary directory
    with pytest.raises(ExportError, match="apply only to --for qnn-qdq16 and to smoothed quantized"):
        export_bundle(tiny_models["llama"][0], str(out), ExportOptions(context=64, prefill_chunk=CHUNK, quant="int8",
                                                                       quant_scheme="rows", quant_smooth=0.0,
                                                                       calibration_count=5), progress=False)


def test_a_gguf_whose_blocks_are_copied_is_smoothed_only_when_asked(tmp_path, monkeypatch):
    """By default an int4 bundle keeps a source's own Q4_0 blocks (the GGUF's model, bit for bit) rather than
    smoothing and requantizing them; --quant-smooth asks for smoothing all the same (the layer weights are then
    requantized), and calibration settings without it are an error, not ignored, when every product is kept
    (here the layers and the tied head, int4). The tiny GGUF has no tokenizer: it gets an empty one and
    calibrates on token ids."""
    from specedge.errors import ExportError
    from specedge.export.sources import GGUFSource, TokenizerInfo

    monkeypatch.setattr(GGUFSource, "tokenizer",
                        lambda self: TokenizerInfo(bos_id=None, eos_ids=[1], chat_template=None))
    src, _, _ = _native_blocks(tmp_path, {n: "Q4_0" for n in LAYER_MATRICES + ["token_embd.weight"]})
    ids = tmp_path / "ids.jsonl"
    rng = np.random.default_rng(5)
    ids.write_text("".join(json.dumps({"prompt_ids": rng.integers(0, 64, 40).tolist()}) + "\n" for _ in range(3)))
    kept, smoothed = str(tmp_path / "kept"), str(tmp_path / "smoothed")
    for settings in ({"calibration_prompts": str(ids)}, {"calibration_count": 2}):
        with pytest.raises(ExportError, match="copied as they are stored.*add --quant-smooth 0.5"):
            export_bundle(src.path, kept, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,), quant="int4",
                                                        quant_head="int4", **settings), progress=False)
        assert not os.path.exists(kept)
    export_bundle(src.path, kept, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,), quant="int4",
                                                quant_head="int4"), progress=False)
    export_bundle(src.path, smoothed, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,), quant="int4",
                                                    quant_head="int4", quant_smooth=0.5, calibration_prompts=str(ids)),
                  progress=False)
    kept_q, smoothed_q = load_manifest(kept).target.quant, load_manifest(smoothed).target.quant
    assert kept_q["smooth"] == 0 and "smoothing" not in kept_q
    assert kept_q["source"]["native"] == 6 and kept_q["source"]["smoothed"] == 0  # qkv, o, gate_up, down, embed, head
    assert smoothed_q["smooth"] == 0.5 and smoothed_q["smoothing"]["tokens"] == 64  # one window of the context
    assert smoothed_q["source"]["native"] == 1 and smoothed_q["source"]["requantized"] == 5  # the embedding is kept
    assert smoothed_q["source"]["smoothed"] == 5
    assert check_bundle(kept).ok and check_bundle(smoothed).ok


def test_a_mixed_gguf_keeps_its_4_bit_blocks_and_smooths_the_rest(tmp_path):
    """A GGUF whose layers are Q4_0 but for a float down projection, with a Q8_0 tied head: by default an int4
    bundle (int8 head) keeps the Q4_0 products as they are and smooths down and the head, the head requantized
    from its Q8_0 blocks (int8 rounding costs less than unsmoothed activations). down's factors divide the up
    columns of gate_up, which keeps the source's ints with those columns' scales divided; the stored tensors
    compute the source's functions (the MLP, the head) within quantization error. An int8 bundle smooths every
    product (only the embedding, never smoothed, keeps its blocks)."""
    from specedge.graphs import llama

    src, _, _ = _native_blocks(tmp_path, {n: "Q4_0" for n in LAYER_MATRICES if "ffn_down" not in n},
                               {"token_embd.weight": "Q8_0"})
    cfg = src.config
    rng = np.random.default_rng(8)
    ranges = {name: rng.uniform(0.01, 30.0, k).astype(np.float32) for name, k in _product_inputs(cfg).items()}

    def export(spec):
        report = llama.QuantReport()
        stored = dict(llama.graph_weights(cfg, 64, "float32", src.tensor, quant=spec, native=src.blocks,
                                          report=report, act_ranges=ranges, keep_native=True))
        return stored, report

    _, report = export(Q.QuantSpec(8, 32, 8, smooth=0.5))
    assert report.native == ["embed"] and len(report.smoothed) == 5
    int4 = Q.QuantSpec(4, 32, 8, smooth=0.5)
    assert not llama.keeps_every_product(cfg, int4, src.blocks)
    q4_0 = src.blocks("model.layers.0.mlp.up_proj.weight")
    assert llama.keeps_every_product(cfg, replace(int4, head_bits=4), lambda n: q4_0)  # every source tensor Q4_0
    assert not llama.keeps_every_product(cfg, int4, lambda n: q4_0)  # the int8 head is smoothed
    stored, report = export(int4)
    assert report.native == ["embed", "layers.0.qkv", "layers.0.o", "layers.0.gate_up"]
    assert report.smoothed == ["layers.0.down", "lm_head"] and set(report.requantized) == {"layers.0.down", "lm_head"}

    def deq(name):
        q = stored[name + ".q"]
        q = q.values() if isinstance(q, Q.PackedInt4) else q
        return q.astype(np.float32) * np.repeat(stored[name + ".scale"], 32, axis=0)

    F = cfg.intermediate_size
    gate, up = src.blocks("model.layers.0.mlp.gate_proj.weight"), src.blocks("model.layers.0.mlp.up_proj.weight")
    assert np.array_equal(stored["layers.0.gate_up.q"].values(), np.concatenate([gate.q, up.q], axis=1))
    assert np.array_equal(stored["layers.0.gate_up.scale"][:, :F], gate.scale)
    assert not np.allclose(stored["layers.0.gate_up.scale"][:, F:], up.scale)
    for name, product in (("layers.0.qkv", "self_attn.q_proj"), ("layers.0.o", "self_attn.o_proj")):
        assert np.array_equal(stored[name + ".q"].values()[:, :cfg.hidden_size],
                              src.blocks(f"model.layers.0.{product}.weight").q[:, :cfg.hidden_size])
    assert np.array_equal(stored["layers.0.attn_norm"], src.tensor("model.layers.0.input_layernorm.weight"))

    # SmoothQuant's factors of down's input, computed here: up's columns are divided by them exactly
    down = src.tensor("model.layers.0.mlp.down_proj.weight").T  # [F, E]
    g = np.sqrt(ranges["layers.0.down"]) / np.sqrt(np.abs(down).max(axis=1))
    np.testing.assert_allclose(deq("layers.0.gate_up")[:, F:] * g, src.tensor("model.layers.0.mlp.up_proj.weight").T,
                               rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(deq("layers.0.down") / g[:, None] - down) / np.linalg.norm(down) < 0.15  # int4 rounding

    x = rng.standard_normal((16, cfg.hidden_size)).astype(np.float32)

    def mlp(norm, gate_up, down):
        h = (x * norm) @ gate_up
        return (h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]) @ down

    want = mlp(src.tensor("model.layers.0.post_attention_layernorm.weight"),
               np.concatenate([src.tensor("model.layers.0.mlp.gate_proj.weight"),
                               src.tensor("model.layers.0.mlp.up_proj.weight")]).T,
               src.tensor("model.layers.0.mlp.down_proj.weight").T)
    got = mlp(stored["layers.0.mlp_norm"], deq("layers.0.gate_up"), deq("layers.0.down"))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.3  # int4 down (unfolded factors: 1.5)
    want = (x * src.tensor("model.norm.weight")) @ src.tensor("model.embed_tokens.weight").T
    got = (x * stored["norm"]) @ deq("lm_head")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02


@pytest.mark.parametrize("family,config", [("gemma2", GEMMA_CASES[2][1]), ("gemma3", GEMMA_CASES[3][1]),
                                           ("phi3", {"partial_rotary_factor": 0.5})])
def test_smoothing_keeps_the_float_graphs_of_every_family(tmp_path, family, config):
    """Gemma 2/3 (norms by 1 + weight, sandwich norms: the MLP's input norm is pre_feedforward, GeLU gates) and
    Phi-3 (fused q/k/v and gate/up in the source): a float32 bundle's weights file rewritten with smoothed
    tensors (same names, shapes and offsets) gives the same logits from the same graphs."""
    from specedge.export.sources import open_source
    from specedge.export.weights import write_weights
    from specedge.graphs import llama

    model_dir, out = str(tmp_path / "model"), str(tmp_path / "bundle")
    make_hf_model(model_dir, family, **config)
    export_bundle(model_dir, out, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,)), progress=False)
    src = open_source(model_dir)
    rng = np.random.default_rng(6)
    ranges = {name: rng.uniform(0.01, 30.0, k).astype(np.float32) for name, k in _product_inputs(src.config).items()}
    tokens = rng.integers(0, 1000, CHUNK + 5).tolist()

    def logits():
        drv = ContractDriver(out)
        drv.step(tokens[:CHUNK], "prefill", CHUNK)
        return drv.step(tokens[CHUNK:], "step", 5)[0]

    want = logits()
    entry = load_manifest(out).target
    index = read_index(os.path.join(out, weights_index_file(entry.weights)))
    before = open(os.path.join(out, entry.weights), "rb").read()
    refs = write_weights(os.path.join(out, entry.weights),
                         llama.graph_weights(src.config, 64, "float32", src.tensor, act_ranges=ranges, alpha=0.5))
    assert refs == {n: r for n, r in index.items() if n in refs}  # the graphs read the new tensors where the old were
    assert open(os.path.join(out, entry.weights), "rb").read() != before
    got = logits()
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_export_cli_calibrates_on_the_prompts_it_is_given(tiny_models, tmp_path):
    from specedge.cli import main

    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"prompt_ids": list(range(10 * i, 10 * i + 40))}) + "\n" for i in range(3)))
    out = str(tmp_path / "bundle")
    assert main(["export", "--target", tiny_models["llama"][0], "--out", out, "--context", "64", "--prefill-chunk",
                 str(CHUNK), "--gamma", "4", "--quant", "int8", "--calibration", str(ids), "--calibration-count", "2",
                 "--quiet"]) == 0
    assert load_manifest(out).target.quant["smoothing"] == {"alpha": 0.5, "prompts": "ids.jsonl", "prompt_count": 2,
                                                            "tokens": 64}
