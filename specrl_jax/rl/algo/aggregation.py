"""Loss aggregation: how per-token losses sum into one scalar.

Every mode is expressed as per-token weights that depend on the response mask only, so
``loss = sum(weights * per_token_loss)``. Computing the weights once over the full
batch and summing over micro-batches then reproduces the full-batch loss and gradient
exactly, on any mesh and with any micro-batch count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from specrl_jax.rl.algo.registry import registrar

if TYPE_CHECKING:
  from specrl_jax.rl.algo.losses import GRPOConfig

Array = jax.Array

# mask_BxT (float 0/1) and the config -> token weights [B, T] summing the per-token loss.
AggregationFn = Callable[[Array, "GRPOConfig"], Array]
AGGREGATIONS: dict[str, AggregationFn] = {}
register_aggregation = registrar("aggregation", AGGREGATIONS)
register_aggregation.__doc__ = (
    "Registers an aggregation mode so ``GRPOConfig(aggregation=name)`` accepts it.")


@register_aggregation("token-mean")
def _token_mean(mask_BxT: Array, config: "GRPOConfig") -> Array:
  """DAPO: every valid token in the batch counts equally, so long answers are not
  down-weighted per token."""
  del config
  return mask_BxT / jnp.maximum(mask_BxT.sum(), 1.0)


@register_aggregation("seq-mean-token-mean")
def _seq_mean_token_mean(mask_BxT: Array, config: "GRPOConfig") -> Array:
  """Original GRPO: mean over each sequence's tokens, then over sequences. A sequence
  with no valid token has no mean and is left out of the mean over sequences."""
  del config
  lengths_B = mask_BxT.sum(axis=1)
  sequences = jnp.maximum((lengths_B > 0).sum(), 1)
  return mask_BxT / jnp.maximum(lengths_B, 1.0)[:, None] / sequences


@register_aggregation("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(mask_BxT: Array, config: "GRPOConfig") -> Array:
  """Dr.GRPO: per-sequence token sum over a constant length, then the mean over all
  sequences. Constant normalisers remove GRPO's length bias; an empty sequence sums
  to zero and still counts in the mean."""
  batch, length = mask_BxT.shape
  norm_length = config.max_response_length or length
  return mask_BxT / (norm_length * batch)


def aggregation_weights(mask_BxT: Array, config: "GRPOConfig") -> Array:
  """Per-token weights [B, T] of the configured aggregation mode."""
  return AGGREGATIONS[config.aggregation](mask_BxT.astype(jnp.float32), config)


def valid_token_weights(mask_BxT: Array) -> Array:
  """Weights that turn a weighted sum into a mean over valid tokens (for metrics)."""
  mask_BxT = mask_BxT.astype(jnp.float32)
  return mask_BxT / jnp.maximum(mask_BxT.sum(), 1.0)
