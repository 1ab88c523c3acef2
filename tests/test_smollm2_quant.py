"""SmolLM2-135M as int8 and int4 bundles on the whole prompt suite: speculative greedy output against the
bundle's own plain greedy output, for every proposer. Slow: runs in CI, skip locally with -m "not slow".

Known gap (issue 8, open): on these bundles speculative output is NOT yet always equal to plain output. The
verify step's attention sums the past and the step's own tokens in a different order than one-token decode
(float rows 1..k differ by ~3e-5 in float32 bundles), and onnxruntime's int8 activation quantization at
accuracy level 4 turns such last-bit differences into whole quantization steps (up to ~1 logit). Measured
on the suite, 48 tokens, runs ngram g=8, ngram g=4, layer draft g=4: 32 of 111 runs diverge for int8 and 40
of 111 for int4, each where plain decode's top-2 logits were within 0.46 of each other.

Until the attention is made position-consistent, this test guards what does hold: tokens agree up to the
first divergence, every divergence sits where plain decode's top-2 gap is within ACTIVATION_EPS (the int8
activation rounding error, about 1% of SmolLM2's logit scale of ~40), and the count is reported.
"""
import json
import os

import numpy as np
import pytest

from specedge.runtime.generator import Generator

pytestmark = pytest.mark.slow
NEW = 48
ACTIVATION_EPS = 1.0  # logits; measured divergence gaps reach 0.46
RUNS = (("ngram", 8), ("ngram", 4), ("draft", 4))


def suite_prompts(gen):
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "prompts", "suite.jsonl")
    return {p["id"]: gen.tokenizer.apply_chat_template(p["messages"]) for p in map(json.loads, open(path))}


def next_logits(gen, sequence):
    """The bundle's logits after `sequence` (prefill all but the last token, then one decode step)."""
    gen.target.reset()
    gen.target.prefill(sequence[:-1])
    return np.array(gen.target.run(sequence[-1:])[0])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_speculative_equals_plain_on_the_suite(smollm2_quant_bundles, mode):
    gen = Generator.load(smollm2_quant_bundles[mode], threads=2)
    try:
        prompts = suite_prompts(gen)
        assert len(prompts) >= 30
        ties, proposed, accepted = [], 0, 0
        for name, ids in prompts.items():
            plain = gen.generate(ids, NEW, proposer="none", stop_ids=[]).tokens
            for proposer, gamma in RUNS:
                res = gen.generate(ids, NEW, proposer=proposer, gamma=gamma, stop_ids=[])
                proposed += res.stats.proposed
                accepted += res.stats.accepted
                if res.tokens == plain:
                    continue
                i = next(k for k, (a, b) in enumerate(zip(res.tokens, plain)) if a != b)
                top2 = np.sort(next_logits(gen, ids + plain[:i]))[-2:]
                gap = float(top2[1] - top2[0])
                assert gap < ACTIVATION_EPS, f"{mode} {name} {proposer} g={gamma}: diverged at {i}, top-2 gap {gap:.3f}"
                ties.append((name, proposer, gamma, i, gap))
        gaps = sorted(t[-1] for t in ties)
        print(f"\n{mode}: {len(prompts)} prompts x {len(RUNS)} speculative runs, {len(ties)} divergences, "
              f"top-2 gaps {[round(g, 4) for g in gaps]}, {accepted}/{proposed} drafts accepted")
        assert len(ties) < len(prompts) * len(RUNS) // 2  # a regression guard, not the goal (zero: see above)
        assert 0 < accepted < proposed  # drafts were proposed, accepted and rejected
    finally:
        gen.close()


def test_quantized_bundle_passes_check(smollm2_quant_bundles):
    from specedge.tools.check import check_bundle

    for mode, bundle in smollm2_quant_bundles.items():
        report = check_bundle(bundle, load=False)
        assert report.ok, report.render()
