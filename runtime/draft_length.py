"""How many drafts to ask for next round: grow while they are accepted, shrink when they are not, and stop
proposing for a while when nothing is accepted.

Why: a verify step of T = k+1 tokens costs more than a T=1 decode step (on the CPU the LM head and the
attention grow with T), so drafts that are rejected make a round slower than plain decode. Growing k after
a fully accepted round and cutting it to just past the accepted length otherwise follows transformers'
"heuristic" assistant schedule; the pause (which doubles while proposals keep failing) bounds the cost on
text where drafting does not work, so speculation is never much slower than plain decode.

The choice of k only depends on past rounds, so it changes speed, never the output: greedy output stays
plain greedy output, and sampling keeps the target distribution (every round is an exact speculative step
for whatever k it used).
"""
from __future__ import annotations


class DraftLength:
    def __init__(self, gamma: int, adaptive: bool = True, patience: int = 3, max_pause: int = 32):
        self.gamma = gamma
        self.adaptive = adaptive
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
        if accepted == proposed:
            self.k = min(self.gamma, self.k + 2)
        else:
            self.k = max(1, accepted + 1)
        if accepted == 0:
            self._misses += 1
            if self._misses >= self.patience:
                self._pause, self._misses = self._next_pause, 0
                self._next_pause = min(self.max_pause, 2 * self._next_pause)
        else:
            self._misses = 0
            self._next_pause = 2
