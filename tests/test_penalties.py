"""Logit bias and repetition, presence and frequency penalties (runtime/penalties.py): they follow their
definitions (transformers' own processors for the bias and the repetition penalty), plain decode with them equals
transformers, speculation with them equals plain decode with them for every proposer and gamma (drafts proposed,
accepted and rejected), in batches too, and bad values are one clear error."""
import collections
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_generate import echo_prompt, prompt_of

from specedge.errors import GenerationError
from specedge.runtime.penalties import Penalties, PenaltyState

NEW = 40
V = 50


def reference_row(row, prompt, output, prefix, rep, presence, frequency, bias=None):
    """One row, straight from the definitions: transformers' SequenceBiasLogitsProcessor (one-token sequences),
    its RepetitionPenaltyLogitsProcessor over prompt + output + prefix, then OpenAI's presence/frequency over
    output + prefix, one token at a time."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    row = row.copy()
    if bias:
        seen = torch.tensor([list(prompt) + list(output) + list(prefix)])
        processor = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
        row = processor(seen, torch.from_numpy(row[None]))[0].numpy()
    if rep != 1:
        seen = torch.tensor([list(prompt) + list(output) + list(prefix)])
        row = RepetitionPenaltyLogitsProcessor(rep)(seen, torch.from_numpy(row[None]))[0].numpy()
    generated = list(output) + list(prefix)
    for token in set(generated):
        row[token] = np.float32(row[token] - np.float32(generated.count(token) * frequency + presence))
    return row


# a bias on a token the prefixes hold (3, 7), on one they do not (20), and -100 on another (41)
BIAS = {3: 1.5, 7: -2.0, 20: 4.0, 41: -100.0}


@pytest.mark.parametrize("rep,presence,frequency,bias", [
    (1.3, 0, 0, None), (0.7, 0, 0, None), (1, 0.8, 0, None), (1, 0, -0.6, None), (1.2, -1.5, 0.4, None),
    (1, 0, 0, None), (1, 0, 0, BIAS), (1.3, 0.5, 0.4, BIAS)])
def test_rows_are_penalized_with_their_own_prefix_as_defined(rep, presence, frequency, bias):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, V, 12).tolist()
    output = rng.integers(0, V, 9).tolist() + [3, 3, 3]
    state = PenaltyState(Penalties(rep, presence, frequency, bias or {}), V, prompt)
    state.commit(output[:5])
    state.commit(output[5:])
    drafts = [3, 7, 7, 49, 0]
    prefixes = [drafts[:j] for j in range(len(drafts) + 1)]
    logits = rng.normal(0, 3, (len(prefixes), V + 6)).astype(np.float32)  # a head wider than the vocabulary
    want = np.stack([np.concatenate([reference_row(logits[r, :V], prompt, output, p, rep, presence, frequency, bias),
                                     logits[r, V:]]) for r, p in enumerate(prefixes)])
    readonly = logits.copy()
    readonly.flags.writeable = False
    got = state.apply(readonly, prefixes)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.array_equal(readonly, logits)  # a read-only array is copied, not written
    if (rep, presence, frequency, bias) != (1, 0, 0, None):
        assert not np.allclose(got, logits)


def hf_greedy_penalized(model, prompt, repetition_penalty, n=NEW):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                             repetition_penalty=repetition_penalty)
    return out[0, len(prompt):].tolist()


def test_plain_decode_with_a_repetition_penalty_equals_transformers(gen, tiny_models):
    model = tiny_models["llama"][1]
    changed = 0
    for seed in range(3):
        prompt = echo_prompt(model, seed)
        for rep in (1.3, 2.0):
            want = hf_greedy_penalized(model, prompt, rep)
            assert gen.generate(prompt, NEW, proposer="none", stop_ids=[], repetition_penalty=rep).tokens == want
            changed += want != gen.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    assert changed >= 4  # the penalty changed what plain decode writes


# Strong repetition penalties leave prompt lookup nothing to get accepted on these tiny random models (1.3: 0
# of 90 drafts), so the repetition case is mild.
PENALTIES = [dict(repetition_penalty=1.05), dict(presence_penalty=0.8, frequency_penalty=0.5),
             dict(repetition_penalty=1.1, presence_penalty=-0.5, frequency_penalty=1.0)]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_greedy_speculation_with_penalties_equals_plain_decode_with_them(gen, pair_gen, tiny_models, penalties):
    """Row j of a verify step must be penalized with drafts 0..j-1 as if committed: a row penalized with the
    committed text alone would let a draft repeat itself where plain decode would not."""
    model = tiny_models["llama"][1]
    prompts = [echo_prompt(model, s) for s in (1, 2, 3)] + [prompt_of(21, 5)]
    plain = [gen.generate(p, NEW, proposer="none", stop_ids=[], **penalties).tokens for p in prompts]
    assert plain != [gen.generate(p, NEW, proposer="none", stop_ids=[]).tokens for p in prompts]
    for g, proposer in ((gen, "ngram"), (gen, "draft"), (pair_gen, "draft")):
        proposed = accepted = 0
        for gamma in (1, 4, 8):
            for p, want in zip(prompts, plain):
                out = g.generate(p, NEW, proposer=proposer, gamma=gamma, stop_ids=[], adaptive=False, **penalties)
                assert out.tokens == want, (proposer, gamma)
                proposed += out.stats.proposed
                accepted += out.stats.accepted
        assert 0 < accepted < proposed, (g is pair_gen, proposer)


def test_sampling_rows_are_penalized_too(gen, pair_gen, tiny_models):
    """top_k=1 makes the sampled law a point mass on the penalized argmax: the acceptance rule (min(1, p/q),
    residual resampling) must then commit exactly plain greedy decode's penalized tokens, whatever the drafts'
    unpenalized q."""
    model = tiny_models["llama"][1]
    penalties = dict(repetition_penalty=1.5, frequency_penalty=0.5)
    prompt = echo_prompt(model, 4)
    want = gen.generate(prompt, NEW, proposer="none", stop_ids=[], **penalties).tokens
    proposed = accepted = 0
    for g, proposer in ((gen, "ngram"), (gen, "draft"), (pair_gen, "draft")):
        for seed in range(3):
            out = g.generate(prompt, NEW, proposer=proposer, gamma=4, stop_ids=[], adaptive=False, temperature=1.0,
                             top_k=1, seed=seed, **penalties)
            assert out.tokens == want, (proposer, seed)
            proposed += out.stats.proposed
            accepted += out.stats.accepted
    assert 0 < accepted < proposed


@pytest.mark.parametrize("kwargs, expected", [
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": -1.2}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": "1.2"}, "repetition_penalty must be a finite number > 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": True}, "frequency_penalty must be a number in [-2, 2]"),
    ({"logit_bias": {10**6: 1.0}}, "logit_bias token 1000000 is outside the vocabulary"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {5: 100.5}}, "logit_bias values must be numbers in [-100, 100]"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias values must be numbers in [-100, 100]"),
    ({"logit_bias": [(5, 1.0)]}, "logit_bias must be a mapping"),
])
def test_bad_penalties_are_one_clear_error(gen, kwargs, expected):
    with pytest.raises(GenerationError) as raised:
        gen.generate([5, 6, 7], 4, proposer="ngram", **kwargs)
    assert expected in str(raised.value)


def test_drafts_are_penalized_like_the_target(pair_gen, tiny_models):
    """A draft model close to the target, penalized with its own drafts as the target's rows are, keeps the
    acceptance it has without penalties (unpenalized drafts, 30 tokens: 0.21 against 0.59 at repetition 1.3)."""
    model = tiny_models["llama"][1]
    prompts = [echo_prompt(model, s) for s in (1, 2, 3)] + [prompt_of(21, 5)]

    def acceptance(**penalties):
        proposed = accepted = 0
        for p in prompts:
            out = pair_gen.generate(p, NEW, proposer="draft", gamma=4, stop_ids=[], adaptive=False, **penalties)
            proposed += out.stats.proposed
            accepted += out.stats.accepted
        return accepted / proposed

    free = acceptance()
    for penalties in (dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.5)):
        assert acceptance(**penalties) > 0.8 * free, penalties


def hf_greedy_biased(model, prompt, bias, n=NEW):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                             sequence_bias={(t,): b for t, b in bias.items()})
    return out[0, len(prompt):].tolist()


def bias_against(outputs: list[list[int]]) -> dict[int, float]:
    """-100 on the token plain decode writes most often, -1 on the next: a bias that changes the output without
    making it one token over and over (a positive bias of 0.5 did that on these tiny models; the row test above
    covers positive values)."""
    (first, _), (second, _) = collections.Counter(t for out in outputs for t in out).most_common(2)
    return {first: -100.0, second: -1.0}


def test_plain_decode_and_speculation_with_a_logit_bias_equal_transformers(gen, pair_gen, tiny_models):
    """transformers' sequence_bias with one-token sequences is OpenAI's logit_bias. Every verify row gets the
    same bias, so speculation equals plain decode with it for every proposer and gamma."""
    model = tiny_models["llama"][1]
    prompts = [echo_prompt(model, s) for s in (1, 2, 3)] + [prompt_of(21, 5)]
    free = [gen.generate(p, NEW, proposer="none", stop_ids=[]).tokens for p in prompts]
    bias = bias_against(free)
    plain = [gen.generate(p, NEW, proposer="none", stop_ids=[], logit_bias=bias).tokens for p in prompts]
    assert plain == [hf_greedy_biased(model, p, bias) for p in prompts]
    assert plain != free and min(bias, key=bias.get) not in sum(plain, [])
    assert all(len(set(out)) > 5 for out in plain), plain
    for g, proposer in ((gen, "ngram"), (gen, "draft"), (pair_gen, "draft")):
        proposed = accepted = 0
        for gamma in (1, 4, 8):
            for p, want in zip(prompts, plain):
                out = g.generate(p, NEW, proposer=proposer, gamma=gamma, stop_ids=[], adaptive=False, logit_bias=bias)
                assert out.tokens == want, (proposer, gamma)
                proposed += out.stats.proposed
                accepted += out.stats.accepted
        assert 0 < accepted < proposed, (g is pair_gen, proposer)


def test_generate_cli_takes_a_logit_bias(gen, tiny_bundle):
    prompt = prompt_of(20, 3)
    free = gen.generate(prompt, 8, proposer="none", min_new_tokens=8).tokens
    bias = {free[0]: -100.0, free[1]: 2.5}
    r = subprocess.run([sys.executable, "-m", "specedge", "generate", tiny_bundle, "--prompt-ids",
                        ",".join(map(str, prompt)), "--max-new-tokens", "8", "--min-new-tokens", "8", "--json",
                        "--proposer", "ngram", "--logit-bias", f"{free[0]}=-100,{free[1]}=2.5"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    want = gen.generate(prompt, 8, proposer="none", min_new_tokens=8, logit_bias=bias).tokens
    assert json.loads(r.stdout)["tokens"] == want and want != free
