"""The speculative loop: greedy output equals plain decode and transformers, limits cut exactly, stats hold."""
import numpy as np
import pytest
import torch
from conftest import CHUNK

from specedge.runtime.generator import Generator

GAMMAS = (1, 2, 4, 8)
PROMPT_LENGTHS = (1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5)
NEW = 40


def prompt_of(length: int, seed: int) -> list[int]:
    """Half random, half a repeat of its own start: gives prompt lookup something to find."""
    rng = np.random.default_rng(seed)
    head = rng.integers(2, 1000, max(1, (length + 1) // 2)).tolist()
    return (head + head)[:length]


def hf_greedy(model, prompt, n=NEW):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_equals_plain_and_transformers(length, gen, pair_gen, tiny_models):
    prompt = prompt_of(length, seed=length)
    reference = hf_greedy(tiny_models["llama"][1], prompt)
    plain = gen.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    assert plain == reference
    for g, proposers in ((gen, ("ngram", "draft")), (pair_gen, ("draft",))):
        for proposer in proposers:
            for gamma in GAMMAS:
                out = g.generate(prompt, NEW, proposer=proposer, gamma=gamma, stop_ids=[])
                assert out.tokens == plain, (proposer, gamma)


def echo_prompt(model, seed: int) -> list[int]:
    """Six tokens, the target's own greedy continuation of them, the six again: prompt lookup finds text the
    target tends to repeat."""
    head = prompt_of(12, seed)[:6]
    return head + hf_greedy(model, head, 24) + head


def test_every_speculative_path_proposes_accepts_and_rejects(gen, pair_gen, tiny_models):
    """Greedy equality alone would pass with a proposer that never drafts. With adaptive=False every gamma is
    used as given: each (bundle, proposer, gamma) must propose drafts, get some accepted and some rejected,
    and (where the proposer can) have fully accepted rounds, all while equal to plain decode."""
    model = tiny_models["llama"][1]
    prompts = [prompt_of(n, seed=n) for n in PROMPT_LENGTHS] + [echo_prompt(model, s) for s in (1, 2)]
    plain = [gen.generate(p, NEW, proposer="none", stop_ids=[]).tokens for p in prompts]
    for g, proposer in ((gen, "ngram"), (gen, "draft"), (pair_gen, "draft")):
        for gamma in GAMMAS:
            proposed = accepted = full = 0
            for p, want in zip(prompts, plain):
                out = g.generate(p, NEW, proposer=proposer, gamma=gamma, stop_ids=[], adaptive=False)
                assert out.tokens == want, (proposer, gamma)
                proposed += out.stats.proposed
                accepted += out.stats.accepted
                by_position = out.stats.accepted_by_position
                full += by_position[gamma - 1] if len(by_position) >= gamma else 0
            label = (g is pair_gen, proposer, gamma)
            assert 0 < accepted < proposed, label
            # Full rounds: the near-copy draft at every gamma; prompt lookup and the 1-of-3-layer draft
            # only reach them at short gammas on these random-weight models (SmolLM2's suite test asserts
            # them for prompt lookup at every gamma).
            if g is pair_gen or gamma <= (2 if proposer == "ngram" else 1):
                assert full > 0, label


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_greedy_other_families(family, tiny_models, tmp_path):
    from specedge.export.bundle import ExportOptions, export_bundle

    hf_dir, model = tiny_models[family]
    out = str(tmp_path / family)
    export_bundle(hf_dir, out, ExportOptions(context=128, prefill_chunk=CHUNK, gammas=(2, 4), draft_layers=2),
                  progress=False)
    g = Generator.load(out)
    prompt = prompt_of(CHUNK + 7, seed=11)
    reference = hf_greedy(model, prompt)
    for proposer in ("none", "ngram", "draft"):
        assert g.generate(prompt, NEW, proposer=proposer, gamma=4, stop_ids=[]).tokens == reference, proposer
    g.close()


def test_stats_invariants(gen):
    for proposer in ("none", "ngram", "draft"):
        s = gen.generate(prompt_of(3 * CHUNK + 5, 1), NEW, proposer=proposer, gamma=4, stop_ids=[]).stats
        assert s.accepted <= s.proposed
        assert s.new_tokens == s.accepted + s.rounds == NEW
        assert sum(s.proposed_by_position) == s.proposed and sum(s.accepted_by_position) == s.accepted
        for j, rate in enumerate(s.acceptance_by_position):
            assert rate == pytest.approx(s.accepted_by_position[j] / s.proposed_by_position[j])
        assert all(a <= p for a, p in zip(s.accepted_by_position, s.proposed_by_position))
        # Position j can only be accepted if j-1 was: the counts never grow along the draft.
        assert all(x >= y for x, y in zip(s.accepted_by_position, s.accepted_by_position[1:]))
        assert s.ttft_ms > 0 and s.total_ms >= s.ttft_ms and s.tokens_per_s > 0
        assert s.graph_ms <= s.total_ms
        if proposer == "none":
            assert s.proposed == 0 and s.rounds == NEW


def test_max_new_tokens_cuts_inside_an_accepted_run(gen):
    prompt = prompt_of(3 * CHUNK + 5, 2)
    full = gen.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    for n in range(1, 12):
        out = gen.generate(prompt, n, proposer="ngram", gamma=8, stop_ids=[])
        assert out.tokens == full[:n] and out.stats.stop_reason == "max_new_tokens"
        assert out.stats.new_tokens == out.stats.accepted + out.stats.rounds


def test_stop_ids_cut_exactly_and_keep_the_stop_token(gen):
    prompt = prompt_of(3 * CHUNK + 5, 2)
    full = gen.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    for stop in (full[0], full[5], full[17]):
        cut = full[: full.index(stop) + 1]
        for proposer in ("none", "ngram", "draft"):
            out = gen.generate(prompt, NEW, proposer=proposer, gamma=8, stop_ids=[stop])
            assert out.tokens == cut and out.stats.stop_reason == "stop"


def test_eos_from_the_bundle_stops_by_default(gen):
    """stop_ids=None means the bundle's EOS ids (t1 = id 1 for the tiny tokenizer)."""
    prompt = prompt_of(CHUNK, 3)
    full = gen.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    gen.eos_ids = [full[3]]
    try:
        out = gen.generate(prompt, NEW, proposer="ngram")
        assert out.tokens == full[: full.index(full[3]) + 1]
    finally:
        gen.eos_ids = [1]


def hf_min_new(model, prompt, held: int, min_new: int, n=NEW) -> list[int]:
    """transformers' own min_new_tokens: `held` is the EOS it may not choose before min_new tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=min_new, do_sample=False, eos_token_id=held,
                             pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(held) + 1] if held in tokens else tokens


def test_min_new_tokens_holds_the_stop_tokens_back_like_transformers(gen, pair_gen, tiny_models):
    """The held-back token is one plain decode picks early and again later, so holding it back changes the
    output; every proposer and gamma must still equal plain decode under the same rule, and drafts must
    have been proposed, accepted and rejected."""
    model = tiny_models["llama"][1]
    checked = 0
    for seed in range(6):
        prompt = echo_prompt(model, seed)
        free = gen.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
        held = next((t for i, t in enumerate(free[:8]) if t in free[i + 1:]), None)
        if held is None:
            continue
        checked += 1
        # free.index(held) + 1: the rule holds back exactly the position where plain decode chose it first
        for min_new in (free.index(held) + 1, 12, NEW):
            want = hf_min_new(model, prompt, held, min_new)
            assert held not in want[:min_new - 1]
            plain = gen.generate(prompt, NEW, proposer="none", stop_ids=[held], min_new_tokens=min_new)
            assert plain.tokens == want, (seed, min_new)
            assert plain.tokens != free[:len(plain.tokens)]  # the rule changed the output
            proposed = accepted = 0
            for g, proposer in ((gen, "ngram"), (gen, "draft"), (pair_gen, "draft")):
                for gamma in (1, 4, 8):
                    out = g.generate(prompt, NEW, proposer=proposer, gamma=gamma, stop_ids=[held],
                                     min_new_tokens=min_new, adaptive=False)
                    assert out.tokens == want, (seed, min_new, proposer, gamma)
                    proposed += out.stats.proposed
                    accepted += out.stats.accepted
            assert 0 < accepted < proposed
    assert checked >= 3


def test_a_held_back_stop_id_ends_the_drafts_that_are_verified(gen, pair_gen, tiny_models, monkeypatch):
    """A draft that is a held-back stop id would be rejected, and so would everything after it: the loop
    verifies only the drafts before it, and a draft model does not draft it at all. Prompt lookup on an echo
    prompt copies the held token (the target's own continuation holds it), so its proposals contain it; no
    verify step may, and the output stays plain decode's under the rule."""
    model = tiny_models["llama"][1]
    proposals = []

    def recording(make):
        def _proposer(self, *args):
            drafter = make(self, *args)
            propose = drafter.propose
            drafter.propose = lambda context, k, sampler: proposals.append(propose(context, k, sampler)) or proposals[-1]
            return drafter
        return _proposer

    monkeypatch.setattr(Generator, "_proposer", recording(Generator._proposer))
    cut = accepted = 0
    for seed in range(4):
        prompt = echo_prompt(model, seed)
        free = gen.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
        held = free[0]  # lookup drafts the continuation from its first token on
        plain = gen.generate(prompt, NEW, proposer="none", stop_ids=[held], min_new_tokens=NEW).tokens
        for g, proposer in ((gen, "ngram"), (gen, "draft"), (pair_gen, "draft")):
            verified, run = [], g.target.run
            monkeypatch.setattr(g.target, "run", lambda tokens, run=run, verified=verified: verified.append(list(tokens)) or run(tokens))
            proposals.clear()
            out = g.generate(prompt, NEW, proposer=proposer, gamma=4, stop_ids=[held], min_new_tokens=NEW,
                             adaptive=False)
            assert out.tokens == plain, (seed, proposer)
            assert all(held not in v for v in verified), (seed, proposer)
            accepted += out.stats.accepted
            cut += sum(held in p.tokens for p in proposals)
            if proposer == "draft":  # a draft model keeps it out of its drafts (its next choice may be accepted)
                assert proposals and not any(held in p.tokens for p in proposals), (seed, proposer)
            monkeypatch.setattr(g.target, "run", run)
    assert cut > 0 and accepted > 0  # proposals did contain it, and speculation ran


def test_min_new_tokens_keeps_sampled_runs_off_the_held_tokens(gen):
    """Sampling from the held-back law: the held ids never come before min_new_tokens, with and without
    speculation, and the seed still fixes the output."""
    prompt = prompt_of(CHUNK + 3, 9)
    free = [gen.generate(prompt, NEW, proposer="none", temperature=1.0, seed=s, stop_ids=[]).tokens for s in range(8)]
    held = sorted({t for f in free for t in f[:6]})[:3]  # tokens sampled early without the rule
    for proposer in ("none", "ngram", "draft"):
        for s in range(8):
            out = gen.generate(prompt, NEW, proposer=proposer, gamma=4, temperature=1.0, seed=s, stop_ids=held,
                               min_new_tokens=NEW)
            assert len(out.tokens) == NEW and not set(out.tokens) & set(held), (proposer, s)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "8"])
def test_bad_min_new_tokens_is_one_clear_error(gen, bad):
    from specedge.errors import GenerationError

    with pytest.raises(GenerationError, match="min_new_tokens must be an int >= 0"):
        gen.generate([5, 6, 7], 4, proposer="none", min_new_tokens=bad)


def test_full_context_stops_cleanly(tiny_models, tmp_path):
    from specedge.export.bundle import ExportOptions, export_bundle

    out = str(tmp_path / "small")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=40, prefill_chunk=16, gammas=(4,),
                                                              draft_layers=1), progress=False)
    g = Generator.load(out)
    prompt = prompt_of(30, 4)
    plain = g.generate(prompt, 100, proposer="none", stop_ids=[])
    assert plain.stats.stop_reason == "context_full"
    assert len(prompt) + len(plain.tokens) == 41  # 40 slots hold all but the last (pending) token
    for proposer in ("ngram", "draft"):
        out = g.generate(prompt, 100, proposer=proposer, gamma=4, stop_ids=[])
        assert out.tokens == plain.tokens and out.stats.stop_reason == "context_full"
    g.close()


