"""The step graphs compute what transformers computes, through the contract's KV I/O.

A prompt is prefilled in chunks (the last one padded), then a T=5 step and T=1 steps follow, each feeding
the K/V the graphs returned back in as the past. Logits must match transformers' eager logits at every
position (max abs 1e-4, float32), and each step's new K/V must be transformers' cache entries.
"""
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import CHUNK
from models import FAMILIES, GEMMA_CASES, ContractDriver, make_hf_model

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.graphs import contract as C
from specedge.graphs.manifest import load_manifest

LOGIT_TOL = 1e-4
KV_TOL = 1e-4


def reference(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    keys = np.stack([cache.layers[i].keys[0].numpy() for i in range(len(cache.layers))])
    values = np.stack([cache.layers[i].values[0].numpy() for i in range(len(cache.layers))])
    return out.logits[0].numpy(), keys, values  # [N, V], [L, Hkv, N, D] x 2


def drive(bundle, ids, prompt_len, poison=None):
    """Chunked prefill (padded last chunk), one T=5 step, then T=1 steps; collect logits and K/V."""
    d = ContractDriver(bundle, poison=poison)
    logits, keys, values = [], [], []

    def take(out):
        lg, k, v = out
        logits.append(lg)
        keys.append(k)
        values.append(v)

    for start in range(0, prompt_len, CHUNK):
        take(d.step(ids[start:min(start + CHUNK, prompt_len)], C.STEP, CHUNK))
    take(d.step(ids[prompt_len:prompt_len + 5], C.STEP, 5))
    for t in ids[prompt_len + 5:]:
        take(d.step([t], C.STEP, 1))
    return np.concatenate(logits), np.concatenate(keys, axis=2), np.concatenate(values, axis=2)


def export_for_parity(hf_dir, out):
    export_bundle(hf_dir, out, ExportOptions(context=128, prefill_chunk=CHUNK, gammas=(4,), prefill_logits=True),
                  progress=False)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_kv_match_transformers(family, tiny_models, tmp_path):
    hf_dir, model = tiny_models[family]
    bundle = export_for_parity(hf_dir, str(tmp_path / "b"))
    rng = np.random.default_rng(1)
    prompt_len = 2 * CHUNK + 5  # the third chunk is padded
    ids = rng.integers(0, 1000, prompt_len + 5 + 6).tolist()
    ref_logits, ref_k, ref_v = reference(model, ids)
    logits, keys, values = drive(bundle, ids, prompt_len)
    assert logits.shape == ref_logits.shape
    assert np.abs(logits - ref_logits).max() < LOGIT_TOL
    assert np.abs(keys - ref_k).max() < KV_TOL
    assert np.abs(values - ref_v).max() < KV_TOL


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},  # Qwen3's long-context setting
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False},
])
def test_rope_scaling_matches_transformers(scaling, tmp_path):
    hf_dir = str(tmp_path / "m")
    model = make_hf_model(hf_dir, "llama", layers=2, rope_scaling=scaling)
    bundle = export_for_parity(hf_dir, str(tmp_path / "b"))
    ids = np.random.default_rng(2).integers(0, 1000, 3 * CHUNK + 11).tolist()
    ref_logits, ref_k, _ = reference(model, ids)
    logits, keys, _ = drive(bundle, ids, 3 * CHUNK)
    assert np.abs(logits - ref_logits).max() < LOGIT_TOL
    assert np.abs(keys - ref_k).max() < KV_TOL


