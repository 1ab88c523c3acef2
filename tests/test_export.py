"""Export: the bundle's shape (static, portable, weights once) and clear refusals of bad input."""
import errno
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import CHUNK

from specedge.graphs import contract as C
from specedge.graphs.manifest import load_manifest


def specedge(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "specedge", *args], capture_output=True, text=True, cwd=cwd)


def leftovers(directory):
    return [n for n in os.listdir(directory) if n.startswith(".")]


def test_bundle_layout_and_manifest(tiny_bundle):
    m = load_manifest(tiny_bundle)
    raw = json.load(open(os.path.join(tiny_bundle, "manifest.json")))
    assert raw["format"] == "specedge-bundle" and raw["version"] == 4
    t = m.target
    assert sorted((g.role, g.tokens) for g in t.graphs) == [
        (C.PREFILL, CHUNK), (C.STEP, 1), (C.STEP, 2), (C.STEP, 3), (C.STEP, 5), (C.STEP, 9)]
    assert sorted((g.role, g.tokens) for g in m.draft.graphs) == [(C.PREFILL, CHUNK), (C.STEP, 1), (C.STEP, 2)]
    assert m.draft.weights == t.weights and m.draft.layers_of == "target" and m.draft.dims.num_layers == 1
    for key in ("family", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size",
                "context", "batch", "dtype", "weights", "graphs"):
        assert key in raw["models"]["target"]
    assert raw["tokenizer"]["files"] == ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]
    assert raw["tokenizer"]["eos_ids"] == [1]
    assert all(not os.path.isabs(g["file"]) for g in raw["models"]["target"]["graphs"])


def test_graphs_are_static_portable_and_share_one_weights_file(tiny_bundle):
    m = load_manifest(tiny_bundle)
    weights_bytes = os.path.getsize(os.path.join(tiny_bundle, m.target.weights))
    for model in m.models.values():
        for g in model.graphs:
            proto = onnx.load(os.path.join(tiny_bundle, g.file), load_external_data=False)
            assert [(o.domain, o.version) for o in proto.opset_import] == [("", C.OPSET)]
            assert all(n.domain == "" for n in proto.graph.node)
            for v in list(proto.graph.input) + list(proto.graph.output):
                assert all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim), v.name
            locations = {e.value for i in proto.graph.initializer for e in i.external_data if e.key == "location"}
            assert locations == {m.target.weights}
            # Bool<->float casts break NPU compilers: masks are made with Where.
            assert not any(n.op_type == "Cast" and any(a.i == onnx.TensorProto.BOOL for a in n.attribute)
                           for n in proto.graph.node)
    total = sum(os.path.getsize(os.path.join(tiny_bundle, f)) for f in os.listdir(tiny_bundle)
                if f.endswith((".onnx", ".bin")))
    assert total <= 1.1 * weights_bytes + 2e6  # small per-graph constants only


def test_check_passes_on_a_good_bundle(tiny_bundle):
    r = specedge("check", tiny_bundle)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bundle OK" in r.stdout and "FAIL" not in r.stdout
    assert "loads and runs in onnxruntime" in r.stdout
    assert "target: exact rows:" in r.stdout and "draft: exact rows:" in r.stdout


def test_check_refuses_exact_rows_without_loading(tiny_bundle):
    r = specedge("check", tiny_bundle, "--no-load", "--exact-rows")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--exact-rows runs the graphs, which --no-load leaves out" in r.stderr, r.stderr


