"""The one logits warp: temperature, then top-k, then top-p.

Plain sampling, speculative verification and RL log-probs all call ``warped_log_probs``
so that "the distribution the policy samples from" means exactly one thing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import SamplingParams

Array = jax.Array


def warped_log_probs(logits_NxV: Array, params: SamplingParams) -> Array:
  """float32 log-probabilities of the warped distribution over the last axis.

  Temperature 0 is greedy: a point mass on the argmax (first index on ties).
  Tokens removed by top-k / top-p get -inf. Every temperature > 0 is stable, however
  small: the distribution tends to greedy's and the top token's log-prob stays finite.
  """
  logits = logits_NxV.astype(jnp.float32)
  vocab = logits.shape[-1]
  if params.greedy:
    return jnp.where(jax.nn.one_hot(first_argmax(logits), vocab, dtype=bool), 0.0, -jnp.inf)
  logits = divide_by_temperature(logits, params.temperature)
  if 0 < params.top_k < vocab:
    kth_largest = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
  if params.top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    # Keep the smallest prefix reaching top_p: a token stays while the mass strictly
    # before it is below top_p (so the top token always stays).
    keep_sorted = mass_before < params.top_p
    keep = jnp.zeros_like(keep_sorted).at[
        tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.nn.log_softmax(logits, axis=-1)


def divide_by_temperature(logits_NxV: Array, temperature: float) -> Array:
  """logits / temperature, shifted so that each row's largest entry is 0.

  Dividing first overflows for tiny temperatures (1e-30: every logit +-inf, then NaN
  log-probs), and a temperature below float32's smallest normal number is flushed to 0
  under jit (1e-45: 0 / 0). After the shift the top token is 0 whatever the scale and
  the others only fall towards -inf; below the normal range the scale is float32's
  largest, which already leaves only ties with the top token any mass.
  """
  shifted_NxV = logits_NxV - jnp.max(logits_NxV, axis=-1, keepdims=True)
  if temperature < np.finfo(np.float32).tiny:
    return shifted_NxV * np.finfo(np.float32).max
  return shifted_NxV / temperature


def first_argmax(x_NxV: Array) -> Array:
  """Index of the largest entry of each row, the first one on ties (int32).

  Same result as jnp.argmax; two plain reductions are several times faster on CPU than
  XLA's variadic (value, index) reduce.
  """
  largest_Nx1 = jnp.max(x_NxV, axis=-1, keepdims=True)
  index_V = jnp.arange(x_NxV.shape[-1], dtype=jnp.int32)
  first_N = jnp.min(jnp.where(x_NxV == largest_Nx1, index_V, x_NxV.shape[-1]), axis=-1)
  return jnp.minimum(first_N, x_NxV.shape[-1] - 1)  # an all-NaN row has no match


def sample_from_probs(rng: Array, probs_NxV: Array) -> Array:
  """Draws one token per row from non-negative weights (normalised or not) by inverting
  the CDF with one uniform per row (int32).

  Token i is drawn when cdf[i-1] <= u * total < cdf[i], so zero-weight tokens are never
  drawn; the clamp to the last positive-weight token covers u * total rounding up to
  the total. One uniform per row instead of V Gumbel draws makes this several times
  cheaper than jax.random.categorical at large vocabularies.
  """
  cdf_NxV = jnp.cumsum(probs_NxV.astype(jnp.float32), axis=-1)
  total_Nx1 = cdf_NxV[:, -1:]
  uniform_Nx1 = jax.random.uniform(rng, total_Nx1.shape, jnp.float32)
  drawn_N = jnp.sum(cdf_NxV <= uniform_Nx1 * total_Nx1, axis=-1, dtype=jnp.int32)
  last_positive_N = jnp.sum(cdf_NxV < total_Nx1, axis=-1, dtype=jnp.int32)
  return jnp.minimum(drawn_N, last_positive_N)


def sample_tokens(rng: Array, log_probs_NxV: Array, params: SamplingParams | None = None
                  ) -> Array:
  """Draws one token per row from warped log-probabilities (int32). With greedy params
  the distribution is a point mass and the draw is its argmax (no randomness spent)."""
  if params is not None and params.greedy:
    return first_argmax(log_probs_NxV)
  return sample_from_probs(rng, jnp.exp(log_probs_NxV))


def proposal_log_probs(logits_NxV: Array, params: SamplingParams) -> Array:
  """The distribution q a drafter proposes from.

  Verification is exact for any q, but acceptance is highest when q matches the
  target's warped distribution, so drafters use the same warp. A greedy target is the
  exception: a point-mass q would rank only one candidate, so q keeps the drafter's
  plain softmax to order tree children.
  """
  if params.greedy:
    return jax.nn.log_softmax(logits_NxV.astype(jnp.float32), axis=-1)
  return warped_log_probs(logits_NxV, params)
