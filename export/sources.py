"""Model sources: an HF directory (config.json + *.safetensors) or a .gguf file.

Each source gives a LlamaConfig, float32 tensors by their transformers name, and tokenizer facts. Nothing
here needs torch: safetensors files are read straight from their header (bf16 widened by a shift), and
GGUF tensors are dequantized with the `gguf` package.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..graphs.llama import FAMILIES, LlamaConfig
from ..graphs.quant import Blocks
from ..errors import ExportError


@dataclass
class TokenizerInfo:
    bos_id: int | None
    eos_ids: list[int]
    chat_template: str | None
    files: dict[str, bytes] = field(default_factory=dict)  # file name -> content, copied into the bundle


class Source:
    path: str
    config: LlamaConfig
    config_name = "the config"  # where the config came from, for messages

    def tensor(self, hf_name: str) -> np.ndarray:  # float32
        raise NotImplementedError

    def shape(self, hf_name: str) -> tuple[int, ...] | None:
        """A stored tensor's shape in the transformers layout, from the index (no data read); None if absent."""
        raise NotImplementedError

    def check_shapes(self) -> None:
        """Refuse, before anything is written, a config that disagrees with the weights: the graphs are built
        from the config, so a wrong vocab_size or hidden_size would give a bundle that cannot run. Absent
        tensors are left to tensor(), which names them."""
        c = self.config
        hidden, q, kv, inter = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        expected = {"model.embed_tokens.weight": (c.vocab_size, hidden)}
        if not c.tie_word_embeddings:
            expected["lm_head.weight"] = (c.vocab_size, hidden)
        for i in range(c.num_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            if c.family == "phi3" and self.shape(a + "qkv_proj.weight") is not None:  # fused (phi3_rows)
                expected[a + "qkv_proj.weight"] = (q + 2 * kv, hidden)
                expected[m + "gate_up_proj.weight"] = (2 * inter, hidden)
            else:
                expected.update({a + "q_proj.weight": (q, hidden), a + "k_proj.weight": (kv, hidden),
                                 a + "v_proj.weight": (kv, hidden), m + "gate_proj.weight": (inter, hidden),
                                 m + "up_proj.weight": (inter, hidden)})
            expected.update({a + "o_proj.weight": (hidden, q), m + "down_proj.weight": (hidden, inter)})
        for name, want in expected.items():
            got = self.shape(name)
            if got is not None and got != want:
                raise ExportError(f"{self.path}: {name} has shape {got}, but {self.config_name} implies {want}")

    def blocks(self, hf_name: str) -> Blocks | None:
        """The tensor as int blocks in the ONNX layout ([in, out], blocks along `in`), when the source stores it
        that way already (GGUF Q4_0/Q5_0/Q8_0 symmetric, Q4_1/Q5_1/Q4_K/Q5_K with per-block offsets); None otherwise."""
        return None

    def tokenizer(self) -> TokenizerInfo:
        raise NotImplementedError

    def vocab_tokens(self) -> list[str] | None:
        """The token strings by id, to prove a draft and a target share a vocabulary."""
        raise NotImplementedError


def open_source(path: str) -> Source:
    if not os.path.exists(path):
        raise ExportError(f"model path not found: {path}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ExportError(f"{path} is a directory without config.json (expected an HF model directory)")
        return HFSource(path)
    if path.endswith(".gguf"):
        return GGUFSource(path)
    raise ExportError(f"{path}: expected an HF model directory or a .gguf file")


# -- HF directory -------------------------------------------------------------------------------------
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
_PHI3_PARTS = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}  # what Phi-3 fuses (phi3_part)


def is_phi3_part(hf_name: str, c: LlamaConfig) -> bool:
    parts = hf_name.rsplit(".", 2)  # [prefix, part, "weight"]
    return c.family == "phi3" and len(parts) == 3 and parts[1] in _PHI3_PARTS


def phi3_rows(hf_name: str, c: LlamaConfig) -> tuple[str, tuple[int, int]]:
    """Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (rows in that order; a GGUF keeps them
    so, as attn_qkv and ffn_up); the graph fuses them itself, from the Llama names. Returns the fused tensor's
    name and the rows [first, end) of the part."""
    prefix, part, _ = hf_name.rsplit(".", 2)
    if part in ("q_proj", "k_proj", "v_proj"):
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        return f"{prefix}.qkv_proj.weight", rows[part]
    n = c.intermediate_size
    return f"{prefix}.gate_up_proj.weight", (0, n) if part == "gate_proj" else (n, 2 * n)


def phi3_part(hf_name: str, c: LlamaConfig, tensor: Callable[[str], np.ndarray]) -> np.ndarray:
    fused, (first, end) = phi3_rows(hf_name, c)
    return np.ascontiguousarray(tensor(fused)[first:end])


def config_from_hf(cfg: dict) -> LlamaConfig:
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in FAMILIES:
        raise ExportError(f"unsupported architecture {arch}; supported: {', '.join(FAMILIES)}")
    family = FAMILIES[arch]
    heads = cfg["num_attention_heads"]
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local_theta = cfg.get("rope_local_base_freq", 10000.0) if family == "gemma3" else None
    if "full_attention" in rope or "sliding_attention" in rope:  # per layer type (Gemma 3 in transformers 5)
        local, rope = dict(rope.get("sliding_attention") or {}), dict(rope.get("full_attention") or {})
        local_theta = local.get("rope_theta", local_theta)
        if local.get("rope_type", "default") != "default":
            raise ExportError(f"rope_type {local['rope_type']} in the sliding layers is not supported (default only)")
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    partial = float(rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):  # "su": Phi-3's first name for it
        rope["rope_type"] = "longrope"
        rope.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    gemma = _gemma_settings(family, cfg) if family.startswith("gemma") else {}
    if not gemma and cfg.get("hidden_act", "silu") != "silu":
        raise ExportError(f"hidden_act {cfg.get('hidden_act')} is not supported (SwiGLU with silu only)")
    if cfg.get("mlp_bias"):
        raise ExportError("mlp_bias is not supported")
    window = cfg.get("sliding_window")
    if family == "qwen2" or family == "qwen3":
        window = window if cfg.get("use_sliding_window") else None
    layers = cfg["num_hidden_layers"]
    if window is None:
        sliding = None
    elif cfg.get("layer_types"):  # transformers 5 spells out which layers slide
        sliding = tuple(i for i, kind in enumerate(cfg["layer_types"]) if kind == "sliding_attention")
    elif family in ("qwen2", "qwen3"):  # older configs: the layers from max_window_layers on (transformers' rule)
        sliding = tuple(range(cfg.get("max_window_layers", 28), layers))
    elif family in ("gemma2", "gemma3"):  # older configs: every layer but each pattern-th (transformers' rule)
        pattern = 2 if family == "gemma2" else cfg.get("sliding_window_pattern", 6)
        sliding = tuple(i for i in range(layers) if (i + 1) % pattern)
    else:
        sliding = None  # Mistral: every layer
    return LlamaConfig(
        family=family,
        num_layers=layers,
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=rope or None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "gemma3"),
        max_position_embeddings=cfg.get("max_position_embeddings", 0),
        sliding_window=window,
        sliding_layers=sliding,
        partial_rotary_factor=partial,
        rope_local_theta=float(local_theta) if local_theta else None,
        **gemma,
    )