def test_check_compares_rows_with_the_masked_decode_graph_of_a_step_mask_bundle(tiny_models, tmp_path):
    """With --step-mask every step graph takes a mask, the one-token one too: check's exact rows compares
    with that graph (fed a causal mask), as the runtime decodes with it. It used to find no reference
    and end in a traceback."""
    from specedge.export.bundle import ExportOptions, export_bundle

    out = str(tmp_path / "masked")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK, gammas=(4,),
                                                              step_mask=True, tree_sizes=(8,)), progress=False)
    graphs = load_manifest(out).target.graphs
    assert all(g.step_mask for g in graphs if g.role == C.STEP)
    multi_token = [g.file for g in graphs if g.tokens > 1]  # step5, tree8 and the prefill chunks
    assert any("tree8" in f for f in multi_token)
    r = specedge("check", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"target: exact rows: {len(multi_token)} graphs compute each row bit for bit" in r.stdout, r.stdout


def test_check_runs_a_token_tree_through_each_tree_graph(tiny_models, tmp_path):
    """check's exact rows also runs a spine-plus-leaves tree through a tree graph, row by row against decode
    along its path: a graph that ignores its step_mask (sees the causal chain instead) passes the chain
    comparison and fails this one."""
    from specedge.export.bundle import ExportOptions, export_bundle

    out = str(tmp_path / "trees")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK, gammas=(4,),
                                                              tree_sizes=(8,)), progress=False)
    r = specedge("check", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "graphs compute each row bit for bit as decode does, 1 of them also a token tree's rows" in r.stdout
    path = os.path.join(out, load_manifest(out).target.graph(C.STEP, 8, tree=True).file)
    model = onnx.load(path, load_external_data=False)
    reader = next(n for n in model.graph.node if C.STEP_MASK in n.input)
    causal = onnx.numpy_helper.from_array(np.tril(np.ones((1, 8, 8), bool)), "causal_instead")
    model.graph.initializer.append(causal)
    reader.input[list(reader.input).index(C.STEP_MASK)] = causal.name
    onnx.save(model, path)
    r = specedge("check", out)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "target.tree8.s128.onnx differs from a tree of 8 rows (spine and leaves)" in r.stdout, r.stdout
    assert "differs from 8 one-token steps" not in r.stdout


def test_wide_steps_scatter_keys_and_narrow_steps_scatter_scores(tiny_bundle):
    """A step with T*rep > head_dim (prefill, and the tiny model's T=9 verify) scatters its keys into the past
    and scores all slots in one product; a narrower one scatters its scores; every T > 1 step scatters its
    values as whole rows. Both layouts are in the tiny bundle, and check's exact rows covers them
    (test_check_passes_on_a_good_bundle)."""
    m = load_manifest(tiny_bundle).target
    d = m.dims
    rep = d.num_heads // d.num_kv_heads
    seen = set()
    for g in m.graphs:
        ops = [n.op_type for n in onnx.load(os.path.join(tiny_bundle, g.file), load_external_data=False).graph.node]
        scatters = (ops.count("ScatterND"), ops.count("ScatterElements"))
        if g.tokens == 1:
            assert scatters == (0, 0), g.file
            continue
        wide = g.tokens * rep > d.head_dim
        seen.add(wide)
        # per layer: keys and values (wide), or values and scores (narrow)
        assert scatters == ((2 * d.num_layers, 0) if wide else (d.num_layers, d.num_layers)), g.file
    assert seen == {True, False}


@pytest.mark.parametrize("backend", ["cpu", "ort"])
def test_check_catches_rows_that_differ_from_decode(tiny_bundle, tmp_path, backend):
    """A verify graph whose rows differ from decode in the last bits (logits scaled by 1 + 2**-20, one ulp
    or so) breaks exact speculation; check's exact-rows comparison must see it, on the backend asked for
    (`--backend ort` runs the rows through the code path of the GPU backends, onnxruntime's Python API)."""
    import shutil

    b = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, b)
    path = f"{b}/target.step5.s128.onnx"
    proto = onnx.load(path, load_external_data=False)
    for node in proto.graph.node:
        if "logits" in node.output:
            node.output[0] = "logits_exact"
    scale = onnx.helper.make_tensor("nudge", onnx.TensorProto.FLOAT, [], [1 + 2 ** -20])
    proto.graph.initializer.append(scale)
    proto.graph.node.append(onnx.helper.make_node("Mul", ["logits_exact", "nudge"], ["logits"]))
    onnx.save(proto, path)
    r = specedge("check", b, "--backend", backend)
    assert r.returncode == 1
    where = "" if backend == "cpu" else " on ort"
    assert f"target: exact rows{where}: target.step5.s128.onnx differs from 5 one-token steps" in r.stdout, \
        r.stdout[-3000:]