def test_stream_yields_each_round(gen):
    prompt = prompt_of(3 * CHUNK + 5, 5)
    rounds = list(gen.stream(prompt, NEW, proposer="ngram", gamma=4, stop_ids=[]))
    assert sum(rounds, []) == gen.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    assert all(1 <= len(r) <= 5 for r in rounds)


def test_text_comes_from_the_tokenizer(gen):
    out = gen.generate(gen.tokenizer.encode("t5 t6 t7"), 5, proposer="none", stop_ids=[])
    assert out.text == " ".join(f"t{i}" for i in out.tokens)
    assert gen.tokenizer.apply_chat_template("t9") == [2, 9, 3, 4]


def test_context_buckets_change_nothing(gen, tiny_models, tmp_path):
    """With graphs for past lengths 32, 64 and 128, steps attend over the smallest bucket that holds the
    cache and the cache moves up as it grows; the tokens stay those of the single-bucket bundle."""
    from specedge.export.bundle import ExportOptions, export_bundle

    out = str(tmp_path / "buckets")
    m = export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK,
                                                                  context_buckets=(32, 64), draft_layers=1),
                      progress=False)
    assert m.target.buckets() == [32, 64, 128] and m.draft.buckets() == [32, 64, 128]
    g = Generator.load(out)
    for length in (1, CHUNK + 1, 3 * CHUNK + 5):
        prompt = prompt_of(length, seed=20 + length)
        plain = gen.generate(prompt, 60, proposer="none", stop_ids=[]).tokens
        for proposer in ("none", "ngram", "draft"):
            assert g.generate(prompt, 60, proposer=proposer, gamma=4, stop_ids=[]).tokens == plain, proposer
            assert g.target.cache.bucket == (128 if length + 60 > 64 else 64)
    g.close()


