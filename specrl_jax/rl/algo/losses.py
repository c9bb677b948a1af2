"""The GRPO policy loss: clipped importance ratios, optional KL to a reference, and
optional truncated importance sampling for off-policy (async) rollouts.

Every aggregation mode is expressed as per-token weights that depend on the response
mask only, so ``loss = sum(weights * per_token_loss)``. Computing the weights once
over the full batch and summing over micro-batches then reproduces the full-batch
loss and gradient exactly, on any mesh and with any micro-batch count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from specrl_jax.config import ConfigError, check, is_finite_number

Array = jax.Array

# mask_BxT (float 0/1) and the config -> token weights [B, T] summing the per-token loss.
AggregationFn = Callable[[Array, "GRPOConfig"], Array]
AGGREGATIONS: dict[str, AggregationFn] = {}


def register_aggregation(name: str) -> Callable[[AggregationFn], AggregationFn]:
  """Registers an aggregation mode so ``GRPOConfig(aggregation=name)`` accepts it."""
  def register(function: AggregationFn) -> AggregationFn:
    if name in AGGREGATIONS:
      raise ValueError(f"aggregation {name!r} is already registered")
    AGGREGATIONS[name] = function
    return function
  return register


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
  """Policy loss hyper-parameters.

  clip_eps_low / clip_eps_high: the ratio is clipped to [1 - low, 1 + high]
    (DAPO's "clip-higher" uses high > low, e.g. 0.2 / 0.28).
  beta: weight of the k3 KL estimate to the reference policy (0 disables it).
  aggregation: a name in AGGREGATIONS.
  max_response_length: Dr.GRPO's constant normaliser; None uses the padded length T.
  tis_cap: truncated importance sampling between the trainer's old log-probs and the
    rollout engine's, weight min(pi_old / pi_rollout, cap); None disables it.
  normalize_std: the advantages the learner computes from a group's rewards: divided
    by the group's std (GRPO, True) or only centred (Dr.GRPO, False).
  """

  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  beta: float = 0.0
  aggregation: str = "token-mean"
  max_response_length: int | None = None
  tis_cap: float | None = None
  normalize_std: bool = True

  def __post_init__(self):
    owner = "GRPOConfig"
    check(is_finite_number(self.clip_eps_low) and 0 <= self.clip_eps_low < 1,
          owner, "clip_eps_low", self.clip_eps_low, "a number in [0, 1)")
    check(is_finite_number(self.clip_eps_high) and self.clip_eps_high >= 0,
          owner, "clip_eps_high", self.clip_eps_high, "a finite number >= 0")
    check(is_finite_number(self.beta) and self.beta >= 0, owner, "beta",
          self.beta, "a finite number >= 0 (0 disables the KL term)")
    check(self.aggregation in AGGREGATIONS, owner, "aggregation", self.aggregation,
          f"one of {sorted(AGGREGATIONS)}")
    length = self.max_response_length
    check(length is None or (isinstance(length, int) and not isinstance(length, bool)
                             and length > 0),
          owner, "max_response_length", length, "None or a positive integer")
    check(self.tis_cap is None or (is_finite_number(self.tis_cap) and self.tis_cap > 0),
          owner, "tis_cap", self.tis_cap, "None (no correction) or a finite number > 0")
    check(isinstance(self.normalize_std, bool), owner, "normalize_std", self.normalize_std,
          "True (GRPO) or False (Dr.GRPO)")


def aggregation_weights(mask_BxT: Array, config: GRPOConfig) -> Array:
  """Per-token weights [B, T] of the configured aggregation mode."""
  return AGGREGATIONS[config.aggregation](mask_BxT.astype(jnp.float32), config)


def valid_token_weights(mask_BxT: Array) -> Array:
  """Weights that turn a weighted sum into a mean over valid tokens (for metrics)."""
  mask_BxT = mask_BxT.astype(jnp.float32)
  return mask_BxT / jnp.maximum(mask_BxT.sum(), 1.0)


def k3_kl(logprobs_BxT: Array, ref_logprobs_BxT: Array) -> Array:
  """Schulman's k3 estimate of KL(pi || ref) per sampled token: non-negative, unbiased."""
  delta_BxT = ref_logprobs_BxT - logprobs_BxT
  return jnp.exp(delta_BxT) - delta_BxT - 1.0


def grpo_loss(logprobs: Array, old_logprobs: Array, advantages: Array, mask: Array, *,
              ref_logprobs: Array | None = None, rollout_logprobs: Array | None = None,
              config: GRPOConfig = GRPOConfig(), token_weights: Array | None = None,
              metric_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
  """Scalar GRPO loss and metrics.

  logprobs, old_logprobs, ref_logprobs, rollout_logprobs: float [B, T] log-probs of the
    sampled tokens under the current, old (ratio denominator), reference and rollout
    policies; only positions where ``mask`` [B, T] is true are read.
  advantages: float [B], one per sequence.
  token_weights / metric_weights: [B, T] weights from ``aggregation_weights`` /
    ``valid_token_weights`` of the *full* batch when this call sees one micro-batch;
    by default computed from ``mask``.

  Metrics are token means over valid tokens except ratio_max / ratio_min (see
  ``combine_metrics``): pg_loss, clip_fraction, ratio_mean, ratio_max, ratio_min,
  entropy (the Monte-Carlo estimate -log pi of sampled tokens), and kl when reference
  log-probs are given, is_weight_mean / is_capped_fraction when tis_cap is set.
  """
  valid_BxT = mask.astype(bool)
  if token_weights is None:
    token_weights = aggregation_weights(valid_BxT, config)
  if metric_weights is None:
    metric_weights = valid_token_weights(valid_BxT)

  def masked(x_BxT):
    # where, not multiply: padded positions may hold -inf log-probs (0 * inf = nan).
    return jnp.where(valid_BxT, x_BxT, 0.0)

  def token_mean(x_BxT):
    return jnp.sum(masked(x_BxT) * metric_weights)

  # From here on every padded position holds 0 log-probs: finite values and gradients.
  logprobs, old_logprobs = masked(logprobs), masked(old_logprobs)
  advantages_Bx1 = jnp.asarray(advantages, jnp.float32)[:, None]
  ratio_BxT = jnp.exp(logprobs - old_logprobs)
  clipped_ratio_BxT = jnp.clip(ratio_BxT, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
  unclipped_BxT = ratio_BxT * advantages_Bx1
  clipped_BxT = clipped_ratio_BxT * advantages_Bx1
  pg_BxT = -jnp.minimum(unclipped_BxT, clipped_BxT)
  metrics = {}

  if config.tis_cap is not None:
    if rollout_logprobs is None:
      raise ConfigError(f"GRPOConfig.tis_cap={config.tis_cap!r} corrects toward the "
                        "rollout policy: pass rollout_logprobs (the sampler's log-probs).")
    # Tokens were drawn from the rollout engine's policy (stale weights in async RL,
    # different numerics always), not pi_old: reweight toward pi_old, with a cap that
    # bounds the variance of rare large ratios.
    raw_weight_BxT = jnp.exp(old_logprobs - masked(rollout_logprobs))
    is_weight_BxT = jax.lax.stop_gradient(jnp.minimum(raw_weight_BxT, config.tis_cap))
    pg_BxT = pg_BxT * is_weight_BxT
    metrics["is_weight_mean"] = token_mean(is_weight_BxT)
    metrics["is_capped_fraction"] = token_mean((raw_weight_BxT > config.tis_cap)
                                               .astype(jnp.float32))

  per_token_BxT = pg_BxT
  if config.beta > 0 and ref_logprobs is None:
    raise ConfigError(f"GRPOConfig.beta={config.beta!r} needs the reference policy: "
                      "pass ref_logprobs.")
  if ref_logprobs is not None:
    kl_BxT = k3_kl(logprobs, masked(ref_logprobs))
    metrics["kl"] = token_mean(kl_BxT)
    if config.beta > 0:
      per_token_BxT = per_token_BxT + config.beta * kl_BxT

  loss = jnp.sum(masked(per_token_BxT) * token_weights)
  metrics.update(
      pg_loss=jnp.sum(masked(pg_BxT) * token_weights),
      clip_fraction=token_mean((clipped_BxT < unclipped_BxT).astype(jnp.float32)),
      ratio_mean=token_mean(ratio_BxT),
      ratio_max=jnp.max(jnp.where(valid_BxT, ratio_BxT, -jnp.inf)),
      ratio_min=jnp.min(jnp.where(valid_BxT, ratio_BxT, jnp.inf)),
      entropy=token_mean(-logprobs),
  )
  return loss, metrics


# How per-micro-batch metrics combine into full-batch ones; anything else was weighted
# by full-batch weights and sums.
METRIC_REDUCTIONS: dict[str, Callable[[Array], Array]] = {
    "ratio_max": jnp.max,
    "ratio_min": jnp.min,
    "logprob_mismatch_max": jnp.max,
}


def combine_metrics(stacked: dict[str, Array]) -> dict[str, Array]:
  """Full-batch metrics from metrics stacked over micro-batches (leading axis)."""
  return {name: METRIC_REDUCTIONS.get(name, jnp.sum)(values, axis=0)
          for name, values in stacked.items()}
