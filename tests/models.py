"""Tiny random-init HF models of each supported family, built from configs (no downloads), and the helpers
that drive a bundle's graphs through the contract by hand. The transformers models are the oracle."""
from __future__ import annotations

import json
import os

import numpy as np

from specedge.graphs import contract as C

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def write_word_tokenizer(path: str, vocab_size: int) -> None:
    """A whitespace word-level tokenizer "t0".."t{V-1}" so tiny models have text I/O and a comparable vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False, "eos_token": "t1",
                   "chat_template": "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}"
                                    "{% if add_generation_prompt %}t4 {% endif %}"}, f)


def make_hf_model(path: str, family: str = "llama", *, vocab: int = 1000, layers: int = 3, hidden: int = 64,
                  heads: int = 4, kv_heads: int = 2, seed: int = 0, tie: bool = False, rope_scaling=None,
                  logit_scale: float = 1.0, sliding_window: int | None = None, max_window_layers: int | None = None,
                  **config):
    """Build, randomize (norms and biases too, so mistakes show) and save a tiny model; return it."""
    import torch
    import transformers as tf

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "phi3": ("Phi3Config", "Phi3ForCausalLM"), "gemma": ("GemmaConfig", "GemmaForCausalLM"),
               "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
    config_cls, model_cls = (getattr(tf, n) for n in classes[family])
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    if family == "qwen3" or family.startswith("gemma"):
        kwargs["head_dim"] = hidden // heads
    if family in ("mistral", "phi3", "gemma2", "gemma3"):
        kwargs["sliding_window"] = sliding_window
    elif sliding_window is not None:  # Qwen2/3: the layers from max_window_layers on slide
        kwargs.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=max_window_layers)
    if rope_scaling:
        kwargs["rope_scaling"] = rope_scaling
    kwargs.update(config)  # any other config field (Phi-3: partial_rotary_factor, original_max_position_embeddings)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                low = -0.5 if family.startswith("gemma") else 0.5  # Gemma's norms scale by 1 + weight
                p.uniform_(low, low + 1)
            elif "bias" in name:
                p.normal_(0, 0.1)
        if logit_scale != 1.0:  # sharper distributions make sampling tests discriminating
            model.get_output_embeddings().weight.mul_(logit_scale)
    model.save_pretrained(path)
    write_word_tokenizer(path, vocab)
    return model


def make_near_copy(model, path: str, noise: float, seed: int = 0):
    """Save a copy of `model` with every weight perturbed by `noise` x its own spread: a draft that agrees
    with the target often but not always, so speculative tests see accepted drafts, rejected drafts and
    fully accepted rounds (a draft initialized at random is almost never accepted)."""
    import copy

    import torch

    near = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * (p.std() if p.numel() > 1 else p.abs()))
    near.save_pretrained(path)
    write_word_tokenizer(path, model.config.vocab_size)
    return near


class ContractDriver:
    """Runs a bundle's graphs by hand through the contract (onnxruntime's Python API): the host side of the
    contract, written independently of specedge.runtime so the tests check the graphs, not the runtime."""

    def __init__(self, bundle: str, model: str = "target", poison: float | None = None, seed: int = 0,
                 session_config: dict[str, str] | None = None):
        import onnxruntime as ort

        from specedge.graphs.manifest import load_manifest

        self.manifest = load_manifest(bundle)
        self.entry = self.manifest.models[model]
        self.dims = self.entry.dims
        so = ort.SessionOptions()
        so.log_severity_level = 3
        for key, value in (session_config or {}).items():
            so.add_session_config_entry(key, value)
        self.sessions = {(g.role, g.tokens): ort.InferenceSession(os.path.join(bundle, g.file), so,
                                                                  providers=["CPUExecutionProvider"])
                         for g in self.entry.graphs if g.context == self.dims.context}
        rng = np.random.default_rng(seed)
        shape = (self.dims.num_layers,) + self.dims.cache_shape
        fill = (lambda: rng.uniform(-poison, poison, shape)) if poison else (lambda: np.zeros(shape))
        self.keys = fill().astype(self.dims.dtype)
        self.values = fill().astype(self.dims.dtype)
        self.length = 0

    def step(self, tokens, role: str, T: int, positions=None):
        """Run n <= T tokens (padded) at the next slots; return (logits [n, V] or None, new K, new V)."""
        n = len(tokens)
        ids = np.zeros((1, T), np.int64)
        ids[0, :n] = tokens
        pos = np.arange(self.length, self.length + T)[None] if positions is None else np.asarray(positions)[None]
        feeds = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.CACHE_LEN: np.array([self.length], np.int64)}
        for i in range(self.dims.num_layers):
            feeds[C.past_key(i)], feeds[C.past_value(i)] = self.keys[i], self.values[i]
        session = self.sessions[(role, T)]
        out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        new_k = np.stack([out[C.new_key(i)] for i in range(self.dims.num_layers)])
        new_v = np.stack([out[C.new_value(i)] for i in range(self.dims.num_layers)])
        self.keys[:, :, :, self.length:self.length + n] = new_k[:, :, :, :n]
        self.values[:, :, :, self.length:self.length + n] = new_v[:, :, :, :n]
        self.length += n
        logits = out[C.LOGITS][0, :n] if C.LOGITS in out else None
        return logits, new_k[:, 0, :, :n], new_v[:, 0, :, :n]


# Tiny Gemma configurations that exercise what each generation adds (tests/test_graph_parity.py, tests/test_qnn.py).
GEMMA_CASES = [
    ("gemma", {}),  # GeLU (tanh form), RMSNorm by 1 + weight, embeddings times sqrt(hidden)
    ("gemma", {"hidden_act": "gelu"}),  # exact GeLU
    # norms after each block, query_pre_attn_scalar, soft-capped scores (a cap low enough to bend them) and
    # logits, sliding and full layers alternating
    ("gemma2", {"query_pre_attn_scalar": 24, "attn_logit_softcapping": 0.05, "final_logit_softcapping": 3.0,
                "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # q/k norms, the sliding layers' own RoPE base, the full layers' linear scaling (Gemma 3 4B's)
    ("gemma3", {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}),
]
