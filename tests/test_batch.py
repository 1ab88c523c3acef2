"""Batches (runtime/batch.py): every row of a --batch B bundle gives exactly its batch-1 output, rows stop
independently, idle rows change nothing, and bad batches are refused with one clear error."""
import collections

import numpy as np
import pytest
from conftest import CHUNK, repetitive_prompts
from test_generate import prompt_of

from specedge.errors import GenerationError
from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime.batch import BatchGenerator
from specedge.runtime.generator import Generator

B = 3
NEW = 30


def batch_pair(root, target: str, draft_path: str | None = None, **options):
    """The same model exported with batch 1 and batch B (the same options otherwise): (Generator,
    BatchGenerator)."""
    bundles = []
    for batch in (1, B):
        bundles.append(str(root / f"b{batch}"))
        export_bundle(target, bundles[-1], ExportOptions(context=128, prefill_chunk=CHUNK, batch=batch, **options),
                      draft_path=draft_path, progress=False)
    return Generator.load(bundles[0]), BatchGenerator.load(bundles[1])


@pytest.fixture(scope="module")
def gens(tiny_models, tmp_path_factory):
    g1, g3 = batch_pair(tmp_path_factory.mktemp("batch"), tiny_models["llama"][0])
    yield g1, g3
    g1.close()
    g3.close()


PROMPTS = [prompt_of(5, 1), prompt_of(3 * CHUNK + 5, 2), prompt_of(CHUNK + 1, 3)]


@pytest.mark.parametrize("proposer,gamma", [("none", 1), ("ngram", 2), ("ngram", 4), ("ngram", 8)])
def test_each_row_equals_its_batch_1_greedy_output(gens, proposer, gamma):
    g1, g3 = gens
    results = g3.generate_batch(PROMPTS, NEW, proposer=proposer, gamma=gamma, stop_ids=[], adaptive=False)
    proposed = accepted = 0
    for prompt, res in zip(PROMPTS, results):
        assert res.tokens == g1.generate(prompt, NEW, proposer=proposer, gamma=gamma, stop_ids=[],
                                         adaptive=False).tokens
        assert res.prompt_ids == prompt and res.stats.new_tokens == NEW
        proposed += res.stats.proposed
        accepted += res.stats.accepted
    if proposer != "none":
        assert 0 < accepted < proposed  # drafts were proposed, accepted and rejected in the batch


def test_greedy_rows_guess_in_the_steps_padding_rows(gens):
    """A row whose chain is shorter than the step's widest row's (or that proposed nothing) pads to the step's T;
    greedy prompt-lookup rows put guesses there (BatchRunner._add_guesses): some accepted, some rejected, and
    every row's output is still its plain batch-1 output."""
    g1, g3 = gens
    prompts = repetitive_prompts(B)
    results = g3.generate_batch(prompts, 48, proposer="ngram", gamma=2, stop_ids=[], adaptive=False)
    for prompt, res in zip(prompts, results):
        assert res.tokens == g1.generate(prompt, 48, proposer="none", stop_ids=[]).tokens
    made, accepted = (sum(getattr(r.stats, f) for r in results) for f in ("spare_proposed", "spare_accepted"))
    assert made > accepted > 0, (made, accepted)


def test_sampled_rows_guess_only_where_batch_1_would(gens, monkeypatch):
    """A sampled row fills only the padding its batch-1 run has (T=1 and T=gamma+1; the batch loads every T up to
    the widest), so its draws, guesses and output stay batch 1's with the same seed. Chains are cut to one token
    here (prompt lookup's rarely end short on their own), so that padding rows follow them."""
    from specedge.runtime import batch as batch_module
    from specedge.runtime.proposers import NgramProposer
    real_chain, real_propose = batch_module.ngram_chain, NgramProposer.propose
    monkeypatch.setattr(batch_module, "ngram_chain", lambda *args: real_chain(*args)[:1])
    monkeypatch.setattr(NgramProposer, "propose", lambda self, *args: real_propose(self, *args).cut(1))
    g1, g3 = gens
    prompts = repetitive_prompts(B)
    sampling = dict(temperature=0.5, top_k=3, stop_ids=[], adaptive=False)
    results = g3.generate_batch(prompts, 48, proposer="ngram", gamma=4, seed=11, **sampling)
    made = accepted = 0
    for b, (prompt, res) in enumerate(zip(prompts, results)):
        alone = g1.generate(prompt, 48, proposer="ngram", gamma=4, seed=11 + b, **sampling)
        assert (res.tokens, res.stats.spare_proposed) == (alone.tokens, alone.stats.spare_proposed)
        made += res.stats.spare_proposed
        accepted += res.stats.spare_accepted
    assert made > accepted > 0, (made, accepted)


def test_sampled_rows_repeat_their_batch_1_runs(gens):
    """Prompt i draws from its own generator seeded seed + i (here prompt b runs in row b)."""
    g1, g3 = gens
    results = g3.generate_batch(PROMPTS, NEW, proposer="ngram", gamma=4, temperature=0.9, top_k=50, seed=11,
                                stop_ids=[])
    for b, (prompt, res) in enumerate(zip(PROMPTS, results)):
        assert res.tokens == g1.generate(prompt, NEW, proposer="ngram", gamma=4, temperature=0.9, top_k=50,
                                         seed=11 + b, stop_ids=[]).tokens


