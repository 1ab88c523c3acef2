"""Which drafted tokens to keep: exact speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A round drafts K tokens d_0..d_{K-1}. The target scores the context plus all drafts in one step and gives
K+1 rows: row j is its next-token prediction after the context and d_<j, so row j judges d_j, and row K
follows the last draft. A round emits its n_accepted leading drafts plus one token of the target's own:

  recovered token  from row n_accepted, after the first rejection (n_accepted < K)
  bonus token      from row K, when all K drafts are accepted

so every round makes progress, and the emitted tokens are distributed exactly as if the target had
produced them alone (greedy: identical to greedy decoding). Names follow vLLM v1's rejection_sampler.py.

Edge cases of `accept_sampling` (the rule is exact only for d_j ~ q_j; each case keeps that or its limit):

  q(d) == 0  A token with zero draft probability is never sampled (see sample_token), so this only comes
             from a caller whose q is not quite what it sampled from (a float32 vs float64 softmax, an
             underflow). We take the limit of min(1, p/eps) as eps -> 0: accept iff p(d) > 0. The
             division-free test u * q < p gives exactly that with no special case. Rejecting instead would
             be wrong in that limit and bias the output away from d.
  p(d) == 0  u * q < 0 is never true: always rejected, and max(p - q, 0) is 0 at d, so the recovered
             token can't be d either. A token the target forbids is never emitted.
  residual   max(p - q, 0) sums to the rejection probability, sum_x max(q(x) - p(x), 0) (equal up to the
  ~ 0        rounding of the row sums). When it is 0 or below _RESIDUAL_EPS (p == q up to float error,
             where a rejection needs u within an ulp of 1), the normalized residual is noise or 0/0, and we
             sample from p instead. That branch is taken with probability ~ the residual's sum, so the
             choice moves the output distribution by at most ~_RESIDUAL_EPS in total variation (this bound
             also covers q = None, whose residual is exact but may be that small); and p, unlike the
             noise, never puts mass on a token the target forbids. As q -> p the rejection branch
             vanishes, so this is exact in the limit.
  q = None   A deterministic proposer (n-gram, prompt lookup, greedy draft): q_j is a point mass on d_j.
             Accept iff u < p(d); the residual max(p - onehot(d), 0) is p with d zeroed, renormalized:
             p(d) + (1 - p(d)) * 0 = p(d) for d and (1 - p(d)) * p(x) / (1 - p(d)) = p(x) elsewhere.
"""
from __future__ import annotations

import numpy as np

from .sampling import _sample_cdf, greedy_tokens

_cumsum = np.add.accumulate  # cumsum of a 1-D row with less per-call overhead than ndarray.cumsum

# A residual whose mass is at most this is treated as rounding noise (see the module notes). Float64
# softmax rows of the same logits agree to a few ulps per entry, i.e. ~1e-15 of total mass; this leaves a
# wide margin yet bounds the distribution error far below anything measurable.
_RESIDUAL_EPS = 1e-12


def _check(draft_tokens, target: np.ndarray, name: str, draft_probs=None):
    """Validate shapes and token range; returns (drafts as a list of ints, target [K+1, V], q or None)."""
    tokens = np.asarray(draft_tokens)
    if tokens.ndim != 1 or (tokens.dtype.kind not in "iu" and tokens.size):
        raise ValueError(f"draft_tokens must be a 1-D int array [K], got shape {tokens.shape} {tokens.dtype}")
    toks = tokens.tolist()
    k = len(toks)
    target = np.asarray(target)
    shape = target.shape
    if len(shape) != 2 or shape[0] != k + 1 or shape[1] == 0:
        raise ValueError(f"{name} must be [K+1, V] = [{k + 1}, V] for K={k} drafts, got shape {shape}")
    v = shape[1]
    if draft_probs is not None:
        draft_probs = np.asarray(draft_probs)
        if draft_probs.shape != (k, v) and not (k == 0 and draft_probs.size == 0):  # K=0: any empty q
            raise ValueError(f"draft_probs must be [K, V] = [{k}, {v}] to match {name}, "
                             f"got {draft_probs.shape}")
    for t in toks:
        if not 0 <= t < v:
            raise ValueError(f"draft_tokens must be in [0, V={v}), got {toks}")
    return toks, target, draft_probs


