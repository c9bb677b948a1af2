"""The learner's half of a GRPO step, in data-flow order:

    learn(state, trajectories) -> (state, metrics)

rewards -> advantages (``GRPOConfig.advantage``) -> the learner's log-probs of the rollout's tokens (the
ratio's denominator, with the trainer's numerics; skipped with
``LearnerConfig.skip_log_prob_pass``, the update's forward then supplies them) -> the
update. The sync step traces
it inside its one jit, ``RLProgram.train_jit`` jits it alone, and the async pipeline
jits it on the train mesh: one function, so the three cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from specrl_jax.rl.algo.advantages import estimate_advantages
from specrl_jax.rl.loop.learner import (
    Batch, DrafterObjective, LearnerConfig, TrainState, TrainStep, make_log_prob_step,
    make_train_step,
)
from specrl_jax.rl.loop.rollout import RolloutConfig, Trajectories

Array = jax.Array


# eq=False: hashed by identity, as jax.jit hashes the functions it wraps (its steps'
# shardings are not hashable).
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LearnStep:
  """train_step: the jitted update; log_prob_step: the jitted ``(params, tokens_BxT,
  response_mask_BxT) -> log-probs``; group_size: samples per prompt, the rows each
  advantage compares a sample with."""
  train_step: TrainStep
  log_prob_step: Callable[[Any, Array, Array], Array]
  group_size: int

  def batch(self, trajectories: Trajectories, old_logprobs_BxT: Array) -> Batch:
    """The rollout's batch completed with what only the learner sets: advantages
    and the learner's log-probs (``old_logprobs``)."""
    advantages_R = estimate_advantages(trajectories.rewards_R, self.group_size,
                                       self.train_step.config.loss)
    return trajectories.batch.replace(advantages=advantages_R, old_logprobs=old_logprobs_BxT)

  def __call__(self, state: TrainState, trajectories: Trajectories):
    """Traceable: the learner's log-probs with the state's weights, then the update."""
    rows = trajectories.batch
    old_logprobs_BxT = None  # the update's own forward supplies them (LearnerConfig)
    if not self.train_step.config.skip_log_prob_pass:
      old_logprobs_BxT = self.log_prob_step(state.compute_params(), rows.tokens,
                                            rows.response_mask)
    return self.train_step.jitted(state, self.batch(trajectories, old_logprobs_BxT))


def make_learn_step(graphdef: nnx.GraphDef, config: LearnerConfig, mesh: Mesh,
                    state: TrainState, *, rollout: RolloutConfig,
                    drafter: DrafterObjective | None = None) -> LearnStep:
  """The learner's step on ``mesh`` for train states shaped like ``state``, learning
  from rollouts configured by ``rollout`` (its groups and its warp)."""
  sampling = rollout.sampling
  return LearnStep(
      train_step=make_train_step(graphdef, config, mesh, state, sampling=sampling,
                                 drafter=drafter),
      # Shaped like the weights the model computes with (merged, with LoRA).
      log_prob_step=make_log_prob_step(graphdef, mesh, jax.eval_shape(
          lambda state: state.compute_params(), state), sampling=sampling),
      group_size=rollout.group_size)
