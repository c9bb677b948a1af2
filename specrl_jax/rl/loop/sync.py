"""Synchronous GRPO: one RL step is one compiled call.

    rl_step(state, prompts, rng) -> (state, metrics)

runs, inside a single ``jax.jit``: a (speculative) rollout of G samples per prompt
with the state's current policy and drafter weights -> rewards, the task's jittable
reward (``rl.loop.rollout``) -> group advantages -> the trainer's log-probs -> the GRPO
update with the online drafter loss (``rl.loop.learn_step``). The returned state's weights
are what the next rollout reads: the sampler and the learner share one copy, so
nothing is synchronised or copied between steps and nothing crosses to the host (the
test runs it under ``jax.transfer_guard("disallow")``).

The same stages also compile separately (``RLProgram.rollout_jit`` and ``train_jit``)
so benchmarks can time generation, log-probs and training one by one.

A drafter with a memory of earlier rollouts (the history drafter) makes ``rl_step`` a
``MemoryStep``: the same one compiled call, with the bank passed in and the rollouts
handed back to the host store after it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specrl_jax.config import ConfigError, SpecConfig
from specrl_jax.parallel.mesh import BATCH_AXES
from specrl_jax.rl.loop.drafter_memory import RolloutMemory, rollout_memory
from specrl_jax.rl.loop.learn_step import LearnStep, make_learn_step
from specrl_jax.rl.loop.learner import LearnerConfig, TrainState, TrainStep
from specrl_jax.rl.loop.online_drafters import OnlineDrafter
from specrl_jax.rl.loop.rollout import (
    RolloutConfig, make_rollout, rollout_drafter_params, rollout_metrics,
)
from specrl_jax.rl.loop.shape_control import check_controller
from specrl_jax.rl.tasks.base import PromptBatch, Task
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.drafters.base import Drafter


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RLProgram:
  """The compiled pieces of GRPO for one policy, task, drafter and mesh.

  Build with ``build_program``. ``rollout(params, drafter_params, prompts, rng,
  version)`` is the traceable sharded rollout; ``rl_step`` is the single jitted sync
  step; ``rollout_jit`` / ``train_jit`` the same stages jitted separately.
  """
  graphdef: nnx.GraphDef
  task: Task
  learner: LearnerConfig
  rollout_config: RolloutConfig
  mesh: Mesh
  drafter: Drafter | None
  online: OnlineDrafter | None
  learn: LearnStep
  rollout_drafter_params: Callable[[TrainState], Any]
  rollout: Any
  rl_step: Any

  @property
  def samples_per_step(self) -> int:
    return self.rollout_config.group_size * self.rollout_config.prompts_per_step

  @property
  def train_step(self) -> TrainStep:
    return self.learn.train_step

  @property
  def log_prob_step(self):
    return self.learn.log_prob_step

  @functools.cached_property
  def rollout_jit(self):
    """The rollout alone, jitted: ``(state, prompts, rng) -> Trajectories``."""
    return jax.jit(lambda state, prompts, rng: self.rollout(
        state.compute_params(), self.rollout_drafter_params(state), prompts, rng,
        state.step, state.controller),
        in_shardings=(self.train_step.state_shardings, self.rows, self.replicated))

  @functools.cached_property
  def train_jit(self):
    """Log-probs and the update, jitted: ``(state, Trajectories) -> (state, metrics)``."""
    return jax.jit(self.learn, in_shardings=(self.train_step.state_shardings, None),
                   out_shardings=(self.train_step.state_shardings, self.replicated),
                   donate_argnums=0)

  @property
  def rows(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(BATCH_AXES))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())


def build_program(graphdef: nnx.GraphDef, model_config, task: Task, learner: LearnerConfig,
                  rollout_config: RolloutConfig, mesh: Mesh, state: TrainState, *,
                  prompt_width: int, drafter: Drafter | None = None,
                  online: OnlineDrafter | None = None, spec: SpecConfig | None = None,
                  engine: EngineConfig = EngineConfig()) -> RLProgram:
  """Compiles (lazily) the sync RL step for train states shaped like ``state``.

  drafter: None for plain rollouts; with ``online``, ``online.drafter`` is used and its
  trainable part lives in ``state.drafter_params``.
  """
  if online is not None:
    drafter = online.drafter
  if drafter is None and spec is not None:
    raise ConfigError("spec was given without a drafter: speculative rollouts need one.")
  learn = make_learn_step(graphdef, learner, mesh, state, rollout=rollout_config,
                          drafter=online.objective if online else None)
  rollout = make_rollout(graphdef, model_config, task, rollout_config, mesh,
                         prompt_width=prompt_width, drafter=drafter, spec=spec, engine=engine)
  drafter_params = rollout_drafter_params(drafter, online)
  memory = rollout_memory(drafter)
  max_new = rollout_config.sampling.max_new_tokens

  check_controller(state, spec)

  def rl_step(state: TrainState, prompts: PromptBatch, rng, bank=None):
    params = drafter_params(state)
    if memory is not None:  # this step's bank of earlier rollouts (history drafter)
      params = memory.place(params, bank)
    trajectories = rollout(state.compute_params(), params, prompts, rng, state.step,
                           state.controller)
    new_state, metrics = learn(state, trajectories)
    # The controller's measurements carry to the next step's rollout.
    new_state = new_state.replace(controller=trajectories.controller)
    metrics = dict(metrics, **rollout_metrics(trajectories, max_new))
    if memory is None:
      return new_state, metrics
    return new_state, metrics, (trajectories.batch.tokens, trajectories.lengths_R)

  # Explicit shardings: the state comes back laid out exactly as it went in, so every
  # step after the first reuses the one compiled program.
  shardings = learn.train_step.state_shardings
  rows, replicated = NamedSharding(mesh, P(BATCH_AXES)), NamedSharding(mesh, P())
  if memory is None:
    step = jax.jit(rl_step, in_shardings=(shardings, rows, replicated),
                   out_shardings=(shardings, replicated), donate_argnums=0)
  else:
    step = MemoryStep(jax.jit(rl_step, in_shardings=(shardings, rows, replicated, replicated),
                              out_shardings=(shardings, replicated, (rows, rows)),
                              donate_argnums=0), memory, rollout_config.group_size)
  return RLProgram(graphdef=graphdef, task=task, learner=learner,
                   rollout_config=rollout_config, mesh=mesh, drafter=drafter, online=online,
                   learn=learn, rollout_drafter_params=drafter_params, rollout=rollout,
                   rl_step=step)


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryStep:
  """``rl_step(state, prompts, rng) -> (state, metrics)`` of a drafter with a memory of
  earlier rollouts: the compiled step reads the bank and returns its rollouts, which
  the memory then remembers (a host round trip per step, outside the compiled call)."""
  jitted: Any
  memory: RolloutMemory
  group_size: int

  def __call__(self, state: TrainState, prompts: PromptBatch, rng):
    state, metrics, (tokens_RxC, lengths_R) = self.jitted(state, prompts, rng,
                                                          self.memory.arrays())
    self.memory.observe(prompts.tokens_PxT, prompts.lengths_P, tokens_RxC, lengths_R,
                        self.group_size)
    return state, metrics


def prompts_on_mesh(prompts: PromptBatch, mesh: Mesh) -> PromptBatch:
  """The step's prompts as device arrays split over the mesh's batch axes."""
  sharding = NamedSharding(mesh, P(BATCH_AXES))
  return jax.device_put(prompts, jax.tree.map(lambda _: sharding, prompts))


def to_host(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """Metrics as Python numbers (vectors as lists)."""
  out = {}
  for name, value in jax.device_get(dict(metrics)).items():
    value = np.asarray(value)
    out[name] = value.tolist() if value.ndim else value.item()
  return out