@pytest.mark.parametrize("damage", ["truncate_graph", "manifest_dims", "truncate_weights", "foreign_op"])
def test_check_reports_a_damaged_bundle(tiny_bundle, tmp_path, damage):
    import shutil

    b = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, b)
    m = json.load(open(f"{b}/manifest.json"))
    if damage == "truncate_graph":
        path = f"{b}/target.step5.s128.onnx"
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    elif damage == "manifest_dims":
        m["models"]["target"]["num_kv_heads"] = 4
        json.dump(m, open(f"{b}/manifest.json", "w"))
    elif damage == "truncate_weights":
        with open(f"{b}/target.weights.bin", "r+b") as f:
            f.truncate(1000)
    elif damage == "foreign_op":
        proto = onnx.load(f"{b}/target.step1.s128.onnx", load_external_data=False)
        proto.graph.node[0].domain = "com.microsoft"
        onnx.save(proto, f"{b}/target.step1.s128.onnx")
    r = specedge("check", b, "--no-load")
    assert r.returncode == 1
    assert "FAIL" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_export_cli_writes_a_bundle(tiny_models, tmp_path):
    out = tmp_path / "cli_bundle"
    r = specedge("export", "--target", tiny_models["llama"][0], "--out", str(out), "--context", "64",
                 "--prefill-chunk", "16", "--gamma", "2,4", "--quiet")
    assert r.returncode == 0, r.stderr
    assert sorted(g.tokens for g in load_manifest(str(out)).target.graphs) == [1, 3, 5, 8, 16]  # 8: the tail chunk
    assert leftovers(tmp_path) == []
    r = specedge("export", "--target", tiny_models["llama"][0], "--out", str(out), "--quiet")
    assert r.returncode == 2 and "exists" in r.stderr and "--force" in r.stderr
    r = specedge("export", "--target", tiny_models["llama"][0], "--out", str(out), "--quiet", "--force",
                 "--context", "64", "--prefill-chunk", "16")
    assert r.returncode == 0 and leftovers(tmp_path) == []


