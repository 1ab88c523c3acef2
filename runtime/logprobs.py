"""Log-probabilities of the committed tokens, from the target's rows that chose them.

Each committed token was judged by one target row (a verify step's row j for the j-th token of a round, a tree
row for a path node). Those rows equal plain decode's rows bit for bit (position consistency, docs/bundle.md),
so speculation reports the logprobs plain decode would. They are the model's own distribution: log-softmax of
the raw logits, before temperature, top-k/top-p/min-p, penalties and min_new_tokens (vLLM's default
`raw_logprobs`), so they do not depend on how the token was picked.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import GenerationError
from .sampling import is_int

MAX_TOP = 20  # as OpenAI's top_logprobs


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens, most likely first (ties: lower id first)

    def to_json(self) -> dict:
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}


def check_logprobs(top: int | None) -> None:
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_TOP):
        raise GenerationError(f"logprobs must be an int in 0..{MAX_TOP} (the alternatives per token) or None, "
                              f"not {top!r}")


def token_logprobs(rows: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """rows float [n, V'] (V' >= the vocabulary; the rows that chose tokens [n]); top: alternatives per token."""
    x = np.asarray(rows, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))  # [n, V']
    out = []
    for row, token in zip(logp, tokens):
        best = []
        if top:
            # the top values, then ties by id: lexsort's last key is the primary one
            ids = np.argpartition(-row, top - 1)[:top] if top < row.size else np.arange(row.size)
            kth = row[ids].min()
            ids = np.flatnonzero(row >= kth)
            ids = ids[np.lexsort((ids, -row[ids]))][:top]
            best = [(int(i), float(row[i])) for i in ids]
        out.append(TokenLogprob(int(token), float(row[token]), best))
    return out
