"""Logit bias and repetition, presence and frequency penalties, applied to every verify row with that row's own
prefix.

A penalty makes the next token's law depend on the tokens before it. In a verify step row j follows the
committed text plus drafts 0..j-1 (a tree's row follows its node's ancestors), so row j is penalized as if
those drafts were already committed: exactly what plain decode would do at that position if they were. So
greedy speculation still equals plain greedy decode with the same penalties, and sampling still follows the
penalized target law (acceptance compares the drafts' q with these rows). A draft model's drafts are
penalized the same way, each with the round's drafts before it (proposers.Sampler), so a draft close to the
target stays close under penalties; exactness does not depend on it (any q keeps acceptance exact).

Definitions, applied in this order (vLLM's; HF `generate` has the first two, as `sequence_bias` with one-token
sequences and `repetition_penalty`):
* logit bias (OpenAI's `logit_bias`: token id -> a number in [-100, 100]): added to that token's logit in every
  row, whatever the prefix (-100 all but bans a token, 100 all but forces it);
* repetition (HF's and vLLM's `repetition_penalty`, > 0, 1 = off): every token that occurs in the prompt or
  the output so far has its logit divided by the penalty where positive and multiplied by it where negative;
* frequency and presence (OpenAI's `frequency_penalty` / `presence_penalty`, in [-2, 2], 0 = off): the logit
  of a token the output holds c > 0 times drops by c * frequency + presence. Prompt tokens do not count.

Shapes: R rows, V vocabulary entries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import GenerationError
from .sampling import SamplingParams, _is_real, is_int

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@dataclass(frozen=True)
class Penalties:
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def __post_init__(self) -> None:
        r = self.repetition
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}")
        for name, x in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not _is_real(x) or not math.isfinite(x) or not -2 <= x <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {x!r}")
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a mapping from token ids to numbers, got {bias!r}")
        for token, x in bias.items():
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            if not _is_real(x) or not math.isfinite(x) or not -MAX_LOGIT_BIAS <= x <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {x!r} for token {token}")

    @property
    def off(self) -> bool:
        return self.repetition == 1 and self.presence == 0 and self.frequency == 0 and not self.logit_bias

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a logit_bias token the model does not have (ValueError)."""
        outside = sorted(t for t in self.logit_bias if t >= vocab_size)
        if outside:
            raise ValueError(f"logit_bias token {outside[0]} is outside the vocabulary (ids 0..{vocab_size - 1})")


def sampling_settings(vocab_size: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                      frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None
                      ) -> tuple[SamplingParams, Penalties]:
    """A request's sampling parameters and penalties, checked against a vocabulary of `vocab_size` tokens
    (GenerationError: one message for the first bad value)."""
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        penalties = Penalties(repetition_penalty, presence_penalty, frequency_penalty,
                              {} if logit_bias is None else logit_bias)
        penalties.check_vocab(vocab_size)
    except ValueError as e:
        raise GenerationError(str(e)) from None
    return params, penalties


class PenaltyState:
    """What one sequence's penalties read: which tokens its prompt and output hold, and how often its output
    holds each. `commit` the output tokens as they are committed; `apply` penalizes verify rows."""

    def __init__(self, penalties: Penalties, vocab_size: int, prompt: list[int]):
        self.penalties = penalties
        self.seen = np.zeros(vocab_size, bool)  # in the prompt or the output
        self.counts = np.zeros(vocab_size, np.int64)  # in the output
        self.seen[np.asarray(prompt, np.int64)] = True
        bias = sorted(penalties.logit_bias.items())
        self.bias_ids = np.array([t for t, _ in bias], np.int64)
        self.bias = np.array([x for _, x in bias], np.float32)  # a float32 add, as plain decode's row gets

    def commit(self, tokens: list[int]) -> None:
        ids = np.asarray(tokens, np.int64)
        self.seen[ids] = True
        np.add.at(self.counts, ids, 1)

    def apply(self, logits: np.ndarray, prefixes: list[list[int]]) -> np.ndarray:
        """logits float [R, V]; prefixes[r]: the uncommitted tokens row r follows (drafts or ancestors).
        Penalizes in place when the array allows it; returns the logits.

        Each entry gets its bias, then one operation per penalty with its row's total (a row of a verify step and
        the plain decode row at the same position compute the same float32 numbers, as exact speculation
        needs)."""
        pen = self.penalties
        if pen.off:
            return logits
        if not logits.flags.writeable:
            logits = logits.copy()
        rows = len(prefixes)
        drafted = np.unique(np.concatenate([np.asarray(p, np.int64) for p in prefixes] + [np.zeros(0, np.int64)]))
        # in_prefix [R, n]: how often row r's prefix holds drafted token n
        in_prefix = np.zeros((rows, drafted.size), np.int64)
        for r, prefix in enumerate(prefixes):
            np.add.at(in_prefix[r], np.searchsorted(drafted, np.asarray(prefix, np.int64)), 1)
        width = logits.shape[-1]  # a draft's head may be narrower than the vocabulary: ids past it are not there
        if self.bias_ids.size:
            inside = self.bias_ids < width
            logits[:rows, self.bias_ids[inside]] += self.bias[inside].astype(logits.dtype)
        if pen.repetition != 1:
            ids = np.union1d(self._seen_ids(), drafted)
            hit = np.broadcast_to(self.seen[ids], (rows, ids.size)).copy()
            hit[:, np.searchsorted(ids, drafted)] |= in_prefix > 0
            ids, hit = ids[ids < width], hit[:, ids < width]
            x = logits[:rows, ids]
            logits[:rows, ids] = np.where(hit, np.where(x > 0, x / pen.repetition, x * pen.repetition), x)
        if pen.presence or pen.frequency:
            ids = np.union1d(self._output_ids(), drafted)
            count = np.broadcast_to(self.counts[ids], (rows, ids.size)).copy()
            count[:, np.searchsorted(ids, drafted)] += in_prefix
            ids, count = ids[ids < width], count[:, ids < width]
            # subtracting 0 leaves a float32 unchanged, so tokens a row has not seen keep their logit
            logits[:rows, ids] -= (count * pen.frequency + (count > 0) * pen.presence).astype(logits.dtype)
        return logits

    def _seen_ids(self) -> np.ndarray:
        return np.flatnonzero(self.seen)

    def _output_ids(self) -> np.ndarray:
        return np.flatnonzero(self.counts > 0)  # a bool scan: 10x faster than one over int64 counts