def _unsupported_dir(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    return str(d)


def _gguf_with_unreadable_tensor(tmp_path, embedding=None):
    """A 16-token GGUF whose embedding is unreadable, or the float32 `embedding` given (numpy [vocab, hidden])."""
    import gguf

    path = str(tmp_path / "bad.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(16)
    w.add_context_length(64)
    # Q8_1 has no dequantizer in the gguf package: 16 rows of one 40-byte block (32 values) each.
    if embedding is not None:
        w.add_tensor("token_embd.weight", embedding)
    else:
        w.add_tensor("token_embd.weight", np.zeros((16, 40), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case", ["missing", "no_config", "unsupported_arch", "bad_gguf_type", "small_context",
                                  "untrained_context", "unwritable_out", "gamma_zero", "bad_draft_layers",
                                  "both_drafts", "vocab_mismatch", "tree_over_context"])
def test_bad_input_is_one_clear_error(case, tiny_models, tiny_draft_model, tmp_path):
    llama = tiny_models["llama"][0]
    out = tmp_path / "out"
    args = {"missing": ["--target", str(tmp_path / "nope")],
            "no_config": ["--target", str(tmp_path)],
            "unsupported_arch": ["--target", _unsupported_dir(tmp_path)],
            "bad_gguf_type": ["--target", _gguf_with_unreadable_tensor(tmp_path)] if case == "bad_gguf_type" else [],
            "small_context": ["--target", llama, "--context", "32", "--prefill-chunk", "32"],
            "untrained_context": ["--target", llama, "--context", "8192"],
            "unwritable_out": ["--target", llama],
            "gamma_zero": ["--target", llama, "--gamma", "0,4"],
            "bad_draft_layers": ["--target", llama, "--draft-layers", "3"],
            "both_drafts": ["--target", llama, "--draft", tiny_draft_model[0], "--draft-layers", "1"],
            "vocab_mismatch": ["--target", llama, "--draft", tiny_models["qwen3"][0]],
            "tree_over_context": ["--target", llama, "--context", "128", "--tree", "127"]}[case]
    if case == "vocab_mismatch":  # same size, one token renamed
        tok = json.load(open(f"{tiny_models['qwen3'][0]}/tokenizer.json"))
        vocab = tok["model"]["vocab"]
        vocab["renamed"] = vocab.pop("t5")
        d = tmp_path / "renamed"
        import shutil
        shutil.copytree(tiny_models["qwen3"][0], d)
        json.dump(tok, open(d / "tokenizer.json", "w"))
        args[-1] = str(d)
    expected = {"missing": "not found", "no_config": "without config.json",
                "unsupported_arch": "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
                "bad_gguf_type": "Q8_1", "small_context": "must be larger than --prefill-chunk",
                "untrained_context": "--context 8192 is longer than the 4096 positions the model was trained for",
                "unwritable_out": "cannot write a bundle at ",
                "gamma_zero": "at least 1", "bad_draft_layers": "below the target's 3 layers",
                "both_drafts": "not both", "vocab_mismatch": "differ at id 5",
                # the rule is T + 1 < context; it used to say "smaller than the context" of a 127 below 128
                "tree_over_context": "at most --context - 2 (126), got 127"}[case]
    if case == "unwritable_out":  # a folder inside a file: no permission bits involved (tests may run as root)
        (tmp_path / "a_file").write_text("")
        out = tmp_path / "a_file" / "out"
    r = specedge("export", *args, "--out", str(out), "--quiet")
    assert r.returncode == 2, r.stdout + r.stderr
    assert expected in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not out.exists() and leftovers(tmp_path) == []


def export_in_process(capsys, *args):
    """`specedge export ... --quiet` through the CLI's main in this process (to monkeypatch it): (status, stderr)."""
    from specedge.cli import main

    capsys.readouterr()  # what came before (transformers' progress bars when a test built a model)
    status = main(["export", *args, "--quiet"])
    return status, capsys.readouterr().err


def test_a_full_disk_is_one_clear_error(tiny_models, tmp_path, monkeypatch, capsys):
    """An OSError while writing (ENOSPC on a small tmpfs) is one line and status 2, with the temporary directory
    removed; it used to be a traceback."""
    from specedge.export import bundle

    def full(path, tensors, on_tensor=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(bundle, "write_weights", full)
    out = tmp_path / "out"
    status, err = export_in_process(capsys, "--target", tiny_models["llama"][0], "--out", str(out),
                                    "--context", "64", "--prefill-chunk", "16")
    assert status == 2, err
    assert f"export to {out} failed: No space left on device" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("failing", ["old_aside", "new_in"])
def test_force_keeps_the_old_bundle_when_the_replacement_fails(failing, tiny_models, tmp_path, monkeypatch, capsys):
    """--force moves the old bundle aside, then the new one in: if either rename fails (an immutable directory),
    the old bundle stays where it was and no hidden folder is left; it used to be a traceback and an empty
    .out.old-* folder (or, on the second rename, the old bundle hidden in it)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("old")
    rename = os.rename

    def refuse(src, dst):  # new_in: the new bundle cannot go in, the old one can go back
        old_aside, new_in = src == str(out), dst == str(out) and ".out.tmp-" in src
        if old_aside if failing == "old_aside" else new_in:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), src)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", refuse)
    status, err = export_in_process(capsys, "--target", tiny_models["llama"][0], "--out", str(out), "--force",
                                    "--context", "64", "--prefill-chunk", "16")
    assert status == 2, err
    assert f"cannot replace {out}: Operation not permitted" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert os.listdir(out) == ["manifest.json"] and (out / "manifest.json").read_text() == "old"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("damage", ["bad_json", "missing_key", "truncated", "unreadable", "bad_tokenizer_config",
                                    "bad_generation_config", "garbage_tokenizer", "not_a_tokenizer", "eos_string"])
def test_a_damaged_hf_directory_is_one_clear_error(damage, tiny_models, tmp_path, capsys):
    """A config.json that is not JSON or lacks a field, and a cut-off safetensors file, are refused with the file
    and the problem named; they used to be a JSONDecodeError, a KeyError and a reshape error. A file that cannot
    be opened (no read permission: a traceback before) names the file and the OS's reason; a directory in its
    place stands in for the permission, which the root user of a test machine does not lose. The tokenizer's
    files: a tokenizer_config.json or generation_config.json that is not JSON was a traceback, a tokenizer.json
    that is not one (garbage, or JSON without a model) and an EOS id that is a string gave a bundle and exit 0."""
    import shutil

    src = tmp_path / "model"
    shutil.copytree(tiny_models["llama"][0], src)
    config = src / "config.json"
    if damage == "bad_json":
        config.write_text("{bad")
    elif damage == "missing_key":
        raw = json.loads(config.read_text())
        del raw["hidden_size"]
        config.write_text(json.dumps(raw))
    elif damage == "truncated":
        os.truncate(src / "model.safetensors", 5000)
    elif damage == "unreadable":
        (src / "model.safetensors").unlink()
        (src / "model.safetensors").mkdir()
    else:
        file, text = {"bad_tokenizer_config": ("tokenizer_config.json", "{bad"),
                      "bad_generation_config": ("generation_config.json", "[1"),
                      "garbage_tokenizer": ("tokenizer.json", "garbage"),
                      "not_a_tokenizer": ("tokenizer.json", '{"version": "1.0"}'),
                      "eos_string": ("generation_config.json", '{"eos_token_id": "</s>"}')}[damage]
        (src / file).write_text(text)
    out = tmp_path / "out"
    status, err = export_in_process(capsys, "--target", str(src), "--out", str(out))
    assert status == 2, err
    expected = {"bad_json": f"{config} is not valid JSON: Expecting property name",
                "missing_key": f"{config} has no hidden_size",
                "truncated": f"{src / 'model.safetensors'} is truncated: tensor ",
                "unreadable": f"cannot read {src / 'model.safetensors'}: Is a directory",
                "bad_tokenizer_config": f"{src / 'tokenizer_config.json'} is not valid JSON: ",
                "bad_generation_config": f"{src / 'generation_config.json'} is not valid JSON: ",
                "garbage_tokenizer": f"{src / 'tokenizer.json'} is not valid JSON: ",
                "not_a_tokenizer": f"{src / 'tokenizer.json'} is not a tokenizers file",
                "eos_string": "eos_token_id and bos_token_id must be token ids (integers), not '</s>'"}[damage]
    assert expected in err
    if damage == "truncated":
        assert err.strip().endswith("the file has 5000")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("case", ["vocab", "hidden", "phi3_fused", "gguf"])
def test_a_config_that_disagrees_with_the_weights_is_refused(case, tiny_models, tmp_path, capsys):
    """The graphs are built from the config: one that disagrees with the tensors' shapes gave a bundle that
    cannot run, with status 0. It is refused before anything is written, from the shapes in the index."""
    import shutil

    from models import make_hf_model

    src = tmp_path / "model"
    if case == "gguf":  # 16 tokens of 8 in the metadata, an embedding of 20 rows
        src = _gguf_with_unreadable_tensor(tmp_path, embedding=np.zeros((20, 8), np.float32))
    elif case == "phi3_fused":  # qkv_proj and gate_up_proj: their fused shapes
        make_hf_model(str(src), "phi3", layers=1)
    else:
        shutil.copytree(tiny_models["llama"][0], src)
    if case != "gguf":
        raw = json.loads((src / "config.json").read_text())
        raw.update({"vocab": {"vocab_size": 2000}, "hidden": {"hidden_size": 128},
                    "phi3_fused": {"intermediate_size": 256}}[case])
        (src / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    status, err = export_in_process(capsys, "--target", str(src), "--out", str(out), "--context", "64",
                                    "--prefill-chunk", "16")
    assert status == 2, err
    expected = {"vocab": "model.embed_tokens.weight has shape (1000, 64), but config.json implies (2000, 64)",
                "hidden": "model.embed_tokens.weight has shape (1000, 64), but config.json implies (1000, 128)",
                "phi3_fused": "model.layers.0.mlp.gate_up_proj.weight has shape (256, 64), but config.json implies "
                              "(512, 64)",
                "gguf": "model.embed_tokens.weight has shape (20, 8), but the GGUF metadata implies (16, 8)"}[case]
    assert expected in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and leftovers(tmp_path) == []


def test_draft_with_smaller_head_is_accepted(tiny_models, tmp_path):
    """A draft whose LM head is smaller but whose tokens agree is fine; the sizes are recorded."""
    from models import make_hf_model

    from specedge.export.bundle import ExportOptions, export_bundle

    d = str(tmp_path / "small_head")
    make_hf_model(d, "llama", vocab=900, layers=1, seed=3)
    m = export_bundle(tiny_models["llama"][0], str(tmp_path / "b"), ExportOptions(context=64, prefill_chunk=16),
                      draft_path=d, progress=False)
    assert m.vocab["target"] == 1000 and m.vocab["draft"] == 900 and m.vocab["tokens_compared"] == 900


def test_float16_export_writes_fp16_weights_cache_and_fp32_logits(tiny_models, tmp_path):
    from specedge.export.bundle import ExportOptions, export_bundle

    out = str(tmp_path / "fp16")
    m = export_bundle(tiny_models["llama"][0], out, ExportOptions(context=64, prefill_chunk=16, gammas=(4,),
                                                                  dtype="float16"), progress=False)
    proto = onnx.load(f"{out}/{m.target.graph(C.STEP, 5).file}", load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in list(proto.graph.input) + list(proto.graph.output)}
    assert types[C.past_key(0)] == onnx.TensorProto.FLOAT16 and types[C.new_value(0)] == onnx.TensorProto.FLOAT16
    assert types[C.LOGITS] == onnx.TensorProto.FLOAT
    assert os.path.getsize(f"{out}/{m.target.weights}") < 0.55 * sum(
        np.prod(r["shape"]) * 4 for r in json.load(open(f"{out}/target.weights.json")).values())
    r = specedge("check", out, "--no-load")
    assert r.returncode == 0, r.stdout


def test_the_float_head_reads_its_table_in_parts_that_are_aliases(tiny_bundle):
    """The head is one Gemm per row range of its [V, hidden] table (graphs/llama.py HEAD_PARTS: a session's
    prepacking transient is one part, not the table); the parts are index entries over the table's own bytes,
    so the weights file holds the table once, and together the parts are exactly its rows, in order."""
    from specedge.graphs.manifest import read_index, weights_index_file

    m = load_manifest(tiny_bundle)
    index = read_index(os.path.join(tiny_bundle, weights_index_file(m.target.weights)))
    table_name = "lm_head" if "lm_head" in index else "embed"  # tied: the embedding is the head's table
    table = index[table_name]
    parts = sorted((r for n, r in index.items() if n.startswith(table_name + ".rows")), key=lambda r: r.offset)
    assert len(parts) == 4
    assert [p.offset for p in parts] == [table.offset] + [p.offset + p.length for p in parts[:-1]]
    assert parts[-1].offset + parts[-1].length == table.offset + table.length
    assert sum(p.shape[0] for p in parts) == table.shape[0] and all(p.shape[1:] == table.shape[1:] for p in parts)
    assert os.path.getsize(os.path.join(tiny_bundle, m.target.weights)) == \
        max(r.offset + r.length for n, r in index.items() if ".rows" not in n)
    for g in m.target.graphs:
        if g.role != C.STEP:
            continue
        proto = onnx.load(os.path.join(tiny_bundle, g.file), load_external_data=False)
        gemms = [n.input[1] for n in proto.graph.node if n.op_type == "Gemm"]
        assert sorted(gemms) == sorted(p.name for p in parts), g.file


@pytest.mark.slow
def test_smollm2_bundle_stores_weights_once(smollm2_bundle):
    m = load_manifest(smollm2_bundle)
    weights = 538_000_000
    total = sum(os.path.getsize(os.path.join(smollm2_bundle, f)) for f in os.listdir(smollm2_bundle)
                if os.path.isfile(os.path.join(smollm2_bundle, f)))
    assert total <= 1.1 * weights
    # (prefill 64, 32 and 16, step 1, 2, 3, 5, 9) for the target, (prefill 64, 32 and 16, step 1, 2) for the
    # draft, in each of the six context buckets 128, 256, 384, 512, 768 and 1024
    assert m.target.buckets() == [128, 256, 384, 512, 768, 1024]
    assert len(m.target.graphs) + len(m.draft.graphs) == (8 + 5) * 6
    r = specedge("check", smollm2_bundle)
    assert r.returncode == 0, r.stdout


def test_default_buckets_are_fine_for_short_caches():
    from specedge.export.bundle import default_buckets

    # every 128 slots up to 512 (a step attends over its whole bucket), then every quarter of the context
    assert default_buckets(1024, 64) == [128, 256, 384, 512, 768, 1024]
    assert default_buckets(2048, 64) == [128, 256, 384, 512, 1024, 1536, 2048]
    assert default_buckets(300, 64) == [128, 256, 300]
    # never finer than the prefill chunk, never past the context
    assert default_buckets(1024, 256) == [256, 512, 768, 1024]
    assert default_buckets(128, 64) == [128]
    assert default_buckets(64, 32) == [64]