def _llama3_rope_factors(config) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel): Llama 3 rope scaling as rope_freqs, one divisor
    per frequency. Written from its description, not from specedge's code."""
    import math

    s = config.rope_scaling  # transformers 5 keeps rope_theta in it too
    d = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (s["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float32) / d))
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(factors, np.float32)


def _gguf_of(model, path: str, rope_freqs: np.ndarray | None, yarn: dict | None = None,
             sliding_window: int | None = None, arch: str = "llama", extra=None) -> str:
    """The tiny HF llama as an F32 GGUF the way llama.cpp's converter writes one: q/k rows permuted for its
    interleaved RoPE, Llama 3 scaling as rope_freqs, YaRN as `yarn` (GGUF key suffix -> value), a minimal
    gpt2-style tokenizer. `arch` "phi3": fused qkv_proj and gate_up_proj kept as attn_qkv and ffn_up, and
    `extra(writer)` adds what else the architecture's converter writes. Gemma ("gemma", "gemma2", "gemma3"): every
    norm weight stored as 1 + w, no permutation; Gemma 2/3's post_attention_layernorm is post_attention_norm, their
    pre_feedforward_layernorm ffn_norm."""
    import gguf

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    gemma = arch.startswith("gemma")

    def permute(w, n):
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    if arch in ("gemma2", "gemma3"):
        names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
                      "self_attn.k_norm": "attn_k_norm"})
    rope = cfg.rope_scaling
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_merges([])
    w.add_eos_token_id(1)
    w.add_eot_token_id(7)  # Llama 3 instruct ends a turn with <|eot_id|>, a token other than its EOS
    for name, t in model.state_dict().items():
        t = t.numpy().astype(np.float32)
        if gemma and name.endswith("norm.weight"):
            t = t + np.float32(1)
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", t)
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            if rest == "self_attn.q_proj" and not gemma:
                t = permute(t, heads)
            elif rest == "self_attn.k_proj" and not gemma:
                t = permute(t, kv_heads)
            w.add_tensor(f"blk.{layer}.{names[rest]}.weight", t)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    if yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        for key, value in yarn.items():
            if key == "original_context_length":
                w.add_uint32(f"{arch}.rope.scaling.{key}", value)
            else:
                w.add_float32(f"{arch}.rope.scaling.{key}", value)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llama3_rope_scaling_from_a_gguf_matches_transformers(tmp_path):
    """Llama 3.1+ GGUFs carry their rope scaling as rope_freqs (per-frequency divisors): a bundle exported from
    such a file computes transformers' logits for the HF model it was converted from; without the tensor the
    logits are off (the test would notice a reader that ignored it)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    model = make_hf_model(str(tmp_path / "m"), "llama", layers=2, rope_scaling=scaling)
    ids = np.random.default_rng(2).integers(0, 1000, 3 * CHUNK + 11).tolist()
    ref_logits, ref_k, _ = reference(model, ids)
    factors = _llama3_rope_factors(model.config)
    assert factors.min() == 1.0 and factors.max() == 8.0  # both ends of the scaling occur in this head_dim
    for name, rope_freqs in (("with", factors), ("without", None)):
        bundle = export_for_parity(_gguf_of(model, str(tmp_path / f"{name}.gguf"), rope_freqs), str(tmp_path / name))
        logits, keys, _ = drive(bundle, ids, 3 * CHUNK)
        assert load_manifest(bundle).tokenizer.eos_ids == [1, 7]
        if rope_freqs is not None:
            assert np.abs(logits - ref_logits).max() < LOGIT_TOL
            assert np.abs(keys - ref_k).max() < KV_TOL
        else:
            assert np.abs(keys - ref_k).max() > 100 * KV_TOL
    # a rope_freqs that does not fit the heads is one line and exit 2, with nothing written
    bad = _gguf_of(model, str(tmp_path / "bad.gguf"), factors[:3])
    r = subprocess.run([sys.executable, "-m", "specedge", "export", "--target", bad, "--out", str(tmp_path / "bad")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "rope_freqs has 3 factors for a head_dim of 16" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("scaling, keys", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},  # Qwen3's long-context setting
     {"factor": 4.0, "original_context_length": 32}),
    # head_dim 16: with these the ramp runs from dimension 3 to 5, where the defaults (32, 1) give 2 to 6
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 8.0, "beta_slow": 3.0,
      "attention_factor": 1.3},
     {"factor": 8.0, "original_context_length": 4096, "yarn_beta_fast": 8.0, "yarn_beta_slow": 3.0,
      "yarn_attn_factor": 1.3}),
])
def test_yarn_rope_scaling_from_a_gguf_matches_transformers(scaling, keys, tmp_path):
    """A GGUF with YaRN keys (as llama.cpp's converter writes them: type, factor, original context length, and
    beta_fast, beta_slow, attention_factor when the config has them) computes transformers' logits for the HF
    model it was converted from; without the keys the logits are off. A key with no transformers counterpart
    is one line and exit 2, with nothing written."""
    model = make_hf_model(str(tmp_path / "m"), "llama", layers=2, rope_scaling=scaling)
    ids = np.random.default_rng(2).integers(0, 1000, 3 * CHUNK + 11).tolist()
    ref_logits, ref_k, _ = reference(model, ids)
    for name, yarn in (("with", keys), ("without", None)):
        bundle = export_for_parity(_gguf_of(model, str(tmp_path / f"{name}.gguf"), None, yarn), str(tmp_path / name))
        logits, keys_out, _ = drive(bundle, ids, 3 * CHUNK)
        if yarn:
            assert np.abs(logits - ref_logits).max() < LOGIT_TOL
            assert np.abs(keys_out - ref_k).max() < KV_TOL
        else:
            assert np.abs(keys_out - ref_k).max() > 100 * KV_TOL
    bad = _gguf_of(model, str(tmp_path / "bad.gguf"), None, dict(keys, yarn_ext_factor=0.5))
    r = subprocess.run([sys.executable, "-m", "specedge", "export", "--target", bad, "--out", str(tmp_path / "bad")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "llama.rope.scaling.yarn_ext_factor = 0.5 is not supported" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("family, window_layers", [("mistral", None), ("qwen2", 1), ("qwen3", 2)])
def test_sliding_window_attention_matches_transformers(family, window_layers, tmp_path):
    """A query sees the last `sliding_window` positions only (itself included) in the layers that slide: all of
    Mistral's, Qwen2/3's from max_window_layers on. A window of 4, shorter than the prefill chunks and the T=5
    step: logits equal transformers' over a sequence many windows long, and so do the K/V entries transformers
    keeps (a sliding layer's cache holds its last window - 1 only; ours keeps every entry and masks)."""
    model = make_hf_model(str(tmp_path / "m"), family, layers=3, sliding_window=4, max_window_layers=window_layers)
    full = make_hf_model(str(tmp_path / "full"), family, layers=3)  # the same weights (same seed), no window
    ids = np.random.default_rng(4).integers(0, 1000, 3 * CHUNK + 11).tolist()
    ref_logits, kept = assert_matches_transformers(model, str(tmp_path / "m"), str(tmp_path / "b"), ids)
    assert np.abs(reference(full, ids)[0] - ref_logits).max() > 100 * LOGIT_TOL  # the window matters here
    assert min(kept) < len(ids)  # some layer slides


def assert_matches_transformers(model, hf_dir: str, out: str, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """Export `hf_dir`, drive it over `ids` (prefill chunks, a T=5 step, decode steps) and compare with
    transformers' forward: the logits, and in each layer the K/V entries transformers keeps (a sliding layer's
    cache holds its last window - 1 only; ours keeps every entry and masks). Returns transformers' logits and
    the entries it kept per layer."""
    with torch.no_grad():
        ref = model(torch.tensor([ids]), use_cache=True)
    ref_logits = ref.logits[0].numpy()
    logits, keys, values = drive(export_for_parity(hf_dir, out), ids, 3 * CHUNK)
    assert np.abs(logits - ref_logits).max() < LOGIT_TOL
    kept = []
    for i, layer in enumerate(ref.past_key_values.layers):
        ref_k, ref_v = layer.keys[0].numpy(), layer.values[0].numpy()  # [Hkv, n, D], the last n positions
        n = ref_k.shape[1]
        kept.append(n)
        assert np.abs(keys[i][:, -n:] - ref_k).max() < KV_TOL
        assert np.abs(values[i][:, -n:] - ref_v).max() < KV_TOL
    return ref_logits, kept


PHI3_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
                 "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0], "original_max_position_embeddings": 128}


PHI3_CASES = [
    {},  # Phi-3-mini-4k's kind: fused qkv_proj and gate_up_proj, plain RoPE, untied head
    {"partial_rotary_factor": 0.75, "sliding_window": 6},  # Phi-4-mini turns 3/4 of each head; Phi-3's window
    # the 128k kind: cos and sin scaled by sqrt(1 + ln 32 / ln 128) too
    {"partial_rotary_factor": 0.75, "rope_scaling": PHI3_LONGROPE, "max_position_embeddings": 4096,
     "original_max_position_embeddings": 128},
]


@pytest.mark.parametrize("config", PHI3_CASES)
def test_phi3_matches_transformers(config, tmp_path):
    """Phi3ForCausalLM (the source splits its fused projections into the Llama names; RoPE may turn only the
    first rotary_dim dimensions, LongRoPE scales them by its short factors within the original context): logits
    and K/V equal transformers'. A window, where given, is shorter than the prefill chunks."""
    model = make_hf_model(str(tmp_path / "m"), "phi3", layers=2, **config)
    ids = np.random.default_rng(6).integers(0, 1000, 3 * CHUNK + 11).tolist()
    assert_matches_transformers(model, str(tmp_path / "m"), str(tmp_path / "b"), ids)


@pytest.mark.parametrize("config", PHI3_CASES)
def test_phi3_from_a_gguf_matches_transformers(config, tmp_path):
    """A Phi-3 GGUF as llama.cpp's converter (Phi3MiniModel) writes one, from its description: attn_qkv and ffn_up
    fused, no q/k permutation, rope.dimension_count for partial rotary, a sliding window of 0 for none, and
    LongRoPE as rope_factors_short/long tensors with rope.scaling.attn_factor and the original context length."""
    import math

    model = make_hf_model(str(tmp_path / "m"), "phi3", layers=2, **config)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    original = config.get("original_max_position_embeddings", c.max_position_embeddings)

    def phi3_keys(w):
        w.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(config.get("sliding_window") or 0)
        if "rope_scaling" in config:
            scale = c.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            for kind in ("long", "short"):
                w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(PHI3_LONGROPE[f"{kind}_factor"], np.float32))

    ids = np.random.default_rng(6).integers(0, 1000, 3 * CHUNK + 11).tolist()
    with torch.no_grad():
        ref_logits = model(torch.tensor([ids])).logits[0].numpy()
    gguf_path = _gguf_of(model, str(tmp_path / "m.gguf"), None, arch="phi3", extra=phi3_keys)
    logits = drive(export_for_parity(gguf_path, str(tmp_path / "b")), ids, 3 * CHUNK)[0]
    assert np.abs(logits - ref_logits).max() < LOGIT_TOL


@pytest.mark.parametrize("family, config", GEMMA_CASES)
def test_gemma_matches_transformers(family, config, tmp_path):
    """Gemma 1, 2 and 3 (text): logits and the K/V entries transformers keeps equal transformers'."""
    model = make_hf_model(str(tmp_path / "m"), family, layers=3, tie=True, **config)
    ids = np.random.default_rng(7).integers(0, 1000, 3 * CHUNK + 11).tolist()
    assert_matches_transformers(model, str(tmp_path / "m"), str(tmp_path / "b"), ids)


# What a Gemma GGUF can say, under llama.cpp's rules for what it does not: queries scaled by 1/sqrt(head_dim) (16
# here), Gemma 2 sliding in every other layer from the first, Gemma 3 in five of each six (base 10000 there).
GEMMA_GGUF_CASES = [
    ("gemma", 3, {}),
    ("gemma2", 3, {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 0.05, "final_logit_softcapping": 3.0,
                   "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    ("gemma3", 7, {"query_pre_attn_scalar": 16, "sliding_window": 4,
                   "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
                   "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}),
]


@pytest.mark.parametrize("family, layers, config", GEMMA_GGUF_CASES)
def test_gemma_from_a_gguf_matches_transformers(family, layers, config, tmp_path):
    """A Gemma 1/2/3 GGUF as llama.cpp's converter writes one (norm weights 1 + w, no q/k permutation; Gemma 2's
    caps and window, Gemma 3's global RoPE base and linear scaling as keys): transformers' logits. transformers'
    own GGUF loader (Gemma 2/3) reads the file's tensors, with the model's config, into the same logits: a check
    of the file's names and norms that does not go through our reader."""
    import gguf

    model = make_hf_model(str(tmp_path / "m"), family, layers=layers, tie=True, **config)
    with torch.no_grad():  # gate pre-activations of a few units, where GeLU's tanh form parts from the exact one
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.mul_(8)
    c = model.config
    ids = np.random.default_rng(8).integers(0, 1000, 3 * CHUNK + 11).tolist()
    with torch.no_grad():
        ref_logits = model(torch.tensor([ids])).logits[0].numpy()

    def keys(w):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        if family == "gemma2":
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        if family == "gemma3":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(8.0)

    path = _gguf_of(model, str(tmp_path / "m.gguf"), None, arch=family, extra=keys,
                    sliding_window=config.get("sliding_window"))
    logits = drive(export_for_parity(path, str(tmp_path / "b")), ids, 3 * CHUNK)[0]
    assert np.abs(logits - ref_logits).max() < LOGIT_TOL
    if family != "gemma":  # transformers reads no Gemma 1 GGUF
        from transformers import AutoModelForCausalLM
        theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", config=c,
                                                      dtype=torch.float32).eval()
        with torch.no_grad():
            assert np.abs(theirs(torch.tensor([ids])).logits[0].numpy() - ref_logits).max() < LOGIT_TOL


def test_gemma_27b_ggufs_scale_queries_by_hidden_over_heads(tmp_path):
    """llama.cpp tells Gemma 2 and 3 27B apart by their layer count (46, 62): their queries are scaled by
    1/sqrt(hidden / heads) (query_pre_attn_scalar 144 in their HF configs, head_dim 128), every other size's by
    1/sqrt(head_dim)."""
    from specedge.export.sources import GGUFSource

    for family, layers, big in (("gemma2", 46, True), ("gemma2", 26, False), ("gemma3", 62, True),
                                ("gemma3", 26, False), ("gemma3", 46, False)):
        model = make_hf_model(str(tmp_path / "m"), family, layers=layers, hidden=32, heads=4, kv_heads=2, vocab=64,
                              head_dim=16, sliding_window=4)
        path = _gguf_of(model, str(tmp_path / f"{family}{layers}.gguf"), None, arch=family,
                        extra=lambda w: w.add_key_length(16), sliding_window=4)
        cfg = GGUFSource(path).config
        assert cfg.query_scale == pytest.approx((32 / 4 if big else 16) ** -0.5), (family, layers)
        assert cfg.sliding_layers == tuple(i for i in range(layers) if (i + 1) % (2 if family == "gemma2" else 6))


@pytest.mark.parametrize("kind, approximate", [("gelu_tanh", "tanh"), ("gelu", "none"), ("silu", None)])
def test_activations_match_torch(kind, approximate):
    """The MLP activations the graphs build from opset-17 ops equal torch's over [-6, 6] (float32 rounding);
    GeLU's two forms differ there by far more, so each is told apart."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specedge.graphs.builder import GraphBuilder
    from specedge.graphs.llama import _activation

    g = GraphBuilder("act", {}, "none.bin")
    g.inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [1201]))
    y = _activation(g, "x", kind, "float32")
    g.outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, [1201]))
    x = np.linspace(-6, 6, 1201, dtype=np.float32)
    got = ort.InferenceSession(g.build().SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    t = torch.from_numpy(x)
    want = (torch.nn.functional.silu(t) if approximate is None
            else torch.nn.functional.gelu(t, approximate=approximate)).numpy()
    assert np.abs(got - want).max() < 1e-6
    if approximate is not None:
        other = torch.nn.functional.gelu(t, approximate="none" if approximate == "tanh" else "tanh").numpy()
        assert np.abs(got - other).max() > 1e-4
    assert onnx.checker.check_model(g.build()) is None


def test_longrope_past_its_original_context_is_refused(tmp_path):
    """LongRoPE switches to its long factors once a sequence passes the original context, re-rotating every
    position: no static graph computes that. One line, exit 2, nothing written."""
    make_hf_model(str(tmp_path / "m"), "phi3", layers=1, partial_rotary_factor=0.75, rope_scaling=PHI3_LONGROPE,
                  max_position_embeddings=4096, original_max_position_embeddings=128)
    r = subprocess.run([sys.executable, "-m", "specedge", "export", "--target", str(tmp_path / "m"), "--out",
                        str(tmp_path / "b"), "--context", "256"], capture_output=True, text=True)
    assert r.returncode == 2 and "switches to its long factors past 128 positions" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "b").exists()


def test_default_prefill_graph_fills_the_same_cache(tiny_models, tiny_bundle):
    """The default prefill graph has no logits; its K/V still equal transformers' cache."""
    _, model = tiny_models["llama"]
    ids = np.random.default_rng(3).integers(0, 1000, 2 * CHUNK).tolist()
    _, ref_k, ref_v = reference(model, ids)
    d = ContractDriver(tiny_bundle)
    assert C.LOGITS not in [o.name for o in d.sessions[(C.PREFILL, CHUNK)].get_outputs()]
    for start in range(0, len(ids), CHUNK):
        logits, _, _ = d.step(ids[start:start + CHUNK], C.PREFILL, CHUNK)
        assert logits is None
    assert np.abs(d.keys[:, 0, :, :len(ids)] - ref_k).max() < KV_TOL
    assert np.abs(d.values[:, 0, :, :len(ids)] - ref_v).max() < KV_TOL


def test_stale_slots_are_harmless(tiny_models, tmp_path):
    """Garbage (uniform +-1e4) in every slot >= cache_len changes no logit beyond float rounding."""
    bundle = export_for_parity(tiny_models["qwen3"][0], str(tmp_path / "b"))
    ids = np.random.default_rng(4).integers(0, 1000, 2 * CHUNK + 3 + 5 + 4).tolist()
    clean, _, _ = drive(bundle, ids, 2 * CHUNK + 3)
    poisoned, _, _ = drive(bundle, ids, 2 * CHUNK + 3, poison=1e4)
    assert np.isfinite(poisoned).all()
    assert np.abs(clean - poisoned).max() <= 1e-6


def test_step_mask_causal_equals_no_mask(tiny_models, tmp_path):
    """The optional step_mask input with a causal mask gives the causal graph's logits; a tree mask hides
    the branch a token does not descend from."""
    import onnxruntime as ort

    from specedge.graphs.manifest import load_manifest

    out = str(tmp_path / "b")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,),
                                                              step_mask=True), progress=False)
    entry = load_manifest(out).target
    graph = entry.graph(C.STEP, 5)
    assert graph.step_mask
    sess = ort.InferenceSession(f"{out}/{graph.file}", providers=["CPUExecutionProvider"])
    dims = entry.dims
    ids = np.array([[5, 6, 7, 8, 9]])
    feeds = {C.INPUT_IDS: ids, C.CACHE_LEN: np.array([0])}
    for i in range(dims.num_layers):
        feeds[C.past_key(i)] = np.zeros(dims.cache_shape, np.float32)
        feeds[C.past_value(i)] = np.zeros(dims.cache_shape, np.float32)
    causal = np.tril(np.ones((5, 5), bool))[None]
    chain = sess.run([C.LOGITS], {**feeds, C.POSITION_IDS: np.arange(5)[None], C.STEP_MASK: causal})[0]
    # Tree: root 5 at depth 0; children 6 and 7 at depth 1 (siblings); 8 under 6 and 9 under 7 at depth 2.
    tree = np.zeros((1, 5, 5), bool)
    for i, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4]]):
        tree[0, i, ancestors] = True
    branched = sess.run([C.LOGITS], {**feeds, C.POSITION_IDS: np.array([[0, 1, 1, 2, 2]]), C.STEP_MASK: tree})[0]
    # Token 8's path is 5, 6, 8 and token 9's path is 5, 7, 9: compare with those sequences run causally.
    for path, row in (([5, 6, 8], 3), ([5, 7, 9], 4)):
        feeds3 = {**feeds, C.INPUT_IDS: np.array([path + [0, 0]]), C.POSITION_IDS: np.arange(5)[None],
                  C.STEP_MASK: causal}
        straight = sess.run([C.LOGITS], feeds3)[0]
        assert np.abs(branched[0, row] - straight[0, 2]).max() < LOGIT_TOL
    assert np.abs(chain[0, :2] - branched[0, :2]).max() < LOGIT_TOL


