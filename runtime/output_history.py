"""Earlier outputs as a second place for prompt lookup to find drafts (suffix decoding's global history).

Prompt lookup drafts only where the context's suffix occurred earlier in the context. On short edits seven
rounds in ten find nothing there (benchmarks/ngram/README.md), yet a model reuses its own phrasing from one
answer to the next ("```\\n\\nThis", "If the list is empty, it returns"). A generator that keeps its recent
outputs can draft those from them, as SuffixDecoding (Oliaro et al., 2024) and vLLM's `suffix` method do with
a tree over earlier responses. Drafts stay proposals: the target's verify step decides, so the output is the
same with or without the history.

The outputs sit in one flat array, separated by SEP, with an index of every bigram (sorted keys, and where
each bigram ends): a lookup is one binary search on the context's last two tokens, then the candidates'
matches are extended backwards, as `proposers.match_starts` does within the context.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ..errors import GenerationError
from .sampling import is_int

SEP = -1  # between outputs; equal to no token, so no match and no continuation crosses it
KEY_BASE = 1 << 32  # bigram key = first * KEY_BASE + second (token ids are below 2**32)
DEFAULT_MAX_TOKENS = 65536
# Matches shorter than this are not drafted from: measured on the short edits (float32, ngram g=8), 2-token
# matches drafted twice as often as 3-token ones but were accepted for 0.8 tokens per round against 1.2, and
# the extra verify width cost what they added (benchmarks/ngram/README.md, "Earlier outputs").
HISTORY_N_MIN = 3


def output_history(history_tokens: int) -> "OutputHistory | None":
    """The history a generator keeps when asked for `history_tokens` (0: none)."""
    if not is_int(history_tokens) or history_tokens < 0:
        raise GenerationError(f"history tokens must be an int >= 0 (0 = off), not {history_tokens!r}")
    return OutputHistory(history_tokens) if history_tokens else None


class OutputHistory:
    """The most recent outputs, up to max_tokens tokens in all (the oldest whole outputs go first)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS):
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"the output history needs a positive number of tokens, not {max_tokens!r}")
        self.max_tokens = max_tokens
        self._outputs: deque[np.ndarray] = deque()
        self._size = 0
        self._flat = np.full(1, SEP, np.int64)
        self._keys = np.empty(0, np.int64)  # sorted bigram keys
        self._ends = np.empty(0, np.int64)  # where each key's bigram ends in _flat, ascending within a key

    @classmethod
    def of(cls, outputs, max_tokens: int = DEFAULT_MAX_TOKENS) -> "OutputHistory":
        history = cls(max_tokens)
        history.extend(outputs)
        return history

    def __len__(self) -> int:
        return self._size

    def add(self, tokens) -> None:
        """Remember one output (its last max_tokens tokens)."""
        self.extend([tokens])

    def extend(self, outputs) -> None:
        for tokens in outputs:
            t = np.asarray(tokens, np.int64)[-self.max_tokens:]
            if len(t) >= 3:  # a 2-token match and one token to draft
                self._outputs.append(t)
                self._size += len(t)
        while self._size > self.max_tokens:
            self._size -= len(self._outputs.popleft())
        self._reindex()

    def clear(self) -> None:
        self._outputs.clear()
        self._size = 0
        self._reindex()

    def _reindex(self) -> None:
        parts = [np.full(1, SEP, np.int64)]
        for t in self._outputs:
            parts += [t, parts[0]]
        flat = np.concatenate(parts)
        first, second = flat[:-1], flat[1:]
        valid = (first != SEP) & (second != SEP)
        keys = first[valid] * KEY_BASE + second[valid]
        order = np.argsort(keys, kind="stable")
        self._flat, self._keys, self._ends = flat, keys[order], (np.flatnonzero(valid) + 1)[order]

    def lookup(self, context: np.ndarray, k: int, n_min: int = HISTORY_N_MIN, n_max: int = 8) -> list[int]:
        """Up to k tokens that followed the most recent occurrence of the longest suffix of `context` (n_max down
        to n_min tokens, n_min >= 2) in the outputs; [] when none matches."""
        n_min = max(n_min, 2)
        if k < 1 or len(context) < n_min or not len(self._keys):
            return []
        key = int(context[-2]) * KEY_BASE + int(context[-1])
        lo, hi = np.searchsorted(self._keys, [key, key + 1])
        ends = self._ends[lo:hi]
        flat = self._flat
        ends = ends[flat[ends + 1] != SEP]  # something follows (flat ends in SEP: ends + 1 is in range)
        if not len(ends):
            return []
        matched = np.full(len(ends), 2, np.int64)
        alive = np.ones(len(ends), bool)
        for j in range(2, min(n_max, len(context))):
            before = ends - j
            alive &= before >= 0
            alive[alive] = flat[before[alive]] == context[-1 - j]
            if not alive.any():
                break
            matched += alive
        best = int(matched.max())
        if best < n_min:
            return []
        start = int(ends[matched == best][-1]) + 1  # the most recent of the longest matches
        continuation = flat[start:start + k]
        cut = np.flatnonzero(continuation == SEP)
        return continuation[:cut[0] if len(cut) else len(continuation)].tolist()
