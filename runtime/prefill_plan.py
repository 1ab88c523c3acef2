"""Which static graphs a prompt goes through: the plan of least estimated cost.

A graph run costs about one read of every weight plus its rows' arithmetic, and padded rows cost as much as
real ones. The prefill graphs (no LM head) are cheapest per row; step graphs also run the head on every row.
Measured with SmolLM2 on 2 cores (ms per run): float32 prefill T=64/32/16 83/46/28, steps T=9/5/1 26/22/18;
int4 prefill 73/39/22, steps 16/11/5.5. In rows of prefill work a run's fixed cost is about 8 (float32) and
4 (int4); the plan's cost model takes 8, and 1.25 for a step graph's row. Under each of four such measured
cost tables (two days, float32 and int4), its plans cost 0.3 ms more than the best plan on average (at most
0.8 ms for one table, 12 ms for one prompt length), over prompt lengths up to 200 and each set of step graphs
a run loads. Full chunks of the largest prefill graph come first; only the last run pads.
"""
from __future__ import annotations

from functools import lru_cache

from ..graphs import contract as C

RUN_COST = 8.0  # a graph run's fixed cost (reading the weights), in rows of prefill work
STEP_ROW_COST = 1.25  # a step graph's row also runs the LM head
INFEASIBLE = float("inf")


def run_cost(role: str, tokens: int) -> float:
    return RUN_COST + tokens * (STEP_ROW_COST if role == C.STEP else 1.0)


@lru_cache(maxsize=1024)
def plan_prefill(n: int, graphs: tuple[tuple[str, int], ...], slack: int) -> tuple[tuple[str, int], ...]:
    """The runs, in order, that put n tokens in the cache at least cost: graphs are the (role, T) available;
    slack is the free cache slots beyond the n tokens (the last run's padding rows need slots too)."""
    if n <= 0:
        return ()
    prefills = [g for g in graphs if g[0] == C.PREFILL]
    chunk = max(prefills or graphs, key=lambda g: g[1])  # the cheapest per row
    full = max(0, n // chunk[1] - 1)  # only the last two chunks' worth needs a choice
    rest = n - full * chunk[1]
    # best[m]: (cost, first run) of the cheapest way to cover m tokens; a run longer than m is the last one
    # and pads into the slack.
    best: list[tuple[float, tuple[str, int]]] = [(0.0, ("", 0))]
    for m in range(1, rest + 1):
        best.append(min(((run_cost(role, t) + (best[m - t][0] if t < m else 0.0), (role, t))
                         for role, t in graphs if t <= m + slack), default=(INFEASIBLE, ("", 0))))
    if best[rest][0] == INFEASIBLE:
        raise ValueError("cache full")
    chain, m = [], rest
    while m > 0:
        chain.append(best[m][1])
        m -= chain[-1][1]
    # Largest first, and the run that pads (the one the chain ended with) last.
    return tuple([chunk] * full + sorted(chain[:-1], key=lambda g: -g[1]) + chain[-1:])
