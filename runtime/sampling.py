"""Logits -> token distributions and tokens, for the target and the draft alike.

Speculative sampling is exact only if p (target) and q (draft) are the very distributions the tokens are
sampled from, so both sides go through the same `probs_from_logits` with the same `SamplingParams`.
Everything here is float64 numpy: the acceptance rule compares p and q entry by entry, and float32
softmax noise would show up there as a (tiny) bias.

Shapes: N rows (positions), V vocabulary entries.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def is_int(x: object) -> bool:
    """An integer (Python or numpy), not a bool: what every count and id argument of the runtime takes."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (argmax); top_k 0, top_p 1 and min_p 0 = off. Validated on construction."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not is_int(k) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}")
        if not _is_real(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a finite number in (0, 1] (1 = off), got {p!r}")
        m = self.min_p
        if not _is_real(m) or not math.isfinite(m) or not 0 <= m <= 1:
            raise ValueError(f"min_p must be a finite number in [0, 1] (0 = off), got {m!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _keep(probs: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """probs [N, V] (overwritten) with the entries outside `kept` [N, V] (bool) set to 0, renormalized: the
    softmax of the logits with those entries at -inf, without a second pass of exp."""
    probs = np.multiply(probs, kept, out=probs)  # in place: times 1 or exactly 0
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs


TOP_P_CANDIDATES = 256  # top-p sorts only this many largest entries per row while they hold the mass


def _top_p_floor(probs: np.ndarray, top_p: float, order: np.ndarray) -> np.ndarray:
    """probs [N, V] -> [N, 1]: the probability of the last token of the smallest top set with mass >= top_p
    (every token at least that likely is kept). A cumulative sum of the largest m entries in descending order
    is the first m terms of the full one, bit for bit, so sorting the m largest (O(V) to find them) gives the
    full sort's answer wherever their mass reaches top_p; other rows sort everything.

    order [N, V]: the scaled logits, which order the tokens as probs does (a larger one is at least as likely)
    and, unlike probs after top-k, are not mostly equal zeros, on which partitioning is 8x slower."""
    v = probs.shape[-1]
    m = min(v, TOP_P_CANDIDATES)
    largest = np.argpartition(order, v - m, axis=-1)[:, v - m:]
    desc = -np.sort(-np.take_along_axis(probs, largest, axis=-1), axis=-1)
    cut = (np.cumsum(desc, axis=-1) < top_p).sum(axis=-1)
    short = cut >= m  # the m largest hold less than top_p
    if short.any():
        full = -np.sort(-probs[short], axis=-1)
        # Tokens before the one where the running mass first reaches top_p; min() covers a total that
        # rounds below top_p (then everything is kept).
        full_cut = np.minimum((np.cumsum(full, axis=-1) < top_p).sum(axis=-1), v - 1)
        floor = np.empty(len(probs))
        floor[short] = full[np.arange(len(full)), full_cut]
        floor[~short] = desc[~short, cut[~short]]
        return floor[:, None]
    return desc[np.arange(len(desc)), cut][:, None]


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits float [N, V] (or [V]) -> probs float64, same shape, each row summing to 1.

    Order as in HF transformers' generate: temperature, top-k, top-p on the top-k distribution, then min-p on
    what is left (llama.cpp's and vLLM's min_p: tokens less likely than min_p times the top token go).
    -inf logits are allowed (masked tokens, probability 0); NaN, +inf and all -inf rows are errors.

    Ties are kept whole, so the kept set depends only on the values, never on token ids or sort order:
      top-k keeps every token whose logit >= the k-th largest (more than k survive on a tie at the k-th
        value; this is also HF's TopKLogitsWarper rule); top_k >= V keeps everything.
      top-p keeps every token whose probability >= that of the last token of the smallest top set with
        mass >= top_p (ties with that last token are kept too), so the top token always survives.
    """
    if params.greedy:
        raise ValueError("probs_from_logits needs temperature > 0; use greedy_token(s) for temperature 0")
    x = np.array(logits, dtype=np.float64)  # a copy: shifted and scaled in place below
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"logits must be [N, V] or [V] with V > 0, got shape {x.shape}")
    shape, v = x.shape, x.shape[-1]
    x = x.reshape(-1, v)
    top = x.max(axis=-1, keepdims=True)  # NaN if the row holds one, +inf for +inf, -inf for a row of -inf
    if not np.isfinite(top).all():
        raise ValueError("logits must be finite or -inf, with at least one finite entry per row")

    # Shift before dividing: the same softmax, but now x <= 0 with 0 at the top, so a tiny temperature can
    # only overflow to -inf (probability 0, as the math says) instead of making inf - inf = NaN, and exp
    # needs no further shift.
    x -= top
    with np.errstate(over="ignore"):
        x /= params.temperature
    top_k = 0 < params.top_k < v
    if top_k:
        in_top_k = x >= np.partition(x, v - params.top_k, axis=-1)[:, v - params.top_k, None]
    probs = np.exp(x)  # (exp is several times slower on -inf entries: the top-k mask comes after it)
    probs = _keep(probs, in_top_k) if top_k else np.divide(probs, probs.sum(axis=-1, keepdims=True), out=probs)
    if params.top_p < 1:
        probs = _keep(probs, probs >= _top_p_floor(probs, params.top_p, x))
    if params.min_p > 0:  # the top token always stays: its probability is the maximum
        probs = _keep(probs, probs >= params.min_p * probs.max(axis=-1, keepdims=True))
    return probs.reshape(shape)


def hold_back(logits: np.ndarray, positions: np.ndarray, min_new_tokens: int, ids) -> np.ndarray:
    """min_new_tokens (HF generate's, vLLM's min_tokens): the stop ids cannot be chosen before the output has
    that many tokens. logits float [N, V]; positions int [N]: which new token (0 = the first) row n chooses.
    Sets those ids to -inf in the rows whose position is below min_new_tokens, in place when the array
    allows it; returns the logits.

    Applied to the target's verify rows before acceptance, the held-back law is the one that plain decode
    and acceptance both see: greedy speculation still equals plain decode, and sampling still follows the
    (held-back) target distribution. A draft that proposes a held-back id is simply rejected there."""
    rows = np.flatnonzero(np.asarray(positions) < min_new_tokens)
    ids = [int(i) for i in ids]  # any iterable (the stop set); np.ix_ needs a sequence
    if rows.size == 0 or not ids:
        return logits
    if not logits.flags.writeable:
        logits = logits.copy()
    logits[np.ix_(rows, ids)] = -np.inf
    return logits


def emittable_drafts(drafts, first_position: int, min_new_tokens: int, ids) -> int:
    """How many drafts of a chain could be emitted under hold_back: draft i would be output token
    first_position + i, and a stop id there has probability 0, so it (and every draft after it, which the
    target only sees once it is accepted) would be rejected. The loop verifies only the drafts before it:
    the same output, a smaller verify step. (Cutting is exact for sampling too: acceptance is exact for
    any chain.)"""
    held = set(int(i) for i in ids)
    for i, token in enumerate(drafts):
        if first_position + i >= min_new_tokens:
            break
        if int(token) in held:
            return i
    return len(drafts)


def emittable_nodes(tokens, parents, first_position: int, min_new_tokens: int, ids) -> list[int]:
    """The nodes of a token tree (runtime/tree.py) that hold_back lets through: node i would be output token
    first_position + depth(i) - 1, and a held-back stop id there, with everything under it, would be rejected
    (emittable_drafts for chains). Returns the kept node indices, in order."""
    held = set(int(i) for i in ids)
    depth, kept = [0] * len(tokens), [True] * len(tokens)
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        depth[i] = 1 if parent == 0 else depth[parent - 1] + 1
        ancestor_kept = parent == 0 or kept[parent - 1]
        blocked = first_position + depth[i] - 1 < min_new_tokens and int(token) in held
        kept[i] = ancestor_kept and not blocked
    return [i for i, k in enumerate(kept) if k]


def greedy_token(logits_row: np.ndarray) -> int:
    """argmax of one row float [V]; ties go to the lowest id (np.argmax returns the first maximum)."""
    row = np.asarray(logits_row)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"logits_row must be 1-D and non-empty, got shape {row.shape}")
    return int(np.argmax(row))


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """logits float [N, V] -> int64 [N], row-wise argmax, lowest id on ties (as greedy_token)."""
    x = np.asarray(logits)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"logits must be [N, V] with V > 0, got shape {x.shape}")
    return np.argmax(x, axis=-1).astype(np.int64)