def test_sessions_only_for_the_buckets_a_run_can_reach(gen, tiny_models, tmp_path):
    """A short run loads the graphs of the first bucket only (each session costs memory); a longer run on the
    same generator loads the next buckets before its first token, and both give plain decode's tokens."""
    from specedge.export.bundle import ExportOptions, export_bundle

    out = str(tmp_path / "buckets")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK,
                                                              context_buckets=(32, 64)), progress=False)
    g = Generator.load(out)
    contexts = lambda: sorted({context for _, _, context in g.target._steps})  # noqa: E731
    short, long = prompt_of(3, seed=5), prompt_of(2 * CHUNK + 3, seed=6)
    # 3 prompt tokens + 8 new + the widest graph (the 16-token prefill chunk) fit in 32 slots
    assert g.generate(short, 8, proposer="ngram", gamma=2, stop_ids=[]).tokens == \
        gen.generate(short, 8, proposer="none", stop_ids=[]).tokens
    assert contexts() == [32]
    sessions = g.target.sessions
    out_long = g.generate(long, 40, proposer="ngram", gamma=2, stop_ids=[])
    assert out_long.tokens == gen.generate(long, 40, proposer="none", stop_ids=[]).tokens
    assert contexts() == [32, 64, 128] and g.target.sessions > sessions
    # a graph's sessions in different buckets share its input and output buffers (runs are one at a time)
    by_graph: dict = {}
    for (role, T, _), step in g.target._steps.items():
        by_graph.setdefault((role, T), []).append(step)
    shared = [steps for steps in by_graph.values() if len(steps) > 1]
    assert shared and all(s.new_kv is steps[0].new_kv and s.input_ids is steps[0].input_ids
                          for steps in shared for s in steps)
    g.close()


