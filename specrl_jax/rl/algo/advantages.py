"""Advantage estimators: each sample's rewards turned into the weight of its tokens'
gradient, by name (``GRPOConfig.advantage``).

The group-relative estimators score each sample against its siblings, the other
responses to the same prompt: no value model, the group mean is the baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from specrl_jax.config import check, check_positive_int
from specrl_jax.rl.algo.registry import registrar

if TYPE_CHECKING:
  from specrl_jax.rl.algo.losses import GRPOConfig

Array = jax.Array

# rewards_B (consecutive groups of group_size), group_size, the config -> advantages_B.
AdvantageFn = Callable[[Array, int, "GRPOConfig"], Array]
ADVANTAGES: dict[str, AdvantageFn] = {}
register_advantage = registrar("advantage estimator", ADVANTAGES)
register_advantage.__doc__ = (
    "Registers an advantage estimator so ``GRPOConfig(advantage=name)`` accepts it.")


def group_advantages(rewards_B: Array, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6) -> Array:
  """Advantages [B] for rewards [B] laid out as consecutive groups of ``group_size``.

  GRPO: (r - group mean) / (group std + eps). Dr.GRPO (``normalize_std=False``):
  r - group mean, since dividing by the std up-weights groups that are nearly solved
  or nearly hopeless. The std is the population std (ddof=0) of the group.
  """
  rewards_B = jnp.asarray(rewards_B, jnp.float32)
  check(rewards_B.ndim == 1, "group_advantages", "rewards_B.shape", rewards_B.shape,
        "a 1-D array of per-sample rewards")
  check_positive_int("group_advantages", "group_size", group_size)
  batch = rewards_B.shape[0]
  check(batch % group_size == 0, "group_advantages", "group_size", group_size,
        f"a divisor of the batch size {batch} (samples come in whole groups)")
  check(eps >= 0, "group_advantages", "eps", eps, ">= 0")
  rewards_PxG = rewards_B.reshape(batch // group_size, group_size)
  centered_PxG = rewards_PxG - rewards_PxG.mean(axis=1, keepdims=True)
  if normalize_std:
    centered_PxG = centered_PxG / (rewards_PxG.std(axis=1, keepdims=True) + eps)
  return centered_PxG.reshape(batch)


@register_advantage("group-normalized")
def _group_normalized(rewards_B: Array, group_size: int, config: "GRPOConfig") -> Array:
  """GRPO (Shao et al. 2024, arXiv:2402.03300), also DAPO's: (r - mean) / (std + eps)
  over the prompt's group."""
  del config
  return group_advantages(rewards_B, group_size, normalize_std=True)


@register_advantage("group-centered")
def _group_centered(rewards_B: Array, group_size: int, config: "GRPOConfig") -> Array:
  """Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): r - mean. The std divisor is a
  difficulty bias: it magnifies the small reward differences of nearly solved or
  nearly hopeless prompts."""
  del config
  return group_advantages(rewards_B, group_size, normalize_std=False)


def estimate_advantages(rewards_B: Array, group_size: int, config: "GRPOConfig") -> Array:
  """Advantages [B] of the configured estimator (``config.advantage``)."""
  return ADVANTAGES[config.advantage](rewards_B, group_size, config)