def _sample_cdf(cdf: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from cdf float [V], the cumsum of non-negative weights with a positive total.

    Unnormalized weights are fine (u is scaled by the total), so callers pass residuals as they are.
    """
    total = cdf[-1]
    # side="right" finds the first i with cdf[i] > u. A zero-weight token has cdf[i] == cdf[i-1] exactly
    # (adding 0.0 is exact), so cdf[i] > u would imply cdf[i-1] > u and i-1 is found first: never returned.
    i = int(cdf.searchsorted(rng.random() * total, "right"))  # positional: the keyword costs ~0.3 us
    if i == len(cdf):
        # u * total rounded up to total (possible only for a subnormal total, or an rng that returns 1.0):
        # return the last positive token, where the cdf first reaches total.
        i = int(cdf.searchsorted(total, "left"))
    return i


def sample_token(probs_row: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from probs float [V] (non-negative, positive sum; normalization not required)
    with a single rng.random(). A zero-probability token is never returned."""
    w = np.asarray(probs_row, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"probs_row must be 1-D and non-empty, got shape {w.shape}")
    if not (w >= 0).all():  # also catches NaN
        raise ValueError("probs_row must be non-negative and not NaN")
    cdf = np.add.accumulate(w)
    if not 0 < cdf[-1] < math.inf:
        raise ValueError(f"probs_row must have a positive finite sum, got {cdf[-1]}")
    return _sample_cdf(cdf, rng)
