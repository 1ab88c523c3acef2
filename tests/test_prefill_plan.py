"""The prefill plan: valid covers of the prompt, of least cost under the plan's cost model (checked against an
enumeration of every multiset of runs), and the runtime prefills along it."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import CHUNK

from specedge.graphs import contract as C
from specedge.runtime.generator import Generator
from specedge.runtime.prefill_plan import plan_prefill, run_cost

P, S = C.PREFILL, C.STEP
GRAPH_SETS = [
    ((P, 64), (P, 32), (P, 16), (S, 1)),  # plain decode: T=1 only
    ((P, 64), (P, 32), (P, 16), (S, 1), (S, 5)),  # gamma 4
    ((P, 64), (P, 32), (S, 1), (S, 9)),  # a bundle without the quarter chunk, gamma 8
    ((P, 16), (P, 8), (S, 1), (S, 3)),
    ((S, 1), (S, 2), (S, 5)),  # no prefill graphs (--prefill-logits): step graphs only
]


def least_costs(graphs, limit: int, slack: int) -> dict[int, float]:
    """The least cost of covering each n <= limit, by enumerating multisets of runs: a multiset covers n when
    its largest run, padded and last, is needed (the others hold fewer than n) and the padding fits the slack."""
    best: dict[int, float] = {}
    sizes = [t for _, t in graphs]
    bound = limit + min(slack, max(sizes) - 1)  # a run pads less than its own length

    def multisets(i: int, room: int):
        if i == len(sizes):
            yield ()
            return
        for c in range(room // sizes[i] + 1):
            for rest in multisets(i + 1, room - c * sizes[i]):
                yield (c,) + rest

    for counts in multisets(0, bound):
        total = sum(c * t for c, t in zip(counts, sizes))
        if not total:
            continue
        largest = max(t for c, t in zip(counts, sizes) if c)
        cost = sum(c * run_cost(role, t) for c, (role, t) in zip(counts, graphs))
        for n in range(max(1, total - slack, total - largest + 1), min(total, limit) + 1):
            best[n] = min(best.get(n, np.inf), cost)
    return best


@pytest.mark.parametrize("graphs", GRAPH_SETS)
@pytest.mark.parametrize("slack", [0, 3, 1000])
def test_plans_are_valid_covers_of_least_cost(graphs, slack):
    limit = 100
    least = least_costs(graphs, limit, slack)
    for n in range(1, limit + 1):
        plan = plan_prefill(n, graphs, slack)
        sizes = [t for _, t in plan]
        assert set(plan) <= set(graphs)
        assert sum(sizes[:-1]) < n <= sum(sizes) <= n + slack, (n, plan)  # only the last run pads
        assert sizes[:-1] == sorted(sizes[:-1], reverse=True)  # largest first
        assert sum(run_cost(role, t) for role, t in plan) == pytest.approx(least[n]), (n, plan)


def test_long_prompts_run_full_chunks_first():
    graphs = ((P, 64), (P, 32), (P, 16), (S, 1))
    plan = plan_prefill(1000, graphs, 24)
    assert plan[:14] == ((P, 64),) * 14 and sum(t for _, t in plan) in range(1000, 1025)
    # the tail choice: 67 tokens are 64 + 16 (padded), or 64 + the T=5 step graph when a run has it loaded
    assert plan_prefill(67, graphs, 100) in (((P, 64), (P, 16)), ((P, 16), (P, 64)))
    assert plan_prefill(67, graphs + ((S, 5),), 100) == ((P, 64), (S, 5))
    assert plan_prefill(67, graphs, 0) == ((P, 64), (S, 1), (S, 1), (S, 1))  # no slots for padding


def test_a_full_cache_is_refused():
    with pytest.raises(ValueError, match="cache full"):
        plan_prefill(10, ((P, 16),), 5)


def test_the_runtime_prefills_along_the_plan(tiny_bundle, monkeypatch):
    """Each prefill runs exactly the plan's graphs, in order, and fills the cache with the prompt, and the logits that
    follow equal those after a prefill through one-token steps only (every row computed as decode)."""
    gen = Generator.load(tiny_bundle)
    target = gen.target
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 200, size=2 * CHUNK + 5)]
    target.use_steps([1])
    target.reset()
    for token in prompt:
        target.run([token])
    reference = target.run([7]).copy()
    plans = set()
    for steps in ([1], [1, 5], None):  # the step graphs a plain, a gamma-4 and any run may use
        target.use_steps(steps)
        plan = target.prefill_plan(len(prompt))
        plans.add(plan)
        target.reset()
        ran = []
        execute = target._execute
        monkeypatch.setattr(target, "_execute", lambda role, T, rows, tree=None: ran.append((role, T)) or
                            execute(role, T, rows, tree))
        target.prefill(prompt)
        monkeypatch.undo()
        assert tuple(ran) == plan and target.cache.used == len(prompt)
        np.testing.assert_allclose(target.run([7]), reference, rtol=1e-5, atol=1e-5)
    assert len(plans) > 1  # the tail went through different graphs
    gen.close()


def test_a_run_creates_sessions_for_its_plans_prefill_graphs_only(tiny_models, tiny_bundle, tmp_path):
    """Prefill graphs of 16, 8 and 4 rows in buckets of 32, 64 and 128 slots: a run warms only the graphs
    its prompt's plan uses, each in the bucket it runs in (every session holds memory of its own), and its
    tokens are those of another bundle of the same model."""
    from specedge.export.bundle import ExportOptions, export_bundle

    out = str(tmp_path / "tails")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=128, prefill_chunk=CHUNK, gammas=(2,),
                                                              context_buckets=(32, 64)), progress=False)
    g, reference = Generator.load(out), Generator.load(tiny_bundle)
    assert g.manifest.target.prefill_tokens() == [16, 8, 4]

    def prefill_sessions():
        return {(t, context) for role, t, context in g.target._steps if role == P}

    rng = np.random.default_rng(8)
    warmed = set()
    for length, proposer, plan, sessions in (
            (17, "none", ((P, 16),), {(16, 32)}),
            (20, "ngram", ((P, 16), (S, 3)), set()),
            (20, "none", ((P, 4), (P, 16)), {(4, 32)}),
            (22, "none", ((P, 8), (P, 16)), {(8, 32)}),
            (40, "none", ((P, 16), (P, 8), (P, 16)), {(16, 64)})):  # the last run needs slots 24..39
        prompt = [int(t) for t in rng.integers(5, 200, size=length)]
        out_tokens = g.generate(prompt, 6, proposer=proposer, gamma=2, stop_ids=[]).tokens
        assert g.target.prefill_plan(length - 1, g.target.cache.capacity) == plan
        warmed |= sessions
        assert prefill_sessions() == warmed
        assert out_tokens == reference.generate(prompt, 6, proposer="none", stop_ids=[]).tokens
    g.close()
    reference.close()
