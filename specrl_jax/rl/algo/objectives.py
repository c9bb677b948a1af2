"""Policy objectives: the per-token policy-gradient loss from the current and old
log-probs of the sampled tokens and each sequence's advantage.

An objective returns per-token terms; ``losses.grpo_loss`` adds what every objective
shares (truncated importance sampling toward the rollout policy, the KL penalty) and
sums the tokens with the aggregation weights. An objective that works per sequence
(GSPO) broadcasts its sequence value over the sequence's tokens, so every aggregation
mode, micro-batching and sharding apply to it unchanged: a sequence's value depends on
its own row only, and micro-batches split whole rows.

Inputs (``ObjectiveFn``): logprobs_BxT, old_logprobs_BxT (0 at padded positions, never
-inf), advantages_B, valid_BxT (bool response mask) and the ``GRPOConfig``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from specrl_jax.rl.algo.registry import registrar

if TYPE_CHECKING:
  from specrl_jax.rl.algo.losses import GRPOConfig

Array = jax.Array


class ObjectiveTerms(NamedTuple):
  """pg_BxT: the per-token policy-gradient loss (minimised); clipped_BxT: float 0/1,
  where clipping or truncation changed the token's term (the ``clip_fraction``
  metric)."""
  pg_BxT: Array
  clipped_BxT: Array


ObjectiveFn = Callable[[Array, Array, Array, Array, "GRPOConfig"], ObjectiveTerms]
OBJECTIVES: dict[str, ObjectiveFn] = {}
register_objective = registrar("objective", OBJECTIVES)
register_objective.__doc__ = (
    "Registers a policy objective so ``GRPOConfig(objective=name)`` accepts it.")


def _clip_bounds(config: "GRPOConfig") -> tuple[float, float]:
  return 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high


def _clipped_surrogate(ratio: Array, advantages: Array, config: "GRPOConfig"
                       ) -> ObjectiveTerms:
  """PPO's pessimistic bound -min(r A, clip(r) A), for ratios and advantages of one
  shape (per token or per sequence)."""
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, *_clip_bounds(config)) * advantages
  return ObjectiveTerms(pg_BxT=-jnp.minimum(unclipped, clipped),
                        clipped_BxT=(clipped < unclipped).astype(jnp.float32))


@register_objective("grpo")
def _grpo(logprobs_BxT: Array, old_logprobs_BxT: Array, advantages_B: Array,
          valid_BxT: Array, config: "GRPOConfig") -> ObjectiveTerms:
  """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300), also DAPO's and
  Dr.GRPO's objective: PPO's clipped surrogate per token, ratio pi / pi_old of each
  sampled token. DAPO (Yu et al. 2025, arXiv:2503.14476) differs in the bounds
  (clip-higher: clip_eps_high > clip_eps_low) and the aggregation (token-mean),
  Dr.GRPO (Liu et al. 2025) in the aggregation and the advantages (group-centered),
  not here."""
  del valid_BxT
  ratio_BxT = jnp.exp(logprobs_BxT - old_logprobs_BxT)
  return _clipped_surrogate(ratio_BxT, advantages_B[:, None], config)


def sequence_log_ratio(logprobs_BxT: Array, old_logprobs_BxT: Array,
                       valid_BxT: Array) -> Array:
  """[B]: the mean over each sequence's valid tokens of log pi - log pi_old, 0 for a
  sequence with none: the log of GSPO's length-normalised sequence ratio."""
  valid_BxT = valid_BxT.astype(jnp.float32)
  total_B = jnp.sum((logprobs_BxT - old_logprobs_BxT) * valid_BxT, axis=1)
  return total_B / jnp.maximum(valid_BxT.sum(axis=1), 1.0)


@register_objective("gspo")
def _gspo(logprobs_BxT: Array, old_logprobs_BxT: Array, advantages_B: Array,
          valid_BxT: Array, config: "GRPOConfig") -> ObjectiveTerms:
  """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071;
  TRL's ``importance_sampling_level="sequence"``): the clipped surrogate on one ratio per
  sequence, s = (pi(y|x) / pi_old(y|x))^(1/|y|) = exp(mean token log-ratio). Token
  ratios are noisy estimates of a sequence-level correction, and their variance grows
  with the length (worst on MoE models, whose routing shifts between updates); the
  reward is per sequence, so GSPO corrects and clips per sequence. The paper clips
  at 3e-4 / 4e-4 (clip_eps_low / clip_eps_high) and averages over sequences
  (aggregation seq-mean-token-mean)."""
  ratio_B = jnp.exp(sequence_log_ratio(logprobs_BxT, old_logprobs_BxT, valid_BxT))
  terms_B = _clipped_surrogate(ratio_B, advantages_B, config)
  every_token = lambda x_B: jnp.broadcast_to(x_B[:, None], logprobs_BxT.shape)
  return ObjectiveTerms(*map(every_token, terms_B))


@register_objective("cispo")
def _cispo(logprobs_BxT: Array, old_logprobs_BxT: Array, advantages_B: Array,
           valid_BxT: Array, config: "GRPOConfig") -> ObjectiveTerms:
  """CISPO (MiniMax 2025, the MiniMax-M1 report, arXiv:2506.13585; ScaleRL's choice,
  Khatri et al. 2025, arXiv:2510.13786): REINFORCE with a truncated, stop-gradient
  importance weight on every token, -sg(min(r, 1 + clip_eps_high)) A log pi. PPO's
  clip zeroes the gradient of a token whose ratio left the trust region, and the rare
  tokens that fork a reasoning path (low pi_old, so large ratios) are exactly those;
  CISPO keeps every token's gradient and bounds only its weight. Both papers truncate
  from above only (MiniMax-M1 sets no lower bound), so clip_eps_low is not read."""
  del valid_BxT
  ratio_BxT = jnp.exp(logprobs_BxT - old_logprobs_BxT)
  cap = 1.0 + config.clip_eps_high
  weight_BxT = jax.lax.stop_gradient(jnp.minimum(ratio_BxT, cap))
  return ObjectiveTerms(pg_BxT=-weight_BxT * advantages_B[:, None] * logprobs_BxT,
                        clipped_BxT=(ratio_BxT > cap).astype(jnp.float32))
