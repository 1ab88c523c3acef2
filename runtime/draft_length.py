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

The choice of k only depends on past rounds, so it changes speed, never the output: greedy output stays
plain greedy output, and sampling keeps the target distribution (every round is an exact speculative step
for whatever k it used).
"""
from __future__ import annotations


class DraftLength:
    def __init__(self, gamma: int, adaptive: bool = True, shrink: bool = True, patience: int = 3,
                 max_pause: int = 32):
        self.gamma = gamma
        self.adaptive = adaptive
        self.shrink = shrink
        self.patience = patience  # proposing rounds with nothing accepted before a pause
        self.max_pause = max_pause
        self.k = gamma
        self._misses = 0
        self._pause = 0  # rounds left without proposing
        self._next_pause = 2

    def next(self) -> int:
        """Drafts to request this round (0: plain decode step)."""
        if not self.adaptive:
            return self.gamma
        if self._pause > 0:
            self._pause -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
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
    change in the text (or, for a batch, in its rows) is seen. The choice only changes speed: every round is
    exact whichever kind it is. Not adaptive: always the first option."""

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


class TreeChoice(RateChoice):
    """Whether the next round proposes a token tree or a plain chain, from what each has been worth.

    A tree verify step has more rows than the chain's and costs more (SmolLM2 int4 on 2 cores: T=12 18.4 ms
    against 15 ms for T=9 and 6.3 ms for T=1), and pays only when nodes off the chain are accepted often
    enough."""

    def __init__(self, adaptive: bool = True, explore: int = 16, decay: float = 0.8):
        super().__init__((True, False), adaptive, explore, decay)

    def use_tree(self) -> bool:
        return self.choose()