def _gemma_settings(family: str, cfg: dict) -> dict:
    """What sets Gemma (1, 2, 3) apart from Llama, as transformers runs it: GeLU (Gemma reads hidden_act, Gemma 2/3
    hidden_activation), RMSNorm by 1 + weight, embeddings times sqrt(hidden); Gemma 2/3 also normalize each
    block's output, scale queries by query_pre_attn_scalar ** -0.5 and soft-cap scores and logits."""
    act = cfg.get("hidden_act") if family == "gemma" else cfg.get("hidden_activation") or cfg.get("hidden_act")
    activations = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if act not in activations:
        raise ExportError(f"{family} with activation {act} is not supported ({', '.join(activations)})")
    if cfg.get("use_bidirectional_attention"):
        raise ExportError("use_bidirectional_attention is not supported (a causal decoder only)")
    out = dict(activation=activations[act], norm_offset=True, embed_scale=cfg["hidden_size"] ** 0.5)
    if family in ("gemma2", "gemma3"):
        scalar = cfg.get("query_pre_attn_scalar")
        out.update(sandwich_norms=True, query_scale=scalar ** -0.5 if scalar else None,
                   attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"))
    return out


def json_object(file: str, raw: bytes | None = None) -> dict:
    """The JSON object in `file` (or in `raw`, its bytes already read); anything else is an ExportError naming it."""
    try:
        if raw is None:
            with open(file, "rb") as f:
                raw = f.read()
        value = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise ExportError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ExportError(f"{file} is not a JSON object")
    return value


class HFSource(Source):
    config_name = "config.json"

    def __init__(self, path: str):
        self.path = path
        config = os.path.join(path, "config.json")
        self.raw_config = json_object(config)
        try:
            self.config = config_from_hf(self.raw_config)
        except KeyError as e:  # a field the model cannot be built without
            raise ExportError(f"{config} has no {e.args[0]}") from None
        self._index: dict[str, tuple[str, str, list[int], int, int]] = {}
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise ExportError(f"{path}: no *.safetensors files (pytorch .bin checkpoints are not supported)")
        for name in files:
            self._read_header(os.path.join(path, name))

    def _read_header(self, file: str) -> None:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            try:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            except (struct.error, ValueError) as e:
                raise ExportError(f"{file}: not a safetensors file ({e})") from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise ExportError(f"{file}: tensor {name} has dtype {info['dtype']}, not one of {list(_SAFETENSORS_DTYPES)}")
            start, end = info["data_offsets"]
            if 8 + n + end > size:  # a cut-off download: refuse now, not with a reshape error mid-export
                raise ExportError(f"{file} is truncated: tensor {name} needs bytes {8 + n + start}..{8 + n + end}, "
                                  f"the file has {size}")
            self._index[name] = (file, info["dtype"], info["shape"], 8 + n + start, end - start)

    def shape(self, hf_name: str) -> tuple[int, ...] | None:
        return tuple(self._index[hf_name][2]) if hf_name in self._index else None

    def tensor(self, hf_name: str) -> np.ndarray:
        if hf_name not in self._index:
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                return self.tensor("model.embed_tokens.weight")
            if is_phi3_part(hf_name, self.config):
                return phi3_part(hf_name, self.config, self.tensor)
            raise ExportError(f"{self.path}: tensor {hf_name} is missing from the safetensors files")
        file, dtype, shape, offset, length = self._index[hf_name]
        raw = np.fromfile(file, dtype=np.uint8, count=length, offset=offset)
        if dtype == "BF16":  # bfloat16 is the top half of a float32
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return raw.view(_SAFETENSORS_DTYPES[dtype]).astype(np.float32).reshape(shape)

    def tokenizer(self) -> TokenizerInfo:
        files = {}
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            p = os.path.join(self.path, name)
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    files[name] = f.read()
        tok_cfg, gen_cfg = (json_object(os.path.join(self.path, name), files.get(name, b"{}"))
                            for name in ("tokenizer_config.json", "generation_config.json"))
        if "tokenizer.json" in files and not isinstance(
                json_object(os.path.join(self.path, "tokenizer.json"), files["tokenizer.json"]).get("model"), dict):
            raise ExportError(f"{os.path.join(self.path, 'tokenizer.json')} is not a tokenizers file (no model)")
        files.pop("generation_config.json", None)
        eos = gen_cfg.get("eos_token_id", self.raw_config.get("eos_token_id"))
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else eos)
        bos = gen_cfg.get("bos_token_id", self.raw_config.get("bos_token_id"))
        ids = isinstance(eos_ids, list) and all(type(t) is int for t in eos_ids)
        if not (ids and (bos is None or type(bos) is int)):
            raise ExportError(f"{self.path}: eos_token_id and bos_token_id must be token ids (integers), not "
                              f"{eos!r} and {bos!r}")
        template = tok_cfg.get("chat_template")
        chat_file = os.path.join(self.path, "chat_template.jinja")
        if template is None and os.path.isfile(chat_file):
            with open(chat_file) as f:
                template = f.read()
        return TokenizerInfo(bos_id=bos if tok_cfg.get("add_bos_token", True) else None,
                             eos_ids=eos_ids, chat_template=template, files=files)

    def vocab_tokens(self) -> list[str] | None:
        p = os.path.join(self.path, "tokenizer.json")
        if not os.path.isfile(p):
            return None
        tok = json_object(p)
        vocab = dict(tok.get("model", {}).get("vocab", {}))
        for added in tok.get("added_tokens", []):
            vocab[added["content"]] = added["id"]
        by_id = [""] * (max(vocab.values()) + 1 if vocab else 0)
        for token, i in vocab.items():
            by_id[i] = token
        return by_id


