"""The policy loss: a registered objective (GRPO's clipped ratios, GSPO, CISPO), optional
KL to a reference, and optional truncated importance sampling for off-policy (async)
rollouts, summed with a registered aggregation's per-token weights.

Objectives live in ``rl.algo.objectives``, aggregation modes in ``rl.algo.aggregation``
and advantage estimators in ``rl.algo.advantages``; ``GRPOConfig`` names one of each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from specrl_jax.config import ConfigError, check, is_finite_number
from specrl_jax.rl.algo.advantages import ADVANTAGES
from specrl_jax.rl.algo.aggregation import AGGREGATIONS, aggregation_weights, valid_token_weights
from specrl_jax.rl.algo.objectives import OBJECTIVES

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
  """Policy loss hyper-parameters; docs/objectives.md has each choice's formula.

  objective: a name in ``objectives.OBJECTIVES``: "grpo" (clipped token ratios: GRPO,
    DAPO, Dr.GRPO), "gspo" (clipped sequence ratios), "cispo" (truncated stop-gradient
    token weights).
  advantage: a name in ``advantages.ADVANTAGES``: "group-normalized" (GRPO: divided by
    the group's std) or "group-centered" (Dr.GRPO: only centred).
  clip_eps_low / clip_eps_high: the ratio is clipped to [1 - low, 1 + high]
    (DAPO's "clip-higher" uses high > low, e.g. 0.2 / 0.28); CISPO truncates its
    weights at 1 + high only.
  beta: weight of the k3 KL estimate to the reference policy (0 disables it).
  aggregation: a name in ``aggregation.AGGREGATIONS``.
  max_response_length: Dr.GRPO's constant normaliser; None uses the padded length T.
  tis_cap: truncated importance sampling between the trainer's old log-probs and the
    rollout engine's, weight min(pi_old / pi_rollout, cap); None disables it.
  """

  objective: str = "grpo"
  advantage: str = "group-normalized"
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  beta: float = 0.0
  aggregation: str = "token-mean"
  max_response_length: int | None = None
  tis_cap: float | None = None

  def __post_init__(self):
    owner = "GRPOConfig"
    check(self.objective in OBJECTIVES, owner, "objective", self.objective,
          f"one of {sorted(OBJECTIVES)} (or a name given to register_objective)")
    check(self.advantage in ADVANTAGES, owner, "advantage", self.advantage,
          f"one of {sorted(ADVANTAGES)} (or a name given to register_advantage)")
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


def k3_kl(logprobs_BxT: Array, ref_logprobs_BxT: Array) -> Array:
  """Schulman's k3 estimate of KL(pi || ref) per sampled token: non-negative, unbiased."""
  delta_BxT = ref_logprobs_BxT - logprobs_BxT
  return jnp.exp(delta_BxT) - delta_BxT - 1.0


def grpo_loss(logprobs: Array, old_logprobs: Array, advantages: Array, mask: Array, *,
              ref_logprobs: Array | None = None, rollout_logprobs: Array | None = None,
              config: GRPOConfig = GRPOConfig(), token_weights: Array | None = None,
              metric_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
  """Scalar policy loss (``config.objective``) and metrics.

  logprobs, old_logprobs, ref_logprobs, rollout_logprobs: float [B, T] log-probs of the
    sampled tokens under the current, old (ratio denominator), reference and rollout
    policies; only positions where ``mask`` [B, T] is true are read.
  advantages: float [B], one per sequence.
  token_weights / metric_weights: [B, T] weights from ``aggregation_weights`` /
    ``valid_token_weights`` of the *full* batch when this call sees one micro-batch;
    by default computed from ``mask``.

  Metrics are token means over valid tokens except ratio_max / ratio_min (see
  ``combine_metrics``): pg_loss, clip_fraction (tokens the objective clipped or
  truncated), ratio_mean, ratio_max, ratio_min (the token ratios pi / pi_old),
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
  terms = OBJECTIVES[config.objective](logprobs, old_logprobs,
                                       jnp.asarray(advantages, jnp.float32), valid_BxT,
                                       config)
  pg_BxT = terms.pg_BxT
  ratio_BxT = jnp.exp(logprobs - old_logprobs)  # per token whatever the objective
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
      clip_fraction=token_mean(terms.clipped_BxT),
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
