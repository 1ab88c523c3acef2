"""How many drafts to ask for next round: stop proposing for a while when nothing is accepted, and (for
proposers whose drafts cost time to make) grow k while drafts are accepted and shrink it when they are not.

Why: a verify step of T = k+1 tokens costs more than a T=1 decode step (SmolLM2 on 2 CPU cores, float32:
T=9 costs 1.5x, T=17 2x; int4, where onnxruntime's MatMulNBits work grows with every row: T=2 1.34x, T=5
2.03x, T=9 2.88x), so rounds whose drafts are all rejected are slower than plain decode. The pause (which
doubles while proposals keep failing) bounds that cost on text where drafting does not work.
* A draft model pays for every token it drafts, so its k also follows transformers' "heuristic" schedule:
  +2 after a fully accepted round, else just past the accepted length.
* Prompt lookup drafts for free, and a long verify that is cut early still gains the accepted prefix: its
  k stays at gamma (replaying SmolLM2's greedy outputs on the prompt suite: shrinking lowered the decode
  speed-up on the grounded prompts from 2.11x to 2.02x).
* A batch (runtime/batch.py) also cuts its greedy rows' drafts each round to the step graph they are
  expected to pay for (`StepWidth`), since one row's drafts lengthen every row's step.

The choice of k only depends on past rounds, so it changes speed, never the output: greedy output stays
plain greedy output, and sampling keeps the target distribution (every round is an exact speculative step
for whatever k it used).
"""
from __future__ import annotations

import statistics


class DraftLength:
    def __init__(self, gamma: int, adaptive: bool = True, shrink: bool = True, patience: int = 3,
                 max_pause: int = 32, decay: float = 0.9):
        self.gamma = gamma
        self.adaptive = adaptive
        self.shrink = shrink
        self.patience = patience  # proposing rounds with nothing accepted before a pause
        self.max_pause = max_pause
        self.k = gamma
        self._misses = 0
        self._pause = 0  # rounds left without proposing
        self._next_pause = 2
        self.acceptance = Acceptance(decay)  # what StepWidth weighs this row's drafts with

    def next(self) -> int:
        """Drafts to request this round (0: plain decode step)."""
        if not self.adaptive:
            return self.gamma
        if self._pause > 0:
            self._pause -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.acceptance.update(proposed, accepted)
        if not self.adaptive:
            return
        if self.shrink:
            self.k = min(self.gamma, self.k + 2) if accepted == proposed else max(1, accepted + 1)
        if accepted == 0:
            self._misses += 1
            if self._misses >= self.patience:
                self._pause, self._misses = self._next_pause, 0
                self._next_pause = min(self.max_pause, 2 * self._next_pause)
        else:
            self._misses = 0
            self._next_pause = 2


