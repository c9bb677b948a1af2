"""Group-relative advantages: each sample is scored against its siblings."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specrl_jax.config import check, check_positive_int

Array = jax.Array


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