def accept_greedy(draft_tokens: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """Greedy verification: keep drafts while each equals the target's argmax.

    draft_tokens   int   [K]      K may be 0
    target_logits  float [K+1, V] row j judges draft j
    returns (n_accepted, next_token): next_token is the argmax of row n_accepted, the recovered token
    after the first mismatch or the bonus token when all K match. Ties: lowest id (greedy_tokens).
    """
    toks, target_logits, _ = _check(draft_tokens, target_logits, "target_logits")
    argmax = greedy_tokens(target_logits)  # [K+1]; rows past the first mismatch are wasted, but it's one call
    mismatch = np.flatnonzero(argmax[:-1] != np.asarray(toks, dtype=np.int64))
    n_accepted = int(mismatch[0]) if mismatch.size else len(toks)
    return n_accepted, int(argmax[n_accepted])


def accept_sampling(
    draft_tokens: np.ndarray,
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Speculative sampling: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), scanning from the front.

    draft_tokens  int   [K]       d_j ~ q_j, K may be 0
    draft_probs   float [K, V]    q: the distributions the drafts were sampled from (same SamplingParams as p)
                  or None         deterministic proposer: q_j is a point mass on d_j
    target_probs  float [K+1, V]  p: row j judges d_j, row K gives the bonus token
    rng           only rng.random() is called: once per judged draft, once for next_token
    returns (n_accepted, next_token): next_token is the recovered token ~ norm(max(p_j - q_j, 0)) at the
    first rejection j = n_accepted, or the bonus token ~ p_K when all K are accepted.
    The rows must be distributions (non-negative, summing to 1, e.g. from probs_from_logits); only shapes
    and token range are checked, as a per-token O(V) scan would cost more than the rule.
    """
    toks, p, q = _check(draft_tokens, target_probs, "target_probs", draft_probs)
    # A plain loop over K (small) with scalar reads: per-call numpy overhead, not arithmetic, is the cost.
    for j, d in enumerate(toks):
        q_d = 1.0 if q is None else q[j, d]
        # u < p / q  <=>  u * q < p: no division, and q == 0 means accept iff p > 0 (module notes).
        if rng.random() * q_d < p[j, d]:
            continue
        if q is None:
            residual = np.array(p[j], dtype=np.float64)  # max(p - onehot(d), 0): p with d zeroed
            residual[d] = 0.0
        else:
            residual = np.maximum(p[j] - q[j], 0.0)
        cdf = _cumsum(residual)
        if cdf[-1] <= _RESIDUAL_EPS:  # 0 or rounding noise: fall back to p (module notes)
            cdf = _cumsum(p[j])
        return j, _sample_cdf(cdf, rng)
    return len(toks), _sample_cdf(_cumsum(p[-1]), rng)


def output_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Exact distribution of the first token a one-draft round emits, d ~ q judged against p ([V] each):

        P(x) = q(x) min(1, p(x)/q(x))  +  P(reject) norm(max(p - q, 0))(x)
             = min(p, q)(x)            +  (1 - sum min(p, q)) norm(max(p - q, 0))(x)   =  p(x)

    since max(p - q, 0) sums to 1 - sum min(p, q). No randomness; the residual fallback is accept_sampling's.
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if p.ndim != 1 or p.shape != q.shape or p.size == 0:
        raise ValueError(f"p and q must be 1-D of the same length V > 0, got {p.shape} and {q.shape}")
    accepted = np.minimum(p, q)
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    recovered = p / p.sum() if total <= _RESIDUAL_EPS else residual / total
    return accepted + (1.0 - accepted.sum()) * recovered
