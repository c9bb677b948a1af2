"""Synchronous GRPO: one RL step is one compiled call.

    rl_step(state, prompts, rng) -> (state, metrics)

runs, inside a single ``jax.jit``: a (speculative) rollout of G samples per prompt
with the state's current policy and drafter weights -> rewards (the task's jittable
reward) -> group advantages -> the trainer's log-probs -> the GRPO update with the
online drafter loss. The returned state's weights are what the next rollout reads:
the sampler and the learner share one copy, so nothing is synchronised or copied
between steps and nothing crosses to the host (the test runs it under
``jax.transfer_guard("disallow")``).

The rollout is data-parallel: under ``shard_map`` each (data, fsdp) shard decodes its
own prompts' groups with its own paged KV pool, reading the policy weights gathered
from their FSDP shards.

The same stages also compile separately (``RLProgram.rollout_jit`` and ``train_jit``)
so benchmarks can time generation, log-probs and training one by one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specrl_jax.config import ConfigError, SpecConfig, check
from specrl_jax.models import tokenizer
from specrl_jax.parallel.mesh import BATCH_AXES, data_parallel_size
from specrl_jax.parallel.rules import named_shardings, rollout_rules
from specrl_jax.rl.advantages import group_advantages
from specrl_jax.rl.learner import (
    Batch, LearnerConfig, TrainState, make_log_prob_step, make_train_step,
)
from specrl_jax.rl.online_drafters import OnlineDrafter
from specrl_jax.rl.tasks.base import PromptBatch, Task
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.sharded import engine_for_mesh, manual_axes
from specrl_jax.sampling.layout import engine_layout, padded_width
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.rollout import rollout as engine_rollout, speculation

Array = jax.Array


@flax.struct.dataclass
class Trajectories:
  """One rollout batch of R = prompts x group_size samples, ready to train on.

  batch: the learner's Batch (old_logprobs hold the rollout log-probs until the
    trainer recomputes them); rewards_R, lengths_R: per sample;
  counters: target_calls, slots (decode slots), slot_rounds (target calls x slots), request_rounds (rounds
    the samples decoded in), draft_rounds, accepted_per_position [depth] (all summed
    over rollout shards); exhausted: any shard's KV page pool ran out;
  policy_version: the number of updates of the weights that generated it.
  """
  batch: Batch
  rewards_R: Array
  lengths_R: Array
  counters: dict[str, Array]
  exhausted: Array
  policy_version: Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """group_size: samples per prompt (a GRPO group); prompts_per_step: prompts per RL
  step; normalize_std: GRPO (True) or Dr.GRPO (False) advantages."""
  group_size: int = 8
  prompts_per_step: int = 8
  normalize_std: bool = True

  def __post_init__(self):
    owner = "RolloutConfig"
    for name in ("group_size", "prompts_per_step"):
      value = getattr(self, name)
      check(isinstance(value, int) and not isinstance(value, bool) and value > 0, owner,
            name, value, "a positive integer")
    check(self.group_size > 1, owner, "group_size", self.group_size,
          "at least 2 (advantages compare a sample with its group)")


def build_rows(prompt_tokens_RxT: Array, prompt_lengths_R: Array, response_RxL: Array,
               response_lengths_R: Array, response_log_probs_RxL: Array
               ) -> tuple[Array, Array, Array]:
  """The learner's rows: prompt then response, right-padded with PAD.

  Returns (tokens int32 [R, T + L], response mask [R, T + L], rollout log-probs
  aligned with the tokens [R, T + L]).
  """
  prompt_width, response_width = prompt_tokens_RxT.shape[1], response_RxL.shape[1]
  position_S = jnp.arange(prompt_width + response_width)
  offset_RxS = position_S[None, :] - prompt_lengths_R[:, None]
  in_response_RxS = (offset_RxS >= 0) & (offset_RxS < response_lengths_R[:, None])
  read_RxS = jnp.clip(offset_RxS, 0, response_width - 1)
  response_tokens = jnp.take_along_axis(response_RxL, read_RxS, axis=1)
  prompt_tokens = jnp.pad(prompt_tokens_RxT, ((0, 0), (0, response_width)))
  in_prompt_RxS = position_S[None, :] < prompt_lengths_R[:, None]
  tokens = jnp.where(in_response_RxS, response_tokens,
                     jnp.where(in_prompt_RxS, prompt_tokens, tokenizer.PAD_ID))
  log_probs = jnp.where(in_response_RxS,
                        jnp.take_along_axis(response_log_probs_RxL, read_RxS, axis=1), 0.0)
  return tokens.astype(jnp.int32), in_response_RxS, log_probs


@dataclasses.dataclass(frozen=True, eq=False)
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
  static_drafter_params: Any
  train_step: Any
  log_prob_step: Any
  rollout: Any
  rl_step: Any

  @property
  def samples_per_step(self) -> int:
    return self.rollout_config.group_size * self.rollout_config.prompts_per_step

  def rollout_drafter_params(self, state: TrainState):
    """What the rollout passes to the drafter: from the state when trained online."""
    if self.drafter is None:
      return ()
    if self.online is not None:
      return self.online.rollout_params(state.drafter_params)
    return self.static_drafter_params

  @functools.cached_property
  def rollout_jit(self):
    """The rollout alone, jitted: ``(state, prompts, rng) -> Trajectories``."""
    return jax.jit(lambda state, prompts, rng: self.rollout(
        state.params, self.rollout_drafter_params(state), prompts, rng, state.step),
        in_shardings=(self.train_step.state_shardings, self.rows, self.replicated))

  @functools.cached_property
  def train_jit(self):
    """Log-probs and the update, jitted: ``(state, Trajectories) -> (state, metrics)``."""
    def train(state, trajectories):
      batch = trajectories.batch
      old_logprobs = self.log_prob_step(state.params, batch.tokens, batch.response_mask)
      return self.train_step.jitted(state, batch.replace(old_logprobs=old_logprobs))
    return jax.jit(train, in_shardings=(self.train_step.state_shardings, None),
                   out_shardings=(self.train_step.state_shardings, self.replicated),
                   donate_argnums=0)

  @property
  def rows(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(BATCH_AXES))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())


def make_rollout(graphdef: nnx.GraphDef, model_config, task: Task, learner: LearnerConfig,
                 rollout_config: RolloutConfig, mesh: Mesh, *, prompt_width: int,
                 drafter: Drafter | None = None, spec: SpecConfig | None = None,
                 engine: EngineConfig = EngineConfig()):
  """The sharded, traceable rollout:
  ``(params, drafter_params, prompts: PromptBatch, rng, version) -> Trajectories``."""
  sampling = learner.sampling
  group = rollout_config.group_size
  shards = data_parallel_size(mesh)
  check(rollout_config.prompts_per_step % shards == 0, "RolloutConfig", "prompts_per_step",
        rollout_config.prompts_per_step,
        f"a multiple of the rollout mesh's data*fsdp size {shards} (each shard decodes whole "
        "groups)")
  local_prompts = rollout_config.prompts_per_step // shards
  engine = engine_for_mesh(engine, mesh)
  width = padded_width(prompt_width, engine)
  # One request per sample: with EngineConfig(num_slots=0), a slot per sample.
  bound_drafter, topology, draft_mode = speculation(model_config, sampling, drafter, spec)
  layout = engine_layout(model_config, prompt_width=width,
                         prompt_pages=local_prompts * -(-width // engine.page_size),
                         num_requests=local_prompts * group, sampling=sampling, engine=engine,
                         drafter=bound_drafter, tensor_shards=mesh.shape["tensor"])
  depth = topology.depth if topology is not None else 0

  def shard(params, drafter_params, tokens_PxT, lengths_P, targets, rng):
    rng = jax.random.fold_in(rng, jax.lax.axis_index(BATCH_AXES))
    num_prompts = tokens_PxT.shape[0]
    prompt_of_request_R = jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), group)
    last_request_P = jnp.arange(num_prompts, dtype=jnp.int32) * group + group - 1
    final = engine_rollout(graphdef, params, drafter_params, tokens_PxT, lengths_P,
                           prompt_of_request_R, last_request_P, rng, sampling=sampling,
                           layout=layout, drafter=bound_drafter, topology=topology,
                           draft_mode=draft_mode)
    request_targets = jax.tree.map(lambda t: jnp.repeat(t, group, axis=0), targets)
    rewards_R = task.reward(request_targets, final.out_tokens_RxL, final.out_lengths_R)
    tokens, mask, log_probs = build_rows(
        tokens_PxT[prompt_of_request_R], lengths_P[prompt_of_request_R], final.out_tokens_RxL,
        final.out_lengths_R, final.out_log_probs_RxL)
    counters = {"target_calls": final.counters["target_calls"],
                "slots": jnp.int32(layout.num_slots),
                "slot_rounds": final.counters["target_calls"] * layout.num_slots,
                "request_rounds": jnp.sum(final.counters["request_rounds_R"]),
                "draft_rounds": final.counters.get("draft_rounds", jnp.int32(0)),
                "accepted_per_position": final.counters.get(
                    "accepted_per_position", jnp.zeros((depth,), jnp.int32))}
    per_shard = jax.tree.map(lambda x: x[None], (counters, final.pool.exhausted))
    return tokens, mask, log_probs, rewards_R.astype(jnp.float32), final.out_lengths_R, per_shard

  rows = P(BATCH_AXES)
  # Manual over the batch axes only: each (data, fsdp) shard runs its own engine, while
  # the "tensor" axis stays automatic, so weights sharded over it (heads, MLP columns)
  # stay sharded and the compiler splits every layer and the KV pages' heads with them.
  sharded = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), rows, rows, rows, P()),
                          out_specs=(rows, rows, rows, rows, rows, rows),
                          axis_names=rollout_manual_axes(mesh), check_vma=False)

  def rollout(params, drafter_params, prompts: PromptBatch, rng, version) -> Trajectories:
    # Gathered over fsdp here, once: left to the partitioner, the gathers of weights
    # sharded over fsdp (a batch axis of the rollout) can sink into the decode loop, whose
    # trip count differs between batch shards, and its collectives then deadlock.
    params, drafter_params = jax.lax.with_sharding_constraint(
        (params, drafter_params), (named_shardings(params, mesh, rollout_rules()),
                                   named_shardings(drafter_params, mesh, rollout_rules())))
    tokens, mask, log_probs, rewards_R, lengths_R, (counters, exhausted) = sharded(
        params, drafter_params, prompts.tokens_PxT, prompts.lengths_P, dict(prompts.targets),
        rng)
    advantages_R = group_advantages(rewards_R, group,
                                    normalize_std=rollout_config.normalize_std)
    batch = Batch(tokens=tokens, response_mask=mask, old_logprobs=log_probs,
                  advantages=advantages_R, rollout_logprobs=log_probs)
    return Trajectories(batch=batch, rewards_R=rewards_R, lengths_R=lengths_R,
                        counters=jax.tree.map(lambda x: jnp.sum(x, axis=0), counters),
                        exhausted=jnp.any(exhausted), policy_version=jnp.asarray(version, jnp.int32))

  return rollout


def rollout_manual_axes(mesh: Mesh) -> set[str]:
  """Heads are split over "tensor" inside the rollout only on meshes without batch
  shards: with data * fsdp > 1 each batch shard decodes with whole weights, replicated
  over its tensor group (a two-process (2, 2, 2) sync run with split heads trained on
  zero gradients, unexplained yet)."""
  return manual_axes(mesh) if data_parallel_size(mesh) == 1 else set(mesh.axis_names)


def rollout_metrics(trajectories: Trajectories, max_new_tokens: int) -> dict[str, Array]:
  """Reward, length and acceptance statistics of a rollout batch (device scalars)."""
  rewards, lengths = trajectories.rewards_R, trajectories.lengths_R
  counters = trajectories.counters
  rounds = jnp.maximum(counters["draft_rounds"], 1).astype(jnp.float32)
  accepted = counters["accepted_per_position"].astype(jnp.float32)
  drafted = counters["draft_rounds"] > 0
  return {
      "reward_mean": jnp.mean(rewards),
      "reward_std": jnp.std(rewards),
      "rewards_finite": jnp.all(jnp.isfinite(rewards)),
      "response_length_mean": jnp.mean(lengths.astype(jnp.float32)),
      "response_length_max": jnp.max(lengths),
      "truncated_fraction": jnp.mean((lengths >= max_new_tokens).astype(jnp.float32)),
      "generated_tokens": jnp.sum(lengths),
      "target_calls": counters["target_calls"],
      "rollout_slots": counters["slots"],
      # Slot-rounds that decoded a live sequence: the rest is the batch waiting for its
      # slowest samples once no request is left to refill a freed slot.
      "slot_utilization": counters["request_rounds"] / jnp.maximum(counters["slot_rounds"], 1),
      "acceptance_length": jnp.where(drafted, 1.0 + jnp.sum(accepted) / rounds, 1.0),
      "per_position_acceptance": accepted / rounds,
      "pool_exhausted": trajectories.exhausted,
      "policy_version": trajectories.policy_version,
  }


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
  train_step = make_train_step(graphdef, learner, mesh, state,
                               drafter=online.objective if online else None)
  log_prob_step = make_log_prob_step(graphdef, learner, mesh, state.params)
  rollout = make_rollout(graphdef, model_config, task, learner, rollout_config, mesh,
                         prompt_width=prompt_width, drafter=drafter, spec=spec, engine=engine)
  static_drafter_params = None if drafter is None or online is not None else drafter.params()
  max_new = learner.sampling.max_new_tokens

  program = RLProgram(graphdef=graphdef, task=task, learner=learner,
                      rollout_config=rollout_config, mesh=mesh, drafter=drafter, online=online,
                      static_drafter_params=static_drafter_params, train_step=train_step,
                      log_prob_step=log_prob_step, rollout=rollout, rl_step=None)

  def rl_step(state: TrainState, prompts: PromptBatch, rng):
    trajectories = rollout(state.params, program.rollout_drafter_params(state), prompts, rng,
                           state.step)
    batch = trajectories.batch
    old_logprobs = log_prob_step(state.params, batch.tokens, batch.response_mask)
    new_state, metrics = train_step.jitted(state, batch.replace(old_logprobs=old_logprobs))
    return new_state, dict(metrics, **rollout_metrics(trajectories, max_new))

  # Explicit shardings: the state comes back laid out exactly as it went in, so every
  # step after the first reuses the one compiled program.
  shardings = train_step.state_shardings
  object.__setattr__(program, "rl_step", jax.jit(
      rl_step, in_shardings=(shardings, program.rows, program.replicated),
      out_shardings=(shardings, program.replicated), donate_argnums=0))
  return program


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
