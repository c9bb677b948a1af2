"""Trainer-side log-probs of response tokens, under the sampler's exact warp.

Rows are prompt + response, right-padded, with positions 0..T-1: the layout the
sampler saw, so causal attention never lets a real token see padding and no
attention mask is needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specrl_jax.config import SamplingParams
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.warp import warped_log_probs

Array = jax.Array


def token_log_probs(logits_BxTxV: Array, tokens_BxT: Array, response_mask_BxT: Array,
                    sampling: SamplingParams) -> Array:
  """float32 [B, T]: log p(tokens[:, t] | tokens[:, :t]) at response positions, else 0.

  Logits at t predict token t + 1; the result is aligned with ``tokens_BxT`` so the
  response mask indexes it directly. Position 0 has no prediction and is never a
  response token. The warp (temperature, top-k, top-p) is the rollout's, so these are
  the log-probs of the distribution the sampler drew from.
  """
  log_probs_BxTxV = warped_log_probs(logits_BxTxV[:, :-1], sampling)
  next_tokens_BxT = tokens_BxT[:, 1:]
  picked_BxT = jnp.take_along_axis(log_probs_BxTxV, next_tokens_BxT[..., None], axis=-1)[..., 0]
  picked_BxT = jnp.pad(picked_BxT, ((0, 0), (1, 0)))
  # where, not multiply: a padding token outside top-k/top-p has log-prob -inf.
  return jnp.where(response_mask_BxT.astype(bool), picked_BxT, 0.0)


def policy_log_probs(model: Transformer, tokens_BxT: Array, response_mask_BxT: Array,
                     sampling: SamplingParams) -> Array:
  """Per-token response log-probs [B, T] of ``model`` (one causal forward)."""
  logits_BxTxV = model.forward(tokens_BxT).logits
  return token_log_probs(logits_BxTxV, tokens_BxT, response_mask_BxT, sampling)
