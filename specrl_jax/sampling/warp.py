"""The one logits warp: temperature, then top-k, then top-p.

Plain sampling, speculative verification and RL log-probs all call ``warped_log_probs``
so that "the distribution the policy samples from" means exactly one thing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specrl_jax.config import SamplingParams

Array = jax.Array


def warped_log_probs(logits_NxV: Array, params: SamplingParams) -> Array:
  """float32 log-probabilities of the warped distribution over the last axis.

  Temperature 0 is greedy: a point mass on the argmax (first index on ties).
  Tokens removed by top-k / top-p get -inf.
  """
  logits = logits_NxV.astype(jnp.float32)
  vocab = logits.shape[-1]
  if params.greedy:
    argmax = jnp.argmax(logits, axis=-1)
    return jnp.where(jax.nn.one_hot(argmax, vocab, dtype=bool), 0.0, -jnp.inf)
  logits = logits / params.temperature
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


def sample_tokens(rng: Array, log_probs_NxV: Array) -> Array:
  """Draws one token per row from log-probabilities (int32)."""
  return jax.random.categorical(rng, log_probs_NxV, axis=-1).astype(jnp.int32)


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
