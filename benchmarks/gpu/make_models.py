"""Models for the GPU check, made where it runs (a GPU machine may reach no model hub): a tiny Llama target
with a near-copy draft, and a random Llama with SmolLM2-135M's dimensions (speed, not quality).

  python benchmarks/gpu/make_models.py OUT   # writes OUT/target, OUT/draft, OUT/smol (HF directories)
"""
import os
import sys

import torch
import transformers as tf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from models import make_hf_model, make_near_copy, write_word_tokenizer  # noqa: E402

out = sys.argv[1]
tiny = make_hf_model(f"{out}/target", "llama", vocab=1000, layers=3, hidden=64, heads=4, kv_heads=2, seed=0,
                     logit_scale=4.0)
make_near_copy(tiny, f"{out}/draft", noise=0.05)
config = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                        rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000, bos_token_id=None,
                        eos_token_id=1, pad_token_id=0)
torch.manual_seed(0)
tf.LlamaForCausalLM(config).eval().save_pretrained(f"{out}/smol")
write_word_tokenizer(f"{out}/smol", 49152)