class RateChoice:
    """Which of a few kinds of round to run next, from the committed tokens per second each has been worth.

    Each option keeps a running rate (tokens committed per second of round time, decaying); every option is
    measured once first, then the best is used and another tried once every `explore` rounds, so that a
    change in the text is seen. The choice only changes speed: every round is exact whichever kind it is.
    Not adaptive: always the first option."""

    def __init__(self, options, adaptive: bool = True, explore: int = 16, decay: float = 0.8):
        self.options, self.adaptive, self.explore, self.decay = tuple(options), adaptive, explore, decay
        self._rate = {o: None for o in self.options}
        self._round = 0

    def choose(self):
        if not self.adaptive:
            return self.options[0]
        self._round += 1
        untried = [o for o in self.options if self._rate[o] is None]
        if untried:
            return untried[0]
        best = max(self.options, key=lambda o: self._rate[o])  # ties: the earlier option
        if self._round % self.explore:
            return best
        others = [o for o in self.options if o != best]
        return others[(self._round // self.explore) % len(others)]

    def update(self, option, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate = tokens / seconds
        old = self._rate[option]
        self._rate[option] = rate if old is None else self.decay * old + (1 - self.decay) * rate


class Acceptance:
    """The chance that a draft is accepted given that the one before it was, from decayed counts of accepted
    drafts and of rejections (a round that did not accept all it proposed), each from a prior of one:
    accepted / (accepted + rejections) is the maximum-likelihood rate of a geometric acceptance length cut at
    what was proposed."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self._accepted = 1.0
        self._rejected = 1.0

    @property
    def rate(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed:
            self._accepted = self.decay * self._accepted + accepted
            self._rejected = self.decay * self._rejected + (accepted < proposed)

    def unverified(self) -> None:
        """Drafts a batch's step width cut to none: nothing was learned, and the estimate drifts back toward
        the prior, so that drafts which stopped paying are tried again (the text may have changed) after a
        while instead of never."""
        self._accepted = self.decay * self._accepted + (1 - self.decay)
        self._rejected = self.decay * self._rejected + (1 - self.decay)


class StepWidth:
    """Which step graph (T tokens per row) a batch's verify step uses: the one whose expected committed tokens
    per second is highest, given each row's drafts this round and its acceptance so far.

    Why: one row's drafts lengthen every row's step, and at batch B a step costs B rows per position (SmolLM2
    float32 at batch 4: T=3 1.7x a T=1 step), so a round is worth drafting only when what the rows' drafts
    are expected to add pays for the wider step. A row with L drafts and acceptance a commits, in a step of
    width T, 1 + a + a^2 + ... + a^min(L, T-1) tokens on average. The seconds of a round are measured per
    (context bucket, T): they depend on those only, not on the text, so the choice needs no exploration of
    rounds that cannot pay (a width not yet trusted is tried where it could: see `seconds`). The median of the
    last few rounds resists a slow outlier. `bucket` may be any hashable key: a lone row's rounds, which run
    in row step graphs and cost less, are measured under (bucket, "row").
    On a shared machine one round can take twice its usual time. A width judged on that one round looked too
    dear to be tried again, and how much a batch drafted then varied tenfold between runs of the same prompts
    (benchmarks/batch/README.md): so a width is trusted only after `trust` rounds, an estimate is never above a
    wider width's, and the rounds of a width not run for `stale` rounds of its bucket are forgotten (the load
    changes) and it is measured again.
    The choice only changes speed: every round is exact whichever width it uses."""

    def __init__(self, widths, samples: int = 5, trust: int = 3, stale: int = 256):
        self.widths = sorted(widths)
        self.samples, self.trust, self.stale = samples, trust, stale
        self._seconds: dict[tuple[int, int], list[float]] = {}  # (bucket, T) -> the last rounds' seconds
        self._rounds: dict[object, int] = {}  # bucket -> rounds measured in it
        self._last: dict[tuple[int, int], int] = {}  # (bucket, T) -> the bucket's round that last ran it

    @staticmethod
    def expected_tokens(drafts: int, acceptance: float) -> float:
        """Committed tokens of a row that verifies `drafts` drafts: the bonus token plus the accepted prefix."""
        return 1.0 + sum(acceptance ** j for j in range(1, drafts + 1))

    def seconds(self, bucket: int, width: int) -> float:
        """The seconds of a round at this bucket and width: the median of its last rounds, and no more than a
        wider trusted width's (a wider step never costs less). Not yet trusted (fewer than `trust` rounds): what
        the widest narrower width costs, so the width is tried where its drafts could pay; 0 when no narrower
        width is measured either, so that the narrowest is measured first."""
        return _at_or_below(self._estimates(bucket), width)

    def _estimates(self, bucket) -> dict[int, float]:
        """`seconds` of every width measured at this bucket, in one pass (choose asks for each candidate)."""
        runs = {t: r for (b, t), r in self._seconds.items() if b == bucket}
        estimates, cap = {}, float("inf")
        for t in sorted(runs, reverse=True):  # trusted: capped by the wider trusted ones
            if len(runs[t]) >= self.trust:
                estimates[t] = cap = min(cap, float(statistics.median(runs[t])))
        for t in sorted(runs):  # not trusted: the widest narrower width's
            if t not in estimates:
                estimates[t] = _at_or_below(estimates, t - 1)
        return estimates

    def choose(self, rows: list[tuple[int, float, int]], bucket: int, least: int = 1, most: int | None = None,
               closed: bool = False, widths: list[int] | None = None) -> int:
        """The width for rows of (drafts available, acceptance, tokens left to generate), between `least` (what
        rows with a fixed draft length need) and `most` (what fits the cache), among `widths` (default: all);
        ties go to the narrower width.

        Most committed tokens per second, unless `closed`: then no sequence joins before the running ones end
        (a batch's last prompts), so tokens of a row that will wait for the others anyway are worth nothing,
        and the width is the one that finishes the slowest row soonest (the fewest seconds for the row with
        the most rounds left)."""
        widths = self.widths if widths is None else sorted(widths)
        estimates = self._estimates(bucket)
        candidates = [t for t in widths if least <= t <= (most or widths[-1])] or [least]
        longest = max((n for n, _, _ in rows), default=0)
        best, best_rate = candidates[0], -1.0
        for t in candidates:
            if t > longest + 1 and t > least:  # wider than any row can fill
                break
            tokens = [self.expected_tokens(min(n, t - 1), a) for n, a, _ in rows]
            if closed:
                worth = min(e / max(1, left) for e, (_, _, left) in zip(tokens, rows))
            else:
                worth = sum(tokens)
            seconds = _at_or_below(estimates, t)
            rate = worth / seconds if seconds else float("inf")
            if rate > best_rate:
                best, best_rate = t, rate
        return best

    def update(self, bucket: int, width: int, seconds: float) -> None:
        now = self._rounds[bucket] = self._rounds.get(bucket, 0) + 1
        for key in [k for k in self._seconds if k[0] == bucket and now - self._last[k] > self.stale]:
            del self._seconds[key], self._last[key]
        runs = self._seconds.setdefault((bucket, width), [])
        runs.append(seconds)
        del runs[: -self.samples]
        self._last[(bucket, width)] = now


def _at_or_below(estimates: dict[int, float], width: int) -> float:
    """The estimate of the widest width up to `width` (0 when there is none)."""
    below = [t for t in estimates if t <= width]
    return estimates[max(below)] if below else 0.0


class TreeChoice(RateChoice):
    """Whether the next round proposes a token tree or a plain chain, from what each has been worth.

    A tree verify step has more rows than the chain's and costs more (SmolLM2 int4 on 2 cores: T=12 18.4 ms
    against 15 ms for T=9 and 6.3 ms for T=1), and pays only when nodes off the chain are accepted often
    enough."""

    def __init__(self, adaptive: bool = True, explore: int = 16, decay: float = 0.8):
        super().__init__((True, False), adaptive, explore, decay)

    def use_tree(self) -> bool:
        return self.choose()
