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