def test_a_sliding_window_from_a_gguf_matches_transformers(tmp_path):
    """A Mistral converted to GGUF with its window (llama.attention.sliding_window): transformers' logits."""
    model = make_hf_model(str(tmp_path / "m"), "mistral", layers=2, sliding_window=4)
    ids = np.random.default_rng(5).integers(0, 1000, 3 * CHUNK + 11).tolist()
    with torch.no_grad():
        ref_logits = model(torch.tensor([ids])).logits[0].numpy()
    for name, window in (("with", 4), ("without", None)):
        bundle = export_for_parity(_gguf_of(model, str(tmp_path / f"{name}.gguf"), None, sliding_window=window),
                                   str(tmp_path / name))
        logits = drive(bundle, ids, 3 * CHUNK)[0]
        assert (np.abs(logits - ref_logits).max() < LOGIT_TOL) == (window is not None), name
    # a Qwen GGUF does not say which of its layers slide: one line, exit 2, nothing written
    bad = _gguf_of(model, str(tmp_path / "qwen.gguf"), None, sliding_window=4, arch="qwen2")
    r = subprocess.run([sys.executable, "-m", "specedge", "export", "--target", bad, "--out", str(tmp_path / "bad")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "qwen2.attention.sliding_window is not supported for qwen2" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "bad").exists()


def test_a_tree_nodes_sliding_window_counts_depths(tmp_path):
    """With sliding-window attention a tree node sees the ancestors less than a window above it in depth (its
    position), whatever slots the step put them in: a side branch root -> 7 -> 8 -> 9 at slots 0, 2, 3, 4 with a
    window of 2 gives each node the logits of its path run as a chain."""
    import onnxruntime as ort

    hf = str(tmp_path / "m")
    make_hf_model(hf, "mistral", layers=2, sliding_window=2)
    out = str(tmp_path / "b")
    export_bundle(hf, out, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,), step_mask=True), progress=False)
    entry = load_manifest(out).target
    sess = ort.InferenceSession(f"{out}/{entry.graph(C.STEP, 5).file}", providers=["CPUExecutionProvider"])
    feeds = {C.CACHE_LEN: np.array([0])}
    for i in range(entry.dims.num_layers):
        feeds[C.past_key(i)] = np.zeros(entry.dims.cache_shape, np.float32)
        feeds[C.past_value(i)] = np.zeros(entry.dims.cache_shape, np.float32)
    # root 5; 6 and 7 its children (depth 1); 8 under 7 (depth 2), 9 under 8 (depth 3)
    tree = np.zeros((1, 5, 5), bool)
    for i, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 2, 3], [0, 2, 3, 4]]):
        tree[0, i, ancestors] = True
    branched = sess.run([C.LOGITS], {**feeds, C.INPUT_IDS: np.array([[5, 6, 7, 8, 9]]),
                                     C.POSITION_IDS: np.array([[0, 1, 1, 2, 3]]), C.STEP_MASK: tree})[0]
    causal = np.tril(np.ones((1, 5, 5), bool))
    straight = sess.run([C.LOGITS], {**feeds, C.INPUT_IDS: np.array([[5, 7, 8, 9, 0]]),
                                     C.POSITION_IDS: np.arange(5)[None], C.STEP_MASK: causal})[0]
    for row, depth in ((2, 1), (3, 2), (4, 3)):
        assert np.abs(branched[0, row] - straight[0, depth]).max() < LOGIT_TOL, row


