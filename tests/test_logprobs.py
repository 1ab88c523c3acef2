"""Logprobs of the committed tokens (runtime/logprobs.py): the raw rows' log-softmax as transformers computes it,
the same under every proposer, gamma, tree and batch row as under plain decode (the rows are bit for bit the
same), for sampled and penalized runs too, and bad requests are one clear error."""
import numpy as np
import pytest
import torch
from conftest import CHUNK
from test_generate import echo_prompt, prompt_of

from specedge.errors import GenerationError
from specedge.runtime.generator import Generator
from specedge.runtime.logprobs import token_logprobs

NEW = 30
TOP = 5


def test_token_logprobs_are_log_softmax_with_ties_by_id():
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 4, (6, 40)).astype(np.float32)
    rows[2, [3, 9, 17]] = rows[2].max() + 1  # a three-way tie at the top: ids in order
    rows[3, [30, 1]] = rows[3].max() + 1
    tokens = [0, 5, 17, 30, 39, 11]
    got = token_logprobs(rows, tokens, TOP)
    want = torch.log_softmax(torch.tensor(rows, dtype=torch.float64), dim=-1).numpy()
    for r, (entry, token) in enumerate(zip(got, tokens)):
        assert entry.token == token and entry.logprob == pytest.approx(want[r, token], abs=1e-12)
        order = sorted(range(40), key=lambda i: (-want[r, i], i))[:TOP]
        assert [i for i, _ in entry.top] == order
        np.testing.assert_allclose([lp for _, lp in entry.top], want[r, order], atol=1e-12)
    assert [i for i, _ in got[2].top[:3]] == [3, 9, 17] and [i for i, _ in got[3].top[:2]] == [1, 30]
    assert all(e.top == [] for e in token_logprobs(rows, tokens, 0))


def hf_logprobs(model, prompt, tokens) -> np.ndarray:
    """transformers' log-softmax at each generated position [n, V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, dim=-1).numpy()


@pytest.fixture(scope="module")
def tree_gen(tiny_models, tmp_path_factory):
    from specedge.export.bundle import ExportOptions, export_bundle

    out = str(tmp_path_factory.mktemp("logprob_trees") / "b")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK, draft_layers=1,
                                                              tree_sizes=(8,)), progress=False)
    g = Generator.load(out)
    yield g
    g.close()


def values(result):
    return [(e.token, e.logprob, e.top) for e in result.logprobs]


def test_plain_decode_logprobs_match_transformers(gen, tiny_models):
    model = tiny_models["llama"][1]
    for seed in range(3):
        prompt = echo_prompt(model, seed)
        out = gen.generate(prompt, NEW, proposer="none", stop_ids=[], logprobs=TOP)
        want = hf_logprobs(model, prompt, out.tokens)
        assert [e.token for e in out.logprobs] == out.tokens
        np.testing.assert_allclose([e.logprob for e in out.logprobs], want[np.arange(NEW), out.tokens], atol=1e-4)
        for e, row in zip(out.logprobs, want):
            np.testing.assert_allclose([lp for _, lp in e.top], np.sort(row)[::-1][:TOP], atol=1e-4)


def test_speculative_logprobs_equal_plain_decode(gen, tree_gen, tiny_models):
    """Chains (prompt lookup, the layer draft) and trees: the same tokens and the same logprobs, bit for bit,
    while drafts are proposed, accepted and rejected."""
    model = tiny_models["llama"][1]
    proposed = accepted = tree_rounds = 0
    for seed in range(3):
        prompt = echo_prompt(model, seed)
        for g, runs in ((gen, [("ngram", 4, 0), ("ngram", 8, 0), ("draft", 2, 0)]), (tree_gen, [("ngram", 4, 8)])):
            plain = g.generate(prompt, NEW, proposer="none", stop_ids=[], logprobs=TOP)
            for proposer, gamma, tree in runs:
                out = g.generate(prompt, NEW, proposer=proposer, gamma=gamma, tree=tree, stop_ids=[],
                                 adaptive=False, logprobs=TOP)
                assert out.tokens == plain.tokens and values(out) == values(plain), (proposer, gamma, tree)
                proposed += out.stats.proposed
                accepted += out.stats.accepted
                tree_rounds += out.stats.tree_rounds
    assert 0 < accepted < proposed and tree_rounds > 0


def test_sampled_and_penalized_runs_report_the_raw_rows(gen, tiny_models):
    """Sampled with top-k and penalties, speculative: each token's logprob is still the model's own
    (transformers' log-softmax at that position), not the shaped law it was drawn from."""
    model = tiny_models["llama"][1]
    prompt = echo_prompt(model, 5)
    for seed in range(3):
        out = gen.generate(prompt, NEW, proposer="ngram", gamma=4, temperature=0.8, top_k=20, seed=seed,
                           stop_ids=[], repetition_penalty=1.3, logprobs=0)
        want = hf_logprobs(model, prompt, out.tokens)
        np.testing.assert_allclose([e.logprob for e in out.logprobs], want[np.arange(NEW), out.tokens], atol=1e-4)


def test_stream_appends_a_rounds_entries_before_yielding_it(gen):
    entries, seen = [], 0
    for new in gen.stream(prompt_of(20, 3), NEW, proposer="ngram", gamma=4, stop_ids=[], logprobs=1,
                          logprobs_out=entries):
        assert [e.token for e in entries[seen:]] == new
        seen += len(new)
    assert seen == NEW == len(entries)


def test_batch_rows_report_their_batch_1_logprobs(tiny_models, tmp_path):
    from test_batch import batch_pair

    g1, g3 = batch_pair(tmp_path, tiny_models["llama"][0])
    try:
        prompts = [prompt_of(5, 1), prompt_of(3 * CHUNK + 5, 2), prompt_of(CHUNK + 1, 3), prompt_of(9, 4)]
        results = g3.generate_batch(prompts, NEW, proposer="ngram", gamma=4, stop_ids=[], adaptive=False,
                                    logprobs=TOP)
        for prompt, res in zip(prompts, results):
            assert values(res) == values(g1.generate(prompt, NEW, proposer="none", stop_ids=[], logprobs=TOP))
        assert g3.generate_batch(prompts[:1], 4, stop_ids=[])[0].logprobs is None
    finally:
        g1.close()
        g3.close()


@pytest.mark.parametrize("kwargs, expected", [
    ({"logprobs": 21}, "logprobs must be an int in 0..20"),
    ({"logprobs": -1}, "logprobs must be an int in 0..20"),
    ({"logprobs": "5"}, "logprobs must be an int in 0..20"),
    ({"logprobs": 2.0}, "logprobs must be an int in 0..20"),
])
def test_bad_logprobs_are_one_clear_error(gen, kwargs, expected):
    with pytest.raises(GenerationError, match=expected):
        gen.generate([5, 6, 7], 4, proposer="ngram", **kwargs)
    with pytest.raises(GenerationError, match="logprobs_out"):
        next(gen.stream([5, 6, 7], 4, proposer="ngram", logprobs=3))


def test_generate_json_reports_logprobs(gen, tiny_bundle):
    import json
    import subprocess
    import sys

    prompt = prompt_of(20, 3)
    r = subprocess.run([sys.executable, "-m", "specedge", "generate", tiny_bundle, "--prompt-ids",
                        ",".join(map(str, prompt)), "--max-new-tokens", "6", "--json", "--logprobs", "2",
                        "--proposer", "ngram"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = gen.generate(prompt, 6, proposer="none", logprobs=2)
    assert out["tokens"] == want.tokens
    assert out["logprobs"] == [e.to_json() for e in want.logprobs]