def test_more_prompts_than_rows_refill_freed_rows_and_equal_batch_1(gens, monkeypatch):
    """Seven prompts through three rows: each prompt takes the first row freed (speculation ends the rows at
    different rounds), preferring a row whose cache holds a prefix of it; greedy and sampled (prompt i with
    seed + i) outputs equal batch 1."""
    g1, g3 = gens
    shared = prompt_of(2 * CHUNK, 7)  # a "system prompt" every prompt starts with
    tails = [prompt_of(n, seed) for n, seed in ((5, 1), (9, 2), (CHUNK + 1, 3), (12, 4), (3 * CHUNK + 5, 5), (6, 8),
                                                (CHUNK, 9))]
    prompts = [shared + t for t in tails]
    rows_used = []
    admit = g3.runner.admit
    monkeypatch.setattr(g3.runner, "admit", lambda b, *a, **k: rows_used.append(b) or admit(b, *a, **k))
    for kwargs in (dict(adaptive=False), dict(temperature=0.5, top_k=3, seed=11, adaptive=False)):
        rows_used.clear()
        results = g3.generate_batch(prompts, NEW, proposer="ngram", gamma=4, stop_ids=[], **kwargs)
        assert len(rows_used) == len(prompts) and set(rows_used) == set(range(B))
        for i, (prompt, res) in enumerate(zip(prompts, results)):
            one = dict(kwargs, seed=11 + i) if "seed" in kwargs else kwargs
            assert res.prompt_ids == prompt and len(res.tokens) == NEW
            assert res.tokens == g1.generate(prompt, NEW, proposer="ngram", gamma=4, stop_ids=[], **one).tokens
        assert 0 < sum(r.stats.accepted for r in results) < sum(r.stats.proposed for r in results)
        # the first B prefill all of it; the rest find the shared prefix in the freed row's cache
        assert [r.stats.reused_tokens >= len(shared) for r in results] == [False] * B + [True] * (len(prompts) - B)