def test_spine_and_leaf_rows_of_a_tree_step_equal_decode_bitwise(tiny_models, tmp_path):
    """docs/bundle.md: a tree row is position-consistent when its ancestors are step tokens 0..d-1. A tree
    step over a spine (0 -> 1 -> 2) with leaves (3 under node 0, 4 under the root) gives, for every node,
    bit for bit the logits of one-token decode steps along the node's path from the same cache."""
    import onnxruntime as ort

    from specedge.graphs.manifest import load_manifest

    out = str(tmp_path / "b")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,),
                                                              step_mask=True), progress=False)
    entry = load_manifest(out).target
    dims = entry.dims
    sessions = {T: ort.InferenceSession(f"{out}/{entry.graph(C.STEP, T).file}", providers=["CPUExecutionProvider"])
                for T in (1, 5)}
    rng = np.random.default_rng(0)
    L = 20
    shape = (dims.num_layers,) + dims.cache_shape
    keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def run(T, ids, positions, length, mask, keys, values):
        feeds = {C.INPUT_IDS: np.array([ids]), C.POSITION_IDS: np.array([positions]), C.CACHE_LEN: np.array([length])}
        for i in range(dims.num_layers):
            feeds[C.past_key(i)], feeds[C.past_value(i)] = keys[i], values[i]
        if any(n.name == C.STEP_MASK for n in sessions[T].get_inputs()):
            feeds[C.STEP_MASK] = mask
        names = [o.name for o in sessions[T].get_outputs()]
        res = dict(zip(names, sessions[T].run(None, feeds)))
        for i in range(dims.num_layers):  # commit the step's entries after the valid ones
            keys[i, :, :, length:length + T] = res[C.new_key(i)]
            values[i, :, :, length:length + T] = res[C.new_value(i)]
        return res[C.LOGITS][0]

    one = np.ones((1, 1, 1), bool)
    for t, token in enumerate(rng.integers(2, 1000, L)):  # the history, by decode steps
        run(1, [int(token)], [t], t, one, keys, values)
    tokens = [11, 12, 13, 14, 15]
    parents = [-1, 0, 1, 0, -1]  # node index of each node's parent (-1: the pending token's child)
    paths = []
    for i in range(5):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        paths.append(path)
    mask = np.zeros((1, 5, 5), bool)
    for i, path in enumerate(paths):
        mask[0, i, path] = True
    depth = [len(p) - 1 for p in paths]
    tree = run(5, tokens, [L + d for d in depth], L, mask, keys.copy(), values.copy())
    for i, path in enumerate(paths):
        k, v = keys.copy(), values.copy()
        for d, node in enumerate(path):
            row = run(1, [tokens[node]], [L + d], L + d, one, k, v)[0]
        assert np.array_equal(tree[i], row), (i, path, float(np.abs(tree[i] - row).max()))


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_path, smollm2_hf, tmp_path):
    out = str(tmp_path / "smol")
    export_bundle(smollm2_path, out, ExportOptions(context=256, prefill_chunk=CHUNK, gammas=(4,),
                                                   prefill_logits=True), progress=False)
    rng = np.random.default_rng(5)
    prompt_len = 5 * CHUNK + 7
    ids = rng.integers(0, 49152, prompt_len + 5 + 6).tolist()
    ref_logits, ref_k, ref_v = reference(smollm2_hf, ids)
    logits, keys, values = drive(out, ids, prompt_len)
    assert np.abs(logits - ref_logits).max() < LOGIT_TOL
    # K/V of a real model reach tens; compare relative to their scale.
    assert np.abs(keys - ref_k).max() < KV_TOL * max(1.0, np.abs(ref_k).max())
    assert np.abs(values - ref_v).max() < KV_TOL * max(1.0, np.abs(ref_v).max())