def test_python_api_backend_gives_the_same_tokens(tiny_bundle, gen):
    """The `ort` backend (onnxruntime's Python API) runs the same loop; greedy output is the same."""
    prompt = prompt_of(2 * CHUNK + 3, 5)
    g = Generator.load(tiny_bundle, backend="ort")
    try:
        for proposer in ("none", "ngram", "draft"):
            assert g.generate(prompt, NEW, proposer=proposer, gamma=4, stop_ids=[]).tokens == \
                gen.generate(prompt, NEW, proposer=proposer, gamma=4, stop_ids=[]).tokens, proposer
    finally:
        g.close()


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("fixed", [False, True])
def test_generate_cli_fixed_gamma_turns_adaptation_off(tiny_bundle, tmp_path, monkeypatch, capsys, batch, fixed):
    """`specedge generate --fixed-gamma` reaches the loop as adaptive=False, one prompt or --prompts."""
    import json

    from specedge.cli import main
    from specedge.runtime.batch import BatchGenerator

    seen = []
    for cls, name in ((Generator, "stream"), (BatchGenerator, "generate_batch")):
        original = getattr(cls, name)

        def spy(self, *args, _original=original, **kwargs):
            seen.append(kwargs["adaptive"])
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, spy)
    args = ["generate", tiny_bundle, "--proposer", "ngram", "--gamma", "2", "--max-new-tokens", "6", "--json"]
    if batch:
        path = tmp_path / "p.jsonl"
        path.write_text(json.dumps({"messages": [{"role": "user", "content": "t1 t2 t1 t2"}]}) + "\n")
        args += ["--prompts", str(path)]
    else:
        args += ["--prompt-ids", "5,6,7,5,6,7,5"]
    assert main(args + (["--fixed-gamma"] if fixed else [])) == 0
    assert seen and all(adaptive is not fixed for adaptive in seen)
    capsys.readouterr()
