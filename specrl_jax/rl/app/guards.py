"""What stops or flags a training run: non-finite updates, bad rewards, a full KV pool,
and collapse.

A step whose update is not finite was already undone inside the train step
(``rl.loop.numerics``); ``check_step`` stops the run right after it, before anything is
checkpointed, so no checkpoint ever holds a non-finite value.

Collapse is not an error: zero gradient norm with a constant reward for
``window`` steps in a row (no sample is better than another, so GRPO has nothing to
learn from) is reported as the ``collapse_warning`` metric and once on the console.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from specrl_jax.rl.tasks import RewardFunctionError, raise_pending_errors
from specrl_jax.sampling.results import PagePoolExhaustedError


class TrainingDivergedError(RuntimeError):
  """A step produced a non-finite loss, reward or update; its state was not kept."""


def check_step(step: int, metrics: Mapping[str, Any], *, kept: str,
               leaf_name_of: Callable[[int], str]) -> None:
  """Raises the error that ends the run at ``step``, if any (host side, per step).

  kept: what survives, for the message ("the last good checkpoint (step 4) is kept
  in ..."); leaf_name_of: names a leaf index of ``nonfinite_leaf``.
  """
  try:
    raise_pending_errors()
  except RewardFunctionError as error:
    raise RewardFunctionError(f"step {step}: {error}; {kept}.") from error.__cause__
  if not metrics["rewards_finite"]:
    raise TrainingDivergedError(f"step {step}: the task's rewards are NaN or infinite "
                                f"(reward_mean={metrics['reward_mean']}); {kept}.")
  bad = [f"{name}={metrics[name]}" for name in ("loss", "grad_norm")
         if not math.isfinite(metrics[name])]
  update_finite = bool(metrics.get("update_finite", True))
  if bad or not update_finite:
    what = [f"non-finite {', '.join(bad)}"] if bad else []
    if not update_finite:
      leaf = leaf_name_of(int(metrics["nonfinite_leaf"]))
      what.append(f"the update made {leaf} non-finite (its first such leaf"
                  + ("" if bad else f"; loss={metrics['loss']}, "
                     f"grad_norm={metrics['grad_norm']}") + ")")
    raise TrainingDivergedError(
        f"step {step}: {'; '.join(what)}; the update was not kept or checkpointed and "
        f"{kept}.")
  if metrics["pool_exhausted"]:
    raise PagePoolExhaustedError(f"step {step}: the rollout's KV page pool ran out; raise "
                                 f"the engine's num_pages or lower num_slots; {kept}.")


class CollapseDetector:
  """Counts the steps in a row with zero gradient norm and a constant reward (zero
  reward spread within the batch and the same mean as the step before)."""

  def __init__(self, window: int):
    self.window = window
    self.run = 0
    self._last_reward: float | None = None

  def update(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The warning metrics of this step: ``steps_without_signal`` and
    ``collapse_warning`` (true once the run reaches ``window``; 0 disables)."""
    reward = float(metrics["reward_mean"])
    flat = (float(metrics["grad_norm"]) == 0.0 and float(metrics["reward_std"]) == 0.0
            and self._last_reward in (None, reward))
    self.run = self.run + 1 if flat else 0
    self._last_reward = reward
    return {"steps_without_signal": self.run,
            "collapse_warning": bool(self.window and self.run >= self.window)}