def test_rows_prefill_alone_through_row_graphs(gens):
    """A batch bundle (manifest version 3) carries batch-1 prefill graphs: each row with prompt left runs one
    alone on its slice of the cache, so a lone prompt does not pay for the idle rows. `specedge check` finds
    those graphs' rows bit for bit equal to the batch's decode rows, and the tokens stay batch 1's."""
    from specedge.graphs import contract as C
    from specedge.tools.check import check_bundle

    g1, g3 = gens
    entry = g3.manifest.target
    rows = [g for g in entry.graphs if g.batch == 1]
    assert rows and all(".b1." in g.file and not g.step_mask for g in rows)
    assert {g.tokens for g in rows if g.role == C.PREFILL} == set(entry.prefill_tokens())
    assert {g.tokens for g in rows if g.role == C.STEP} == set(entry.step_tokens())  # version 4: row steps
    report = check_bundle(g3.bundle_dir)
    assert report.ok, report.render()
    compared = [g for g in entry.graphs if g.tokens > 1 or g.batch == 1]  # a row T=1 step too; one bucket here
    assert f"exact rows: {len(compared)} graphs compute each row bit for bit" in report.render()
    prompt = PROMPTS[1]  # three chunks and a tail
    runs = g3.target.graph_runs
    (res,) = g3.generate_batch([prompt], NEW, proposer="none", stop_ids=[])
    assert res.tokens == g1.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    assert g3.target._row_steps and not any(role == C.PREFILL for role, _, _ in g3.target._steps)
    assert g3.target.graph_runs - runs == -(-(len(prompt) - 1) // CHUNK) + NEW  # prefill chunks, then decode


def count_calls(monkeypatch, obj, name: str) -> collections.Counter:
    """Count the calls of obj.name (still made) in the returned counter, under key name."""
    calls, real = collections.Counter(), getattr(obj, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, counted)
    return calls


@pytest.mark.parametrize("alone,proposer,gamma,kwargs", [
    (1, "none", 1, {}), (1, "ngram", 4, dict(adaptive=False)),
    (0, "ngram", 4, dict(temperature=1.0, top_k=2, seed=5, adaptive=False))])  # 4 of 16 drafts accepted at batch 1
def test_a_lone_row_decodes_through_row_step_graphs_and_stays_exact(gens, monkeypatch, alone, proposer, gamma,
                                                                       kwargs):
    """A batch step computes every row, idle ones included; a row that runs alone (a lone request, or the last
    row of a batch) steps through the batch-1 row step graphs (manifest version 4) on its slice of the cache.
    Greedy and sampled tokens, and the logprobs of every token (bit for bit), stay batch 1's, alone and when
    rows end at different rounds, and both kinds of step ran."""
    g1, g3 = gens
    kwargs = dict(kwargs, logprobs=2)  # the tiny model's tokens survive small logit errors; its logprobs do not
    runner = g3.target
    one, batch = count_calls(monkeypatch, runner, "run_row"), count_calls(monkeypatch, runner, "run_rows")
    prompt = PROMPTS[alone]
    (alone,) = g3.generate_batch([prompt], NEW, proposer=proposer, gamma=gamma, stop_ids=[], **kwargs)
    plain = g1.generate(prompt, NEW, proposer=proposer, gamma=gamma, stop_ids=[], **kwargs)
    assert (alone.tokens, alone.logprobs) == (plain.tokens, plain.logprobs)
    assert one["run_row"] == alone.stats.rounds and batch["run_rows"] == 0
    assert runner.row_step_sizes == runner.step_sizes
    if proposer != "none":
        assert 0 < alone.stats.accepted < alone.stats.proposed
    one.clear()
    # Four prompts through three rows: the first three share steps (ending at different rounds when they
    # draft), and the fourth, admitted when a row frees, ends alone.
    prompts = PROMPTS + PROMPTS[:1]
    results = g3.generate_batch(prompts, NEW, proposer=proposer, gamma=gamma, stop_ids=[], **kwargs)
    for i, (p, res) in enumerate(zip(prompts, results)):
        seeded = dict(kwargs, seed=kwargs["seed"] + i) if "seed" in kwargs else kwargs
        plain = g1.generate(p, NEW, proposer=proposer, gamma=gamma, stop_ids=[], **seeded)
        assert (res.tokens, res.logprobs) == (plain.tokens, plain.logprobs)
    assert one["run_row"] > 0 and batch["run_rows"] > 0


def test_rounds_that_make_a_row_session_do_not_teach_the_width_choice(gens, monkeypatch):
    """Row step sessions are made on first use; the round that makes one took the making's time too, and a
    width measured that way would look too dear to be tried again."""
    import time

    from specedge.runtime.draft_length import StepWidth

    g1, g3 = gens
    runner = g3.target
    for key in [k for k in runner._row_steps if k[0] == "step"]:
        runner._row_steps.pop(key).session.close()
    real = runner._load
    monkeypatch.setattr(runner, "_load", lambda graph: time.sleep(0.3) or real(graph))
    g3.runner.warm(4)
    fresh = g3.runner.step_width = StepWidth(runner.step_sizes)
    g3.generate_batch([PROMPTS[1]], NEW, proposer="ngram", gamma=4, stop_ids=[])
    assert [k for k in runner._row_steps if k[0] == "step"]  # made during the run
    lone = [s for (key, _), runs in fresh._seconds.items() if isinstance(key, tuple) for s in runs]
    assert lone and max(lone) < 0.3


def test_a_version_3_batch_bundle_runs_lone_rows_in_its_batch_steps(gens, tmp_path):
    """Bundles written before the row step graphs (manifest version 3) still load; a lone row then runs in the
    batch's step graphs, as it did, with the same tokens."""
    import json
    import shutil

    g1, g3 = gens
    old = tmp_path / "v3"
    shutil.copytree(g3.bundle_dir, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["version"] = 3
    graphs = manifest["models"]["target"]["graphs"]
    manifest["models"]["target"]["graphs"] = [g for g in graphs if not (g.get("batch") == 1 and g["role"] == "step")]
    assert len(manifest["models"]["target"]["graphs"]) < len(graphs)
    (old / "manifest.json").write_text(json.dumps(manifest))
    v3 = BatchGenerator.load(str(old))
    try:
        assert v3.target.row_step_sizes == [] and v3.target.row_prefill_sizes
        (res,) = v3.generate_batch([PROMPTS[1]], NEW, proposer="ngram", gamma=4, stop_ids=[], adaptive=False)
        assert res.tokens == g1.generate(PROMPTS[1], NEW, proposer="ngram", gamma=4, stop_ids=[],
                                         adaptive=False).tokens
        assert not any(role == "step" for role, _, _ in v3.target._row_steps)
    finally:
        v3.close()


def test_adaptive_greedy_batches_choose_their_step_width_and_stay_exact(gens):
    """Greedy rows with an adaptive draft length: each round the batch picks the step graph its rows' drafts
    are expected to pay for (a draft lengthens every row's step), from every step graph up to the widest
    proposal, and cuts the drafts to it. Tokens stay plain batch-1 greedy's whatever it picks."""
    from specedge.runtime.draft_length import StepWidth

    g1, g3 = gens
    g3.runner.warm(4)
    widest = max(g3.target.step_sizes)
    assert g3.target.step_sizes == [t for t in g3.manifest.target.step_tokens() if t <= widest]
    assert len([t for t in g3.target.step_sizes if 1 < t < widest]) >= 2
    assert g3.runner.step_width.widths == g3.target.step_sizes
    fresh = g3.runner.step_width = StepWidth(g3.target.step_sizes)
    prompts = PROMPTS + PROMPTS[1:]  # more than the rows: most rounds maximize tokens per second
    results = g3.generate_batch(prompts, NEW, proposer="ngram", gamma=4, stop_ids=[])
    for prompt, res in zip(prompts, results):
        assert res.tokens == g1.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    measured = {t for _, t in fresh._seconds}
    assert 1 in measured and len(measured) >= 2  # plain rounds and rounds with drafts were timed
    assert sum(r.stats.proposed for r in results) > 0  # (the tiny model accepts few: the next test forces drafts)


def test_a_wider_gamma_keeps_the_step_seconds_already_measured(gens):
    """A round's seconds depend on the bucket and the width only, so warming a longer gamma widens the choice
    without forgetting the widths already timed (they would be timed again, slowly, round by round)."""
    from specedge.runtime.draft_length import StepWidth

    _, g3 = gens
    runner = g3.runner
    runner._gammas.clear()
    runner.warm(1)
    runner.step_width = timed = StepWidth(runner.step_width.widths)
    g3.generate_batch(PROMPTS, NEW, proposer="ngram", gamma=1, stop_ids=[])
    measured = {key: list(seconds) for key, seconds in timed._seconds.items()}
    assert measured and {t for _, t in measured} <= {1, 2}
    runner.warm(4)
    assert runner.step_width is timed and max(timed.widths) == max(g3.target.step_sizes) > 2
    assert all(timed._seconds[key] == seconds for key, seconds in measured.items())


def test_a_round_runs_in_the_step_graph_of_its_width_and_closes_with_the_queue(gens):
    """A step computes B*T rows, so a round whose width is 2 runs in the T=2 graph, not padded into the widest
    one a row's own draft length would use; the width aims at finishing the rows soonest only once no prompt
    waits for a row."""
    g1, g3 = gens
    g3.runner.warm(4)
    assert 2 in g3.target.step_sizes and max(g3.target.step_sizes) > 2
    closed = []
    g3.runner.step_width.choose = lambda *a, **k: closed.append(a[-1]) or 2
    graphs, step_graph_for = [], g3.target.step_graph_for
    g3.target.step_graph_for = lambda n: graphs.append(step_graph_for(n)) or graphs[-1]
    prompts = PROMPTS + PROMPTS[:1]  # one more than the rows: it waits for the first row to free
    try:
        results = g3.generate_batch(prompts, NEW, proposer="ngram", gamma=4, stop_ids=[])
    finally:
        del g3.target.step_graph_for, g3.runner.step_width.choose
    for prompt, res in zip(prompts, results):
        assert res.tokens == g1.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    assert set(graphs) == {1, 2}  # rounds with and without drafts, none wider than the width
    assert 0 < sum(r.stats.accepted for r in results) < sum(r.stats.proposed for r in results)
    assert not closed[0] and closed[-1] and closed == sorted(closed)  # open while a prompt waits, then closed


@pytest.fixture(scope="module")
def draft_gens(tiny_models, tmp_path_factory):
    """The same pair with a one-layer layer draft (it reads the target's cache)."""
    g1, g3 = batch_pair(tmp_path_factory.mktemp("batch_draft"), tiny_models["llama"][0], draft_layers=1)
    yield g1, g3
    g1.close()
    g3.close()


@pytest.mark.parametrize("gamma", [2, 4])
def test_layer_draft_rows_equal_their_batch_1_output(draft_gens, gamma):
    """Rows draft together, one batched draft step per position, each at its own cache length in the target's
    shared buffers: every row gives its batch-1 tokens, and drafts were proposed, accepted and rejected."""
    g1, g3 = draft_gens
    prompts = PROMPTS + [prompt_of(2, 9)][: B - len(PROMPTS)]
    runs_before = g3.draft.graph_runs
    results = g3.generate_batch(prompts, NEW, proposer="draft", gamma=gamma, stop_ids=[], adaptive=False)
    draft_runs = g3.draft.graph_runs - runs_before
    proposed = accepted = 0
    for prompt, res in zip(prompts, results):
        alone = g1.generate(prompt, NEW, proposer="draft", gamma=gamma, stop_ids=[], adaptive=False)
        assert res.tokens == alone.tokens == g1.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
        assert (res.stats.proposed, res.stats.accepted) == (alone.stats.proposed, alone.stats.accepted)
        proposed += res.stats.proposed
        accepted += res.stats.accepted
    assert 0 < accepted < proposed
    assert draft_runs < proposed  # one draft step serves every drafting row at a position


def test_greedy_layer_draft_rows_guess_in_the_steps_padding_rows(draft_gens, monkeypatch):
    """A greedy layer-draft row whose chain is shorter than the step (its k shrank after a miss, or it is
    shorter than another row's) takes prompt lookup's guesses in the padding, as at batch 1: some accepted, some
    rejected, every row its plain batch-1 output. (The tiny draft is rarely worth a wider step to StepWidth:
    the step width here is the widest that fits, so that shrunk chains run padded.)"""
    g1, g3 = draft_gens
    monkeypatch.setattr(g3.runner.step_width, "choose", lambda rows, bucket, least, most, closed, widths=None: most)
    prompts = repetitive_prompts(B)
    results = g3.generate_batch(prompts, 48, proposer="draft", gamma=4, stop_ids=[])
    for prompt, res in zip(prompts, results):
        assert res.tokens == g1.generate(prompt, 48, proposer="none", stop_ids=[]).tokens
    made, accepted, drafts = (sum(getattr(r.stats, f) for r in results)
                              for f in ("spare_proposed", "spare_accepted", "proposed"))
    assert made > accepted > 0 and drafts > made, (made, accepted, drafts)


def test_layer_draft_sampled_rows_repeat_their_batch_1_runs(draft_gens):
    """Row b draws its drafts and acceptances from its own generator (prompt i: seed + i), in batch 1's order."""
    g1, g3 = draft_gens
    results = g3.generate_batch(PROMPTS, NEW, proposer="draft", gamma=4, temperature=0.8, top_p=0.9, seed=5,
                                stop_ids=[])
    proposed = accepted = 0
    for b, (prompt, res) in enumerate(zip(PROMPTS, results)):
        alone = g1.generate(prompt, NEW, proposer="draft", gamma=4, temperature=0.8, top_p=0.9, seed=5 + b,
                            stop_ids=[])
        assert res.tokens == alone.tokens
        proposed, accepted = proposed + res.stats.proposed, accepted + res.stats.accepted
    assert 0 < accepted < proposed


def test_layer_draft_rows_keep_held_back_stop_ids_out_of_their_drafts(draft_gens, monkeypatch):
    """Each row's draft steps mask the stop ids the target holds back at that row's positions (as at batch 1,
    test_generate): no draft carries one, greedy and sampled rows still repeat their batch-1 runs."""
    g1, g3 = draft_gens
    free = [g1.generate(p, NEW, proposer="none", stop_ids=[]).tokens for p in PROMPTS]
    held = sorted({f[0] for f in free} | {f[1] for f in free})  # what plain decode (so a good draft) picks
    fed, run_rows = [], g3.target.run_rows
    monkeypatch.setattr(g3.target, "run_rows", lambda feeds: fed.extend(feeds) or run_rows(feeds))
    drafted, positions = [], g3.runner._draft_positions

    def draft_positions(wanted, first, drafts):
        out = positions(wanted, first, drafts)
        drafted.extend(list(drafts[b]) for b in wanted)
        return out

    monkeypatch.setattr(g3.runner, "_draft_positions", draft_positions)
    for kwargs in (dict(), dict(temperature=0.8, seed=5)):
        fed.clear(), drafted.clear()
        results = g3.generate_batch(PROMPTS, NEW, proposer="draft", gamma=4, stop_ids=held, min_new_tokens=NEW,
                                    adaptive=False, **kwargs)
        for b, (prompt, res) in enumerate(zip(PROMPTS, results)):
            one = dict(kwargs, seed=5 + b) if kwargs else kwargs
            assert res.tokens == g1.generate(prompt, NEW, proposer="draft", gamma=4, stop_ids=held,
                                             min_new_tokens=NEW, adaptive=False, **one).tokens, (b, kwargs)
        assert any(len(f) > 1 for f in fed) and not any(set(f[1:]) & set(held) for f in fed), kwargs
        assert drafted and not any(set(d) & set(held) for d in drafted), kwargs  # drafted without them


@pytest.fixture(scope="module")
def pair_gens(tiny_models, tiny_near_draft_model, tmp_path_factory):
    """Target + a separate draft model (a perturbed copy: accepted often, not always), batch 1 and batch 3."""
    g1, g3 = batch_pair(tmp_path_factory.mktemp("batch_pair"), tiny_models["llama"][0], tiny_near_draft_model[0])
    yield g1, g3
    g1.close()
    g3.close()


@pytest.mark.parametrize("gamma", [1, 4])
def test_draft_model_rows_equal_their_batch_1_output(pair_gens, gamma):
    """A draft model with a batch cache of its own: the rows prefill it with their prompts, catch it up after
    fully accepted rounds (a two-token step) and draft together; each row gives its batch-1 tokens and
    counts, greedy and sampled."""
    g1, g3 = pair_gens
    results = g3.generate_batch(PROMPTS, NEW, proposer="draft", gamma=gamma, stop_ids=[], adaptive=False)
    proposed = accepted = 0
    for prompt, res in zip(PROMPTS, results):
        alone = g1.generate(prompt, NEW, proposer="draft", gamma=gamma, stop_ids=[], adaptive=False)
        assert res.tokens == alone.tokens == g1.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
        assert (res.stats.proposed, res.stats.accepted) == (alone.stats.proposed, alone.stats.accepted)
        proposed, accepted = proposed + res.stats.proposed, accepted + res.stats.accepted
    assert 0 < accepted < proposed
    sampled = g3.generate_batch(PROMPTS, NEW, proposer="draft", gamma=gamma, temperature=0.8, seed=3, stop_ids=[])
    for b, (prompt, res) in enumerate(zip(PROMPTS, sampled)):
        assert res.tokens == g1.generate(prompt, NEW, proposer="draft", gamma=gamma, temperature=0.8, seed=3 + b,
                                         stop_ids=[]).tokens


def _first_drafts(monkeypatch, g3=None) -> dict:
    """Record the draft's logits after each round's feed by (which run, the prompt's first 16 tokens, context
    length), at batch 1 (DraftModelProposer.propose_tree) and in the batch (BatchRunner._draft_positions' first
    draft step).
    They depend only on the context (float32 rows are alike at every T and batch row), so two runs that commit the
    same tokens draft alike at every context length both reach, when the draft's cache holds what it should."""
    from specedge.runtime import proposers
    seen: dict = {}
    real_draft_tokens, context_length = proposers.draft_tokens, []
    real_propose = proposers.DraftModelProposer.propose_tree

    def propose_tree(self, context, k, nodes, sampler):
        context_length[:] = [tuple(context[:16]), len(context)]
        return real_propose(self, context, k, nodes, sampler)

    def draft_tokens(runner, logits, *args, **kwargs):
        seen.setdefault(("one", *context_length), logits.copy())
        return real_draft_tokens(runner, logits, *args, **kwargs)

    monkeypatch.setattr(proposers.DraftModelProposer, "propose_tree", propose_tree)
    monkeypatch.setattr(proposers, "draft_tokens", draft_tokens)
    if g3 is None:
        return seen
    real_positions, real_run_rows = g3.runner._draft_positions, g3.draft.run_rows

    def draft_positions(wanted, first, drafts):
        firsts = []

        def run_rows(feeds):  # the first step feeds each row's catch-up and pending token
            logits = real_run_rows(feeds)
            if not firsts:
                firsts.append({b: logits[b, len(feeds[b]) - 1].copy() for b in wanted})
            return logits
        g3.draft.run_rows = run_rows
        try:
            out = real_positions(wanted, first, drafts)
        finally:
            del g3.draft.run_rows
        for b in wanted:
            context = g3.runner.rows[b].context
            seen.setdefault(("batch", tuple(context[:16]), len(context)), firsts[0][b])
        return out

    monkeypatch.setattr(g3.runner, "_draft_positions", draft_positions)
    return seen


def test_draft_model_rows_guess_and_feed_their_cache_what_it_missed(pair_gens, monkeypatch):
    """A draft model with its own cache takes prompt lookup's guesses in the padding rows too (its paused rounds,
    the rows after a shrunk chain); an accepted guess is a token its cache never ran, fed with the next round's
    pending token. Proof that the cache holds what it should: its first draft at every context length equals the
    one of a run without guesses (whose rounds fall elsewhere), at batch 1 and in a batch whose step is the widest
    that fits (so that shrunk chains run padded); outputs are plain decode's."""
    g1, g3 = pair_gens
    prompts = repetitive_prompts(B)
    _assert_drafts_follow_the_cache(monkeypatch, g1, g3, prompts, 48)


def _assert_drafts_follow_the_cache(monkeypatch, g1, g3, prompts, new, guessed=("one", "batch")):
    """Plain decode's outputs, guesses made and accepted where `guessed`, and the first drafts of every context
    length both runs reach alike (_first_drafts), at batch 1 and in the batch."""
    plain = [g1.generate(p, new, proposer="none", stop_ids=[]).tokens for p in prompts]
    with monkeypatch.context() as patch:  # the reference: no padding rows, so no guesses
        reference = _first_drafts(patch, g3)
        patch.setattr(g1.target, "padding_rows", lambda n: 0)
        for prompt, want in zip(prompts, plain):
            assert g1.generate(prompt, new, proposer="draft", gamma=4, stop_ids=[]).tokens == want
    monkeypatch.setattr(g3.runner.step_width, "choose", lambda rows, bucket, least, most, closed, widths=None: most)
    seen = _first_drafts(monkeypatch, g3)
    alone = [g1.generate(p, new, proposer="draft", gamma=4, stop_ids=[]) for p in prompts]
    batch = g3.generate_batch(prompts, new, proposer="draft", gamma=4, stop_ids=[])
    for want, one, res in zip(plain, alone, batch):
        assert one.tokens == res.tokens == want
    for where, results in (("one", alone), ("batch", batch)):
        made, accepted = (sum(getattr(r.stats, f) for r in results) for f in ("spare_proposed", "spare_accepted"))
        assert where not in guessed or made > accepted > 0, (where, made, accepted)
    for where in ("one", "batch"):
        shared = [key for key in seen if key[0] == where and ("one",) + key[1:] in reference]
        assert len(shared) > 20, (where, len(shared))
        wrong = [key for key in shared if not np.array_equal(seen[key], reference[("one",) + key[1:]])]
        assert not wrong, (where, len(shared), wrong[:5])


def test_draft_model_rows_with_penalties_draft_as_batch_1_does(pair_gens):
    """Penalties shape each row's drafts with the row's own state (runtime/proposers.Sampler): the same drafts,
    counts and sampled tokens as batch 1."""
    g1, g3 = pair_gens
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.3, frequency_penalty=0.2)
    for kwargs in (dict(adaptive=False), dict(temperature=0.8, seed=5)):
        results = g3.generate_batch(PROMPTS, NEW, proposer="draft", gamma=4, stop_ids=[], **kwargs, **penalties)
        for b, (prompt, res) in enumerate(zip(PROMPTS, results)):
            one = dict(kwargs, seed=kwargs["seed"] + b) if "seed" in kwargs else kwargs
            alone = g1.generate(prompt, NEW, proposer="draft", gamma=4, stop_ids=[], **one, **penalties)
            assert res.tokens == alone.tokens, (b, kwargs)
            assert (res.stats.proposed, res.stats.accepted) == (alone.stats.proposed, alone.stats.accepted)


def test_draft_model_rows_catch_up_after_rounds_without_drafts(tiny_models, tiny_draft_model, tmp_path):
    """A poor draft (an unrelated one-layer model) makes the adaptive draft length pause, so rows come back
    to drafting with several tokens their draft cache has not seen: those are prefilled before the round,
    and every row still gives its batch-1 tokens."""
    g1, g3 = batch_pair(tmp_path, tiny_models["llama"][0], tiny_draft_model[0])
    try:
        lagging, inside = [], []
        chunk, draft_round = g3.draft.prefill_chunk, g3.runner._draft_model_rows

        def counted(pending):
            if inside:  # a catch-up inside a decode round, not the prompt's prefill
                lagging.append(sum(map(len, pending)))
            return chunk(pending)

        def round_(*args):
            inside.append(True)
            try:
                return draft_round(*args)
            finally:
                inside.clear()

        g3.draft.prefill_chunk, g3.runner._draft_model_rows = counted, round_
        g3.runner.warm(4)  # rows draft what their own draft length asks (the step width would stop a poor draft)
        g3.runner.step_width.choose = lambda rows, bucket, least, most, closed, widths=None: most
        results = g3.generate_batch(PROMPTS, NEW, proposer="draft", gamma=4, stop_ids=[])
        for prompt, res in zip(PROMPTS, results):
            assert res.tokens == g1.generate(prompt, NEW, proposer="draft", gamma=4, stop_ids=[]).tokens
        assert lagging and max(lagging) > 1
        # and what the catch-ups fed (rounds without drafts, accepted guesses) is what the cache then holds
        with pytest.MonkeyPatch.context() as patch:
            prompts = repetitive_prompts(B)
            # (a poor draft's shrunk chain ends in a token prompt lookup cannot continue: no guesses here; its
            # paused rounds guess under two-row decode, test_two_row_decode.py)
            _assert_drafts_follow_the_cache(patch, g1, g3, prompts, 60, guessed=())
        # A paused draft row next to a prompt-lookup row that drafts: the step is wide, so the paused row guesses
        # in a round it drafts nothing, and what it accepts there is fed to its cache too.
        with pytest.MonkeyPatch.context() as patch:
            reference = _first_drafts(patch, g3)
            patch.setattr(g1.target, "padding_rows", lambda n: 0)
            want = {b: g1.generate(p, 60, proposer="draft", gamma=4, stop_ids=[]).tokens
                    for b, p in enumerate(prompts) if b}
        with pytest.MonkeyPatch.context() as patch:
            seen = _first_drafts(patch, g3)
            events, commit = [], g3.runner._commit_draft_model_row
            patch.setattr(g3.runner, "_commit_draft_model_row",
                          lambda b, verified, k, accepted: events.append((k, accepted)) or commit(b, verified, k,
                                                                                                   accepted))
            runner = g3.runner
            runner.history = [[] for _ in range(B)]
            for b, prompt in enumerate(prompts):
                runner.admit(b, prompt, 60, "ngram" if b == 0 else "draft", 4, stop_ids=[])
            while runner.active:
                while runner.prefill_step():
                    pass
                runner.decode_step()
            got = {b: runner.release(b).output for b in range(1, B)}
            runner.release(0)
        assert got == want
        assert any(k == 0 and accepted > 0 for k, accepted in events), events  # guesses accepted while paused
        shared = [key for key in seen if ("one",) + key[1:] in reference]
        assert len(shared) > 10 and all(np.array_equal(seen[key], reference[("one",) + key[1:]])
                                        for key in shared), len(shared)
    finally:
        g1.close()
        g3.close()


def test_draft_model_rows_reuse_their_draft_cache_on_a_follow_up(pair_gens):
    """A continuing request in a freed row keeps the prefix in both caches (target and draft) and still
    equals a fresh batch-1 run of the whole conversation."""
    g1, g3 = pair_gens
    runner = g3.runner
    first = g3.generate_batch(PROMPTS[:1], 12, proposer="draft", gamma=4, stop_ids=[])[0]
    follow = PROMPTS[0] + first.tokens + [21, 22, 23]
    b = runner.free_row(follow)
    row = runner.admit(b, follow, 12, proposer="draft", gamma=4, stop_ids=[])
    assert row.stats.reused_tokens > 0 and len(row.draft_prefill) < len(follow) - 1
    while runner.prefill_step():
        pass
    while runner.active:
        runner.decode_step()
    assert runner.release(b).output == g1.generate(follow, 12, proposer="none", stop_ids=[]).tokens


def test_rows_stop_independently_and_idle_rows_change_nothing(gens):
    g1, g3 = gens
    full = [g1.generate(p, NEW, proposer="none", stop_ids=[]).tokens for p in PROMPTS[:2]]
    stop = full[0][7]  # row 0 stops at its 8th token; row 1 runs on (unless the token occurs there earlier)
    results = g3.generate_batch(PROMPTS[:2], NEW, proposer="ngram", gamma=4, stop_ids=[stop])
    assert len(results) == 2  # fewer prompts than B: the third row idles
    for want, res in zip(full, results):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert res.tokens == want[:cut]
        assert res.stats.stop_reason == ("stop" if stop in want else "max_new_tokens")
    assert results[0].tokens[-1] == stop and len(results[0].tokens) <= 8


def test_min_new_tokens_holds_each_rows_stop_tokens_back_as_batch_1_does(gens):
    g1, g3 = gens
    free = [g1.generate(p, NEW, proposer="none", stop_ids=[]).tokens for p in PROMPTS]
    held = [free[0][3], free[1][5]]
    for min_new in (6, 20):
        results = g3.generate_batch(PROMPTS, NEW, proposer="ngram", gamma=4, stop_ids=held, min_new_tokens=min_new,
                                    adaptive=False)
        changed = 0
        for prompt, f, res in zip(PROMPTS, free, results):
            want = g1.generate(prompt, NEW, proposer="none", stop_ids=held, min_new_tokens=min_new).tokens
            assert res.tokens == want and not set(want[:min_new - 1]) & set(held)
            changed += want != f[:len(want)]
        assert changed > 0


def test_held_back_stop_ids_end_each_rows_verified_drafts(gens, monkeypatch):
    """As at batch 1 (test_generate): a row's drafts are verified only up to a held-back stop id, and each
    row still equals its batch-1 run."""
    import specedge.runtime.batch as batch

    g1, g3 = gens
    held = sorted({p[i] for p in PROMPTS for i in range(3)})  # a prompt repeats its start: lookup copies it
    proposed, fed = [], []
    lookup, run_rows = batch.ngram_chain, g3.target.run_rows
    monkeypatch.setattr(batch, "ngram_chain", lambda *a: proposed.append(lookup(*a)) or proposed[-1])
    monkeypatch.setattr(g3.target, "run_rows", lambda feeds: fed.extend(feeds) or run_rows(feeds))
    results = g3.generate_batch(PROMPTS, NEW, proposer="ngram", gamma=4, stop_ids=held, min_new_tokens=NEW,
                                adaptive=False)
    for prompt, res in zip(PROMPTS, results):
        assert res.tokens == g1.generate(prompt, NEW, proposer="none", stop_ids=held, min_new_tokens=NEW).tokens
    assert any(set(d) & set(held) for d in proposed)  # lookup did propose them
    assert not any(set(f[1:]) & set(held) for f in fed)  # no verify step carried one
    assert sum(r.stats.accepted for r in results) > 0


@pytest.mark.parametrize("kwargs,match", [
    ({"prompts": []}, "no prompts"),
    ({"prompts": [[5], []]}, "prompt 1 is empty"),
    ({"prompts": [[5]], "proposer": "draft"}, "needs a bundle with a draft model"),
    ({"prompts": [[5]], "proposer": "lookahead"}, "unknown proposer 'lookahead'; choose one of draft, ngram, none"),
    ({"prompts": [[5]], "gamma": 3}, "gamma 3 has no verify graph"),
    ({"prompts": [[5]], "temperature": -1.0}, "temperature"),
    ({"prompts": [[5]], "temperature": 1.0, "seed": -3}, "seed must be an int >= 0 \\(or left out\\), not -3"),
    ({"prompts": [[5] * 200]}, "context holds 128"),
])
def test_bad_batches_are_one_clear_error(gens, kwargs, match):
    _, g3 = gens
    with pytest.raises(GenerationError, match=match):
        g3.generate_batch(**kwargs)


def test_generate_cli_runs_a_batch_file(gens, tmp_path):
    import json
    import subprocess
    import sys

    g1, g3 = gens
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS[:2]) + "\n")
    bundle = g3.target.bundle_dir
    r = subprocess.run([sys.executable, "-m", "specedge", "generate", bundle, "--prompts", str(path),
                        "--max-new-tokens", "12", "--proposer", "ngram", "--gamma", "4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["index"] for row in rows] == [0, 1]
    for prompt, row in zip(PROMPTS, rows):
        assert row["tokens"] == g1.generate(prompt, 12, proposer="ngram", gamma=4).tokens
    for line, fragment in ((b'{"nothing": 1}', "needs one of 'prompt', 'messages' or 'prompt_ids'"),
                           (b'{"prompt": "a", "prompt_ids": [1]}', "needs one of"),
                           (b'{"prompt": 5}', ":1: 'prompt' must be a string"),
                           (b'{"prompt_ids": ["a"]}', ":1: the prompt must be integer token ids"),
                           (b'{"prompt_ids": 7}', "'prompt_ids' must be a list"),
                           (b'{"messages": "hi"}', ":1: messages must be a non-empty list"),
                           (b'{"messages": [{"role": "user"}]}', "messages[0].content must be a string"),
                           (b'\xff\xfe{}', "is not UTF-8 text")):
        path.write_bytes(line + b"\n")
        bad = subprocess.run([sys.executable, "-m", "specedge", "generate", bundle, "--prompts", str(path)],
                             capture_output=True, text=True)
        assert bad.returncode == 2 and fragment in bad.stderr, (line, bad.stderr)
        assert "Traceback" not in bad.stderr


def test_rows_draft_from_the_output_history_and_equal_batch_1(gens):
    """Rows whose context has no match draft from the output history (here made-up earlier outputs that are
    each row's own with every 7th token changed): still each row's batch-1 output, with drafts accepted and
    rejected, and every row's output added to the history."""
    from test_output_history import corrupted

    from specedge.runtime.output_history import OutputHistory

    g1, g3 = gens
    prompts = [list(range(10 + 30 * s, 40 + 30 * s)) for s in range(3)]  # no repeats: nothing in the context
    want = [g1.generate(p, NEW, proposer="none", stop_ids=[]).tokens for p in prompts]
    without = sum(r.stats.proposed for r in g3.generate_batch(prompts, NEW, proposer="ngram", gamma=4, stop_ids=[],
                                                               adaptive=False))
    g3.runner.output_history = history = OutputHistory.of([corrupted(p[-6:] + w, 7) for p, w in zip(prompts, want)])
    try:
        results = g3.generate_batch(prompts, NEW, proposer="ngram", gamma=4, stop_ids=[], adaptive=False)
    finally:
        g3.runner.output_history = None
    assert [r.tokens for r in results] == want
    proposed, accepted = sum(r.stats.proposed for r in results), sum(r.stats.accepted for r in results)
    assert 0 < accepted < proposed and proposed > without
    assert len(history) == 3 * (6 + NEW) + 3 * NEW


def test_rows_with_penalties_equal_their_batch_1_output(gens):
    """Each row keeps its own penalty state (its prompt and output): greedy and sampled rows equal batch 1. A
    logit bias bans the token plain decode writes most."""
    g1, g3 = gens
    plain = [g1.generate(p, NEW, proposer="none", stop_ids=[]).tokens for p in PROMPTS]
    banned = collections.Counter(sum(plain, [])).most_common(1)[0][0]
    penalties = dict(repetition_penalty=0.95, presence_penalty=-0.4, frequency_penalty=0.1,  # drafts get accepted
                     logit_bias={banned: -100.0})
    proposed = accepted = changed = 0
    for kwargs in (dict(adaptive=False), dict(temperature=1.0, min_p=0.3, seed=3)):
        results = g3.generate_batch(PROMPTS, NEW, proposer="ngram", gamma=4, stop_ids=[], **kwargs, **penalties)
        for b, (prompt, res) in enumerate(zip(PROMPTS, results)):
            one = dict(kwargs, seed=kwargs["seed"] + b) if "seed" in kwargs else kwargs
            want = g1.generate(prompt, NEW, proposer="ngram", gamma=4, stop_ids=[], **one, **penalties).tokens
            assert res.tokens == want and banned not in want, (b, kwargs)
            changed += want != g1.generate(prompt, NEW, proposer="ngram", gamma=4, stop_ids=[], **one).tokens
            proposed += res.stats.proposed
            accepted += res.stats.accepted
    assert 0 < accepted < proposed and changed >= 4
    with pytest.raises(GenerationError, match="repetition_penalty"):
        g3.generate_batch(PROMPTS, NEW, repetition_penalty=-1.0)
    with pytest.raises(GenerationError, match="logit_bias token 1000000 is outside the vocabulary"):
        g3.generate_batch(PROMPTS, NEW, logit_bias={10**6: 1.0})


def test_rows_end_at_their_stop_strings_as_batch_1_does(gens):
    """Every row cut after the token that completes its first stop string (each row's own output holds one),
    with the same tokens and text as batch 1; the other rows go on."""
    g1, g3 = gens
    free = [g1.generate(p, NEW, proposer="none", stop_ids=[]).tokens for p in PROMPTS]
    decode = g1.tokenizer.decode
    stop = [decode(free[0][6:8]), decode(free[2][20:22])]
    results = g3.generate_batch(PROMPTS, NEW, proposer="ngram", gamma=4, stop_ids=[], adaptive=False, stop=stop)
    lengths = []
    for prompt, res in zip(PROMPTS, results):
        one = g1.generate(prompt, NEW, proposer="ngram", gamma=4, stop_ids=[], adaptive=False, stop=stop)
        assert (res.tokens, res.text, res.stats.stop_reason) == (one.tokens, one.text, one.stats.stop_reason)
        assert all(s not in res.text for s in stop)
        lengths.append(len(res.tokens))
    assert lengths[0] <= 8 and lengths[2] <= 22 and len(set(lengths)) > 1, lengths



