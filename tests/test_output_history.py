"""Prompt lookup from earlier outputs: the index finds what a plain search finds, and greedy speculation that
drafts from it still equals plain decode, with drafts proposed, accepted and rejected."""
import json
import subprocess
import sys

import numpy as np
import pytest

from specedge.errors import GenerationError
from specedge.runtime.generator import Generator
from specedge.runtime.output_history import OutputHistory, output_history
from specedge.runtime.proposers import NgramProposer


def reference_lookup(outputs: list[list[int]], context: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Plain search: the longest suffix first; for it the latest output, the latest place in it, with a token
    after the match."""
    for n in range(min(n_max, len(context)), n_min - 1, -1):
        suffix = context[-n:]
        for out in reversed(outputs):
            for s in range(len(out) - n - 1, -1, -1):
                if out[s:s + n] == suffix:
                    return out[s + n:s + n + k]
    return []


def test_lookup_equals_a_plain_search():
    rng = np.random.default_rng(0)
    checked = found = 0
    for trial in range(300):
        vocab = int(rng.integers(3, 12))  # small vocabularies: many matches of every length
        outputs = [rng.integers(0, vocab, int(rng.integers(0, 40))).tolist() for _ in range(int(rng.integers(1, 6)))]
        history = OutputHistory.of(outputs)
        for _ in range(10):
            context = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
            k, n_min, n_max = int(rng.integers(1, 9)), int(rng.integers(2, 5)), int(rng.integers(4, 9))
            want = reference_lookup(outputs, context, k, n_min, n_max)
            assert history.lookup(np.asarray(context), k, n_min, n_max) == want, (outputs, context, k, n_min, n_max)
            checked += 1
            found += bool(want)
    assert found > checked // 5  # the matches were exercised (about 27% of the lookups), not only misses


def test_the_oldest_outputs_go_first():
    history = OutputHistory(10)
    history.add([1, 2, 3, 4])
    history.add([5, 6, 7, 8])
    assert len(history) == 8 and history.lookup(np.asarray([1, 2]), 2, 2) == [3, 4]
    history.add([9, 10, 11])  # 11 tokens: the first output goes
    assert len(history) == 7 and history.lookup(np.asarray([1, 2]), 2, 2) == []
    assert history.lookup(np.asarray([5, 6]), 9, 2) == [7, 8]
    history.add(list(range(100, 125)))  # longer than the history: its last 10 tokens stay
    assert len(history) == 10 and history.lookup(np.asarray([115, 116]), 2, 2) == [117, 118]
    assert history.lookup(np.asarray([101, 102]), 2, 2) == []
    history.clear()
    assert len(history) == 0 and history.lookup(np.asarray([115, 116]), 2, 2) == []


@pytest.mark.parametrize("bad", [-1, 1.5, "64", True])
def test_bad_history_sizes(bad):
    with pytest.raises(GenerationError, match="history tokens must be an int >= 0"):
        output_history(bad)


def test_the_context_comes_first():
    """The history is a fallback: a context with a match of its own drafts from itself."""
    proposer = NgramProposer(history=OutputHistory.of([[1, 2, 3, 40, 41, 42]]))
    assert proposer.propose([1, 2, 3, 7, 8, 1, 2, 3], 3, None).tokens == [7, 8, 1]
    assert proposer.propose([9, 1, 2, 3], 3, None).tokens == [40, 41, 42]
    assert proposer.propose([9, 2, 3], 3, None).tokens == []  # a 2-token match is too short (HISTORY_N_MIN)
    assert proposer.propose_tree([9, 1, 2, 3], 3, 5, None).tokens == [40, 41, 42]
    assert NgramProposer().propose([9, 1, 2, 3], 3, None).tokens == []


class Clock:
    now = 0.0

    def perf_counter(self):
        return self.now


@pytest.mark.parametrize("accepted, step_ms, want_history", [(0, 2.9, False), (4, 1.5, True)])
def test_history_drafts_run_only_while_they_pay(monkeypatch, accepted, step_ms, want_history):
    """Adaptive: a round where only the history has drafts runs with them or without, whichever committed more
    tokens per second (a fake clock: a plain round takes 1 ms, one with the history's drafts step_ms). Drafts
    never accepted at 2.9 ms are dropped but for a try every 16 such rounds; 4 accepted at 1.5 ms are kept."""
    import specedge.runtime.proposers as proposers

    clock = Clock()
    monkeypatch.setattr(proposers, "time", clock)
    proposer = NgramProposer(history=OutputHistory.of([[1, 2, 3, 40, 41, 42, 43]]))
    used = 0
    for _ in range(64):
        drafts = proposer.propose([9, 1, 2, 3], 4, None).tokens
        used += bool(drafts)
        clock.now += step_ms if drafts else 1.0
        proposer.commit(accepted if drafts else 0, 7)
    assert used >= 58 if want_history else used <= 6, used  # 64 - 5 / 1 + 4: the first try, then 1 in 16
    fixed = NgramProposer(history=OutputHistory.of([[1, 2, 3, 40, 41, 42, 43]]), adaptive=False)
    assert all(fixed.propose([9, 1, 2, 3], 4, None).tokens for _ in range(20))  # not adaptive: always drafts


def corrupted(tokens: list[int], every: int) -> list[int]:
    """A made-up earlier output: the real one with every `every`-th token changed, so drafts from it are right
    for a while and then wrong."""
    return [t if i % every else (t + 1) % 1000 + 2 for i, t in enumerate(tokens)]


def test_greedy_speculation_from_the_history_equals_plain_decode(gen):
    prompts = [list(range(10 + 30 * s, 40 + 30 * s)) for s in range(4)]  # no repeats: nothing in the context
    plain = [gen.generate(p, 40, proposer="none", stop_ids=[]).tokens for p in prompts]
    for gamma in (2, 4, 8):
        proposed = accepted = without = 0
        for p, want in zip(prompts, plain):
            without += gen.generate(p, 40, proposer="ngram", gamma=gamma, stop_ids=[], adaptive=False).stats.proposed
            gen.output_history = OutputHistory.of([corrupted(p[-6:] + want, 7)])
            try:
                out = gen.generate(p, 40, proposer="ngram", gamma=gamma, stop_ids=[], adaptive=False)
                assert out.tokens == want, gamma
                assert len(gen.output_history) == 46 + 40  # this generation's output was added
            finally:
                gen.output_history = None
            proposed += out.stats.proposed
            accepted += out.stats.accepted
        assert 0 < accepted < proposed, gamma
        assert proposed > without, gamma  # the drafts came from the history


def test_a_generator_remembers_its_outputs(tiny_bundle):
    g = Generator.load(tiny_bundle, history_tokens=1000)
    try:
        prompt = list(range(300, 330))
        first = g.generate(prompt, 30, proposer="none", stop_ids=[])
        assert len(g.output_history) == 30
        again = g.generate(prompt, 30, proposer="ngram", gamma=8, stop_ids=[], adaptive=False)
        assert again.tokens == first.tokens
        assert again.stats.accepted >= 20  # the first output is drafted again
    finally:
        g.close()
    with pytest.raises(GenerationError, match="history tokens"):
        Generator.load(tiny_bundle, history_tokens=-5)


def test_bench_history_never_sees_its_own_prompt(tiny_bundle, tmp_path):
    """--history: a prompt's history holds the earlier prompts' outputs only. The second prompt repeats the
    first, so it drafts the first's output; the first, alone in its history, drafts exactly what it does
    without one."""
    path, out = tmp_path / "p.jsonl", tmp_path / "b.json"
    message = {"role": "user", "content": " ".join(f"t{i}" for i in range(30, 50))}
    path.write_text("\n".join(json.dumps({"id": name, "kind": "grounded", "messages": [message]})
                              for name in ("first", "again")) + "\n")
    r = subprocess.run([sys.executable, "-m", "specedge", "bench", tiny_bundle, "--prompts", str(path), "--proposers",
                        "ngram", "--gamma", "4", "--repeats", "2", "--max-new-tokens", "24", "--fixed-gamma",
                        "--history", "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "| grounded | ngram g=4 history |" in r.stdout
    runs = json.load(open(out))["runs"]
    by = {(run["config"], run["prompt"]): run for run in runs}  # (the last repeat's)
    assert by[("ngram g=4 history", "first")]["proposed"] == by[("ngram g=4", "first")]["proposed"]
    assert by[("ngram g=4 history", "again")]["accepted"] >= 12
    assert by[("ngram g=4 history", "again")]["accepted"] > by[("ngram g=4", "again")]["accepted"], by
    assert all(run["tokens"] == by[("none", run["prompt"])]["tokens"] for run in runs)
    r = subprocess.run([sys.executable, "-m", "specedge", "bench", tiny_bundle, "--prompts", str(path), "--proposers",
                        "none", "--history"], capture_output=True, text=True)
    assert r.returncode != 0 and "--history is a prompt lookup option" in r.stderr


def test_generate_prompts_with_a_history(tiny_bundle, tmp_path):
    """`specedge generate --prompts --history-tokens`: the second of two equal prompts (a batch-1 bundle runs
    them one after the other) drafts the first's output; one prompt alone has no earlier outputs."""
    path = tmp_path / "p.jsonl"
    message = {"role": "user", "content": " ".join(f"t{i}" for i in range(200, 230))}
    path.write_text(2 * (json.dumps({"messages": [message]}) + "\n"))
    r = subprocess.run([sys.executable, "-m", "specedge", "generate", tiny_bundle, "--prompts", str(path),
                        "--max-new-tokens", "24", "--proposer", "ngram", "--gamma", "8", "--history-tokens", "1000",
                        "--fixed-gamma"],  # the adaptive width follows measured step times: accepted counts vary
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    first, second = [json.loads(line) for line in r.stdout.splitlines()]
    assert first["tokens"] == second["tokens"]
    assert second["stats"]["accepted"] >= first["stats"]["accepted"] + 8, (first["stats"], second["stats"])
    r = subprocess.run([sys.executable, "-m", "specedge", "generate", tiny_bundle, "--prompt-ids", "1,2,3",
                        "--history-tokens", "1000"], capture_output=True, text=True)
    assert r.returncode == 2 and "--history-tokens needs --prompts" in r.stderr and "Traceback" not in r.stderr
