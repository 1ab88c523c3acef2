"""How many drafts to ask for next round: stop proposing for a while when nothing is accepted, and (for
proposers whose drafts cost time to make) grow k while drafts are accepted and shrink it when they are not.

Why: a verify step of T = k+1 tokens costs more than a T=1 decode step (SmolLM2 on 2 CPU cores: T=9 costs
1.5x, T=17 2x), so rounds whose drafts are all rejected are slower than plain decode. The pause (which
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


class TreeChoice:
    """Whether the next round proposes a token tree or a plain chain, from what each has been worth.

    A tree verify step has more rows than the chain's and costs more (SmolLM2 int4 on 2 cores: T=12 18.4 ms
    against 15 ms for T=9 and 6.3 ms for T=1), and pays only when nodes off the chain are accepted often
    enough. So both kinds of round keep a running rate of committed tokens per second of round time, and the
    better one is used, the other tried once every `explore` rounds so that a change in the text is seen.
    Like the draft length, the choice never changes the output: every round is exact whichever it is."""

    def __init__(self, adaptive: bool = True, explore: int = 16, decay: float = 0.8):
        self.adaptive, self.explore, self.decay = adaptive, explore, decay
        self._rate = {True: None, False: None}  # tokens per second, tree rounds / chain rounds
        self._round = 0

    def use_tree(self) -> bool:
        if not self.adaptive:
            return True
        self._round += 1
        tree, chain = self._rate[True], self._rate[False]
        if tree is None or chain is None:  # measure both first
            return tree is None
        better = tree >= chain
        return better if self._round % self.explore else not better

    def update(self, tree: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate = tokens / seconds
        old = self._rate[tree]
        self._rate[tree] = rate if old is None else self.decay * old + (1 - self.decay) * rate