# -- GGUF file ----------------------------------------------------------------------------------------
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
               "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # phi3 (its ffn_up is gate_up_proj: GGUFSource)
}
# Gemma 2/3 normalize before and after each block: their ffn_norm is the norm before the MLP
_GGUF_SANDWICH_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block of raw [out, blocks, bytes], as float32 [out, blocks]."""
    return raw[:, :, at:at + 2].copy().view(np.float16)[:, :, 0].astype(np.float32)


def _nibbles(nib: np.ndarray, high: np.ndarray | None) -> np.ndarray:
    """A ggml block's 32 values from its 16 bytes of nibbles [out, blocks, 16] (element j the low nibble of byte
    j, j + 16 the high one) and, for 5 bits, its qh [out, blocks, 1] uint32 (bit j: element j's fifth bit)."""
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=2)
    if high is not None:
        q = q | (((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
    return q


class GGUFSource(Source):
    config_name = "the GGUF metadata"

    def __init__(self, path: str):
        try:
            import gguf
        except ImportError:
            raise ExportError("reading .gguf needs the gguf package: pip install 'specedge[export]'") from None
        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # the reader raises assorted errors on a bad file
            raise ExportError(f"{path}: not a readable GGUF file ({e})") from None
        self._gguf = gguf
        self.arch = self._field("general.architecture")
        if self.arch not in _GGUF_ARCHS:
            raise ExportError(f"GGUF architecture '{self.arch}' is not supported; supported: {', '.join(_GGUF_ARCHS)}")
        a = self.arch
        self._tensors = {}
        for t in self.reader.tensors:
            name = self._hf_name(t.name, sandwich=a in ("gemma2", "gemma3"))
            if a == "phi3" and name.endswith(".mlp.up_proj.weight"):  # Phi-3's ffn_up holds gate, then up
                name = name.replace(".up_proj.", ".gate_up_proj.")
            self._tensors[name] = t
        heads = self._field(f"{a}.attention.head_count")
        hidden = self._field(f"{a}.embedding_length")
        scaling = self._field(f"{a}.rope.scaling.type", None)
        # llama.cpp's converter stores Llama 3.1+'s rope scaling ("llama3") as a tensor of per-frequency divisors
        freqs = self._tensors.pop("rope_freqs.weight", None)
        if scaling not in (None, "none", "linear", "yarn") or (freqs is not None and scaling in ("linear", "yarn")):
            both = " with rope_freqs" if freqs is not None else ""
            raise ExportError(f"{path}: GGUF rope scaling '{scaling}'{both} is not supported (none, linear, yarn, "
                              f"or rope_freqs alone)")
        rope = None
        if scaling == "linear":
            rope = {"rope_type": "linear", "factor": self._field(f"{a}.rope.scaling.factor")}
        elif scaling == "yarn":
            rope = self._yarn_scaling()
        if freqs is not None:
            rope = {"rope_type": "freq_factors", "factors": self._factors(freqs)}
        longrope = [self._tensors.pop(f"rope_factors_{kind}.weight", None) for kind in ("short", "long")]
        if all(f is not None for f in longrope):  # llama.cpp's converter stores Phi-3's LongRoPE so
            rope = {"rope_type": "longrope", "short_factor": self._factors(longrope[0]),
                    "long_factor": self._factors(longrope[1]),
                    "original_max_position_embeddings": int(self._field(f"{a}.rope.scaling.original_context_length")),
                    "attention_factor": float(self._field(f"{a}.rope.scaling.attn_factor", 1.0))}
        window = self._field(f"{a}.attention.sliding_window", None) or None  # phi3 writes 0 for none
        if window is not None and a in ("qwen2", "qwen3"):  # which of a Qwen's layers slide is not in the file
            raise ExportError(f"{path}: GGUF {a}.attention.sliding_window is not supported for {a} (llama and "
                              f"phi3, where every layer slides, and Gemma 2/3)")
        head_dim = self._field(f"{a}.attention.key_length", None) or hidden // heads
        layers = self._field(f"{a}.block_count")
        gemma = self._gemma_settings(layers, hidden, heads, head_dim) if a.startswith("gemma") else {}
        if a == "gemma2":
            window = window or 4096  # llama.cpp's default for a Gemma 2 file without the key
        rotary = self._field(f"{a}.rope.dimension_count", None) if a == "phi3" else None
        vocab = self._field(f"{a}.vocab_size", None) or len(self._field_raw("tokenizer.ggml.tokens").data)
        self.config = LlamaConfig(
            family=a,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=self._field(f"{a}.attention.head_count_kv", heads),
            head_dim=head_dim,
            intermediate_size=self._field(f"{a}.feed_forward_length"),
            vocab_size=vocab,
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope,
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            attention_bias="model.layers.0.self_attn.q_proj.bias" in self._tensors,
            qk_norm=a in ("qwen3", "gemma3"),
            max_position_embeddings=self._field(f"{a}.context_length", 0),
            sliding_window=None if window is None else int(window),
            partial_rotary_factor=1.0 if not rotary else int(rotary) / head_dim,
            **gemma,
        )
        self._check_types()

    def _gemma_settings(self, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        """A Gemma GGUF as llama.cpp runs it (llama-model.cpp's hparams, src/models/gemma*.cpp), where the file
        leaves things out: GeLU in its tanh form, embeddings times sqrt(hidden); norm weights already stored as
        1 + w by the converter (used as they are, no fold). Gemma 2/3: norms after each block; queries scaled by
        1/sqrt(head_dim), by 1/sqrt(hidden / heads) in the 27B models (46 and 62 layers); every layer but each
        2nd (Gemma 2) or 6th (Gemma 3) slides. Gemma 2's caps default to 50 (scores) and 30 (logits); Gemma 3
        caps no scores, caps logits only if the file says so, and turns its sliding layers with base 10000."""
        a = self.arch
        out = dict(activation="gelu_tanh", embed_scale=hidden ** 0.5)
        if a == "gemma":
            return out
        big = layers == (46 if a == "gemma2" else 62)
        pattern = 2 if a == "gemma2" else 6
        final_cap = self._field(f"{a}.final_logit_softcapping", 30.0 if a == "gemma2" else None)
        out.update(sandwich_norms=True, query_scale=(hidden // heads if big else head_dim) ** -0.5,
                   sliding_layers=tuple(i for i in range(layers) if i % pattern < pattern - 1),
                   final_softcap=None if final_cap is None else float(final_cap))
        if a == "gemma2":
            out["attn_softcap"] = float(self._field(f"{a}.attn_logit_softcapping", 50.0))
        else:
            out["rope_local_theta"] = 10000.0
        return out

    def _factors(self, t) -> list[float]:
        return [float(f) for f in np.asarray(self._gguf.quants.dequantize(t.data, t.tensor_type), np.float32).ravel()]

    def _yarn_scaling(self) -> dict:
        """A GGUF's YaRN keys as the transformers rope_scaling they were converted from (llama.cpp's
        convert_hf_to_gguf.py writes factor, original_max_position_embeddings, and beta_fast, beta_slow and
        attention_factor when the config has them). Keys with no transformers counterpart are refused unless
        they hold the value that changes nothing."""
        a = f"{self.arch}.rope.scaling"
        unsupported = {"yarn_ext_factor": 1.0, "yarn_log_multiplier": 0.0, "attn_factor": 1.0}
        for key, neutral in unsupported.items():
            value = self._field(f"{a}.{key}", neutral)
            if float(value) != neutral:
                raise ExportError(f"{self.path}: GGUF YaRN rope scaling with {a}.{key} = {value} is not supported "
                                  f"(only {neutral}, what transformers' YaRN computes)")
        rope = {"rope_type": "yarn", "factor": float(self._field(f"{a}.factor")),
                "original_max_position_embeddings": int(self._field(f"{a}.original_context_length"))}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            value = self._field(f"{a}.{key}", None)
            if value is not None:
                rope[name] = float(value)
        return rope

    def _field_raw(self, key):
        return self.reader.fields.get(key)

    def _field(self, key, default=...):
        f = self.reader.fields.get(key)
        if f is None:
            if default is ...:
                raise ExportError(f"{self.path}: GGUF metadata {key} is missing")
            return default
        return f.contents()

    @staticmethod
    def _hf_name(name: str, sandwich: bool = False) -> str:
        if name == "token_embd.weight":
            return "model.embed_tokens.weight"
        if name == "output_norm.weight":
            return "model.norm.weight"
        if name == "output.weight":
            return "lm_head.weight"
        if name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            if sandwich and rest in _GGUF_SANDWICH_NAMES:
                return f"model.layers.{i}.{_GGUF_SANDWICH_NAMES[rest]}"
            if rest in _GGUF_LAYER_NAMES:
                return f"model.layers.{i}.{_GGUF_LAYER_NAMES[rest]}"
        return name

    def _readable_types(self) -> set:
        g = self._gguf
        return {g.GGMLQuantizationType.F32, g.GGMLQuantizationType.F16, *g.quants._type_traits}

    def _check_types(self) -> None:
        """Refuse before writing anything if a tensor has a type `gguf` cannot dequantize."""
        readable = self._readable_types()
        for t in self._tensors.values():
            if t.tensor_type not in readable:
                names = ", ".join(sorted(q.name for q in readable))
                raise ExportError(f"{self.path}: tensor {t.name} has GGML type {t.tensor_type.name}, which cannot "
                                  f"be dequantized (readable: {names})")

    def shape(self, hf_name: str) -> tuple[int, ...] | None:
        t = self._tensors.get(hf_name)
        return None if t is None else tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions inner first

    def _gguf_tensor(self, hf_name: str):
        if hf_name not in self._tensors:
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                return self._gguf_tensor("model.embed_tokens.weight")
            raise ExportError(f"{self.path}: tensor {hf_name} is missing from the GGUF file")
        return self._tensors[hf_name]

    def _unpermute(self, hf_name: str, rows: np.ndarray) -> np.ndarray:
        """llama.cpp's converter interleaves the rotary halves of q/k rows; undo it for rotate_half RoPE."""
        if self.arch in ("llama", "mistral") and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = self.config.num_heads if ".q_proj." in hf_name else self.config.num_kv_heads
            return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
        return rows

    def tensor(self, hf_name: str) -> np.ndarray:
        if is_phi3_part(hf_name, self.config):
            return phi3_part(hf_name, self.config, self.tensor)
        t = self._gguf_tensor(hf_name)
        w = self._gguf.quants.dequantize(t.data, t.tensor_type)
        return self._unpermute(hf_name, np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)]))

    def blocks(self, hf_name: str) -> Blocks | None:
        """The GGUF types whose blocks are the ONNX layout's, blocks of 32 along the input dimension, ints and
        scales copied bit for bit (ggml's block structs; nibble j of a block is the low nibble of byte j, j + 16
        the high one; a 5-bit value's fifth bit is bit j of the block's 32-bit qh):
        * symmetric: Q8_0 (f16 d, 32 int8), Q4_0 (f16 d, nibbles, value d * (nibble - 8)), Q5_0 (f16 d, qh,
          nibbles, value d * (q5 - 16), into int8);
        * offset (value d * q + m, stored as ints q - c, scale d, offset m + c * d with c = 8 or 16): Q4_1 and
          Q5_1 (f16 d, f16 m, then as Q4_0 / Q5_0), and the K-quants Q4_K and Q5_K, whose super-blocks of 256
          hold 8 blocks of 32 (see _k_quant_blocks).
        The offsets take one float32 rounding at most. 5-bit ints are int8 weights. A Phi-3 part is its rows of
        the fused tensor: blocks run along the input, so the part's columns of the fused blocks are its blocks."""
        if is_phi3_part(hf_name, self.config):
            fused, (first, end) = phi3_rows(hf_name, self.config)
            b = self.blocks(fused)
            if b is None:
                return None
            part = (lambda a: None if a is None else np.ascontiguousarray(a[:, first:end]))  # [in or in/32, out]
            return Blocks(part(b.q), part(b.scale), b.bits, b.block, part(b.offset))
        t = self._gguf_tensor(hf_name)
        kind = t.tensor_type.name
        if kind not in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K") or len(t.shape) != 2:
            return None
        n_in, n_out = int(t.shape[0]), int(t.shape[1])
        data = np.ascontiguousarray(t.data, dtype=np.uint8)
        if kind.endswith("_K"):
            q, scale, offset = self._k_quant_blocks(data, n_in, n_out, five=kind == "Q5_K")
        else:
            raw = data.reshape(n_out, n_in // 32, -1)  # [out, blocks, bytes]
            scale = _f16(raw, 0)  # [out, in/32]
            offset = None
            if kind == "Q8_0":
                q = raw[:, :, 2:].copy().view(np.int8)  # [out, in/32, 32]
            else:
                at = 4 if kind.endswith("_1") else 2  # the nibbles (Q4) or qh (Q5) follow d and m
                five = kind.startswith("Q5")
                high = raw[:, :, at:at + 4].copy().view("<u4") if five else None  # [out, in/32, 1]
                centre = 16 if five else 8
                q = _nibbles(raw[:, :, at + 4 if five else at:], high).astype(np.int16) - centre
                q = q.astype(np.int8)
                if kind.endswith("_1"):
                    offset = _f16(raw, 2) + centre * scale
        bits = 4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8
        q = self._unpermute(hf_name, q.reshape(n_out, n_in))
        scale = self._unpermute(hf_name, scale.reshape(n_out, n_in // 32))
        offset = None if offset is None else np.ascontiguousarray(
            self._unpermute(hf_name, offset.reshape(n_out, n_in // 32)).T)
        return Blocks(np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T), bits, 32, offset)

    @staticmethod
    def _k_quant_blocks(data: np.ndarray, n_in: int, n_out: int, five: bool
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q4_K / Q5_K super-blocks of 256 (ggml's block_q4_K: f16 d and dmin, 12 bytes of 6-bit scales sc and
        minima mn for the 8 blocks of 32, Q5_K then 32 bytes qh, and 128 bytes of nibbles, chunk c of 32 bytes
        holding block 2c in its low nibbles and 2c + 1 in its high ones; Q5_K's fifth bit of element l of block j
        is bit j of qh[l]). Value d * sc * q - dmin * mn: -> ints q - c, scale d * sc (exact: an f16 times a
        6-bit integer), offset c * scale - dmin * mn, each [out, in/32] (c = 8, or 16 for 5-bit)."""
        nb = n_in // 256
        raw = data.reshape(n_out, nb, -1)
        d, dmin = _f16(raw, 0)[:, :, None], _f16(raw, 2)[:, :, None]
        s = raw[:, :, 4:16]
        # block j < 4: 6 low bits of bytes j (scale) and j + 4 (minimum); j >= 4: the nibbles of byte j + 4 below
        # the top 2 bits of bytes j - 4 (scale) and j (minimum)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=2)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=2)
        scale = d * sc.astype(np.float32)  # [out, in/256, 8]
        nib = raw[:, :, 48 if five else 16:].reshape(n_out, nb, 4, 32)
        q = np.stack([nib & 0x0F, nib >> 4], axis=3).reshape(n_out, nb, 8, 32)  # [out, in/256, block, element]
        centre = 8
        if five:
            qh = raw[:, :, 16:48]  # [out, in/256, 32]: bit j of byte l is element l of block j
            q = q | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
            centre = 16
        offset = centre * scale - dmin * mn.astype(np.float32)
        return (q.astype(np.int16) - centre).astype(np.int8), scale, offset

    def tokenizer(self) -> TokenizerInfo:
        # llama.cpp ends a generation at end-of-sequence, end-of-turn and end-of-message alike (Llama 3 instruct
        # models close a turn with <|eot_id|>, not their EOS)
        ends = [self._field(f"tokenizer.ggml.{kind}_token_id", None) for kind in ("eos", "eot", "eom")]
        bos = self._field("tokenizer.ggml.bos_token_id", None)
        add_bos = self._field("tokenizer.ggml.add_bos_token", True)
        template = self._field("tokenizer.chat_template", None)
        files = {"tokenizer.json": self._tokenizer_json()}
        eos_ids = list(dict.fromkeys(int(e) for e in ends if e is not None))
        return TokenizerInfo(bos_id=bos if add_bos else None, eos_ids=eos_ids, chat_template=template, files=files)

    def _tokenizer_json(self) -> bytes:
        """A tokenizer.json built from the GGUF's tokenizer metadata by transformers' own GGUF converter.

        transformers' public path (AutoTokenizer with gguf_file) imports torch to read the file; we read the
        metadata with `gguf` and call the converter directly, so exporting needs no torch."""
        try:
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                               convert_gguf_tokenizer)
        except ImportError:
            return self._tokenizer_json_via_auto()
        tokenizer_dict = {}
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
            value = self._field(f"tokenizer.{key}", None)
            if value is not None:
                tokenizer_dict[name] = value
        try:
            backend, _ = convert_gguf_tokenizer(self.arch, tokenizer_dict)
        except Exception as e:  # an unknown tokenizer type: name it
            raise ExportError(f"{self.path}: cannot build a tokenizer from its GGUF metadata "
                              f"({tokenizer_dict.get('tokenizer_type')}): {e}") from None
        return backend.to_str().encode()

    def _tokenizer_json_via_auto(self) -> bytes:
        """Older transformers: AutoTokenizer reads the GGUF (and needs torch for it)."""
        import logging
        import tempfile

        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ExportError("building a tokenizer from GGUF needs transformers: pip install 'specedge[export]'") from None
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(self.path)),
                                                gguf_file=os.path.basename(self.path))
        except ImportError as e:
            raise ExportError(f"this transformers reads GGUF tokenizers through torch: pip install torch ({e})") from None
        with tempfile.TemporaryDirectory() as d:
            tok.save_pretrained(d)
            with open(os.path.join(d, "tokenizer.json"), "rb") as f:
                return f.read()

    def vocab_tokens(self) -> list[str] | None:
        f = self._field_raw("tokenizer.ggml.tokens")
        return None if f is None else list(f.contents())
