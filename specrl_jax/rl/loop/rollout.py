"""The GRPO rollout: prompts -> G samples each -> rewards, as learner rows.

``make_rollout`` builds the traceable, data-parallel rollout: under ``shard_map`` each
(data, fsdp) shard decodes its own prompts' groups with its own paged KV pool,
reading the policy weights gathered from their FSDP shards. It returns
``Trajectories``: the learner's rows with the rollout's log-probs, per-sample rewards
and lengths, and the engine's counters. Advantages and the learner's log-probs are
the learner's (``rl.loop.learn_step``), so a batch here holds only what the sampler
produced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from specrl_jax.config import SamplingParams, SpecConfig, check, check_positive_int
from specrl_jax.parallel.mesh import BATCH_AXES, data_parallel_size
from specrl_jax.rl.loop.policy_loss import check_warp
from specrl_jax.rl.loop.train_state import Batch
from specrl_jax.rl.loop.online_drafters import OnlineDrafter
from specrl_jax.rl.loop.shape_control import controller_metrics, step_counters
from specrl_jax.rl.tasks.base import PromptBatch, Task
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.compaction import stage_widths
from specrl_jax.sampling.layout import padded_width
from specrl_jax.sampling.plan import plan_rollout
from specrl_jax.sampling.rollout import rollout as engine_rollout
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.inloop import InLoopState, fade, merge_shards
from specrl_jax.speculative.inloop_rollout import in_loop_hook, in_loop_rollout
from specrl_jax.speculative.rollout import acceptance_length, rounds_of, speculation

Array = jax.Array


@flax.struct.dataclass
class Trajectories:
  """One rollout batch of R = prompts x group_size samples, ready to train on.

  batch: the learner's Batch with the rollout's log-probs (``rollout_logprobs``);
    its advantages and old_logprobs are left for the learner; rewards_R, lengths_R:
    per sample;
  counters: target_calls, slots (decode slots), slot_rounds (rounds x their widths),
    request_rounds (rounds the samples decoded in), draft_rounds, accepted_per_position [depth],
    rounds_by_width [stages] (rounds at each width of slot compaction; one entry without),
    tokens_by_width [stages] (tokens generated at each width),
    tail_rounds (rounds with at most half the slots live) (all summed over rollout
    shards); exhausted: any shard's KV page pool ran out;
  policy_version: the number of updates of the weights that generated it;
  controller: with the in-loop adaptive controller (``SpecConfig(adaptive=True)``), its
    state after this rollout (``speculative.inloop.InLoopState``), else None.
  """
  batch: Batch
  rewards_R: Array
  lengths_R: Array
  counters: dict[str, Array]
  exhausted: Array
  policy_version: Array
  controller: InLoopState | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """group_size: samples per prompt (a GRPO group); prompts_per_step: prompts per RL
  step; sampling: how the rollout samples (the learner's log-probs reuse its warp, so
  the ratio compares like with like)."""
  group_size: int = 8
  prompts_per_step: int = 8
  sampling: SamplingParams = SamplingParams()

  def __post_init__(self):
    owner = "RolloutConfig"
    for name in ("group_size", "prompts_per_step"):
      check_positive_int(owner, name, getattr(self, name))
    check(self.group_size > 1, owner, "group_size", self.group_size,
          "at least 2 (advantages compare a sample with its group)")
    check_warp(self.sampling, owner)


def build_rows(prompt_tokens_RxT: Array, prompt_lengths_R: Array, response_RxL: Array,
               response_lengths_R: Array, response_log_probs_RxL: Array
               ) -> tuple[Array, Array, Array]:
  """The learner's rows: prompt then response, right-padded with token 0 (any id
  would do: padded positions come after the row's tokens and are masked out).

  A row spans C = T + L tokens: a request's prompt and its output, as C does for a
  drafter's slot. Returns (tokens int32 [R, C], response mask [R, C], rollout log-probs
  aligned with the tokens [R, C]).
  """
  prompt_width, response_width = prompt_tokens_RxT.shape[1], response_RxL.shape[1]
  position_C = jnp.arange(prompt_width + response_width)
  offset_RxC = position_C[None, :] - prompt_lengths_R[:, None]
  in_response_RxC = (offset_RxC >= 0) & (offset_RxC < response_lengths_R[:, None])
  read_RxC = jnp.clip(offset_RxC, 0, response_width - 1)
  response_tokens_RxC = jnp.take_along_axis(response_RxL, read_RxC, axis=1)
  prompt_tokens_RxC = jnp.pad(prompt_tokens_RxT, ((0, 0), (0, response_width)))
  in_prompt_RxC = position_C[None, :] < prompt_lengths_R[:, None]
  tokens_RxC = jnp.where(in_response_RxC, response_tokens_RxC,
                         jnp.where(in_prompt_RxC, prompt_tokens_RxC, 0))
  log_probs_RxC = jnp.where(
      in_response_RxC, jnp.take_along_axis(response_log_probs_RxL, read_RxC, axis=1), 0.0)
  return tokens_RxC.astype(jnp.int32), in_response_RxC, log_probs_RxC


def make_rollout(graphdef: nnx.GraphDef, model_config, task: Task,
                 rollout_config: RolloutConfig, mesh: Mesh, *, prompt_width: int,
                 drafter: Drafter | None = None, spec: SpecConfig | None = None,
                 engine: EngineConfig = EngineConfig()):
  """The sharded, traceable rollout:
  ``(params, drafter_params, prompts: PromptBatch, rng, version, controller=None)
  -> Trajectories``. With ``spec.adaptive`` the draft shape is chosen per round inside
  the loop (``speculative.inloop``): ``controller`` is then the carried InLoopState
  (required) and ``Trajectories.controller`` the one to carry to the next rollout."""
  sampling = rollout_config.sampling
  group = rollout_config.group_size
  plan, rounds, hook = shard_plan(model_config, rollout_config, mesh,
                                  prompt_width=prompt_width, drafter=drafter, spec=spec,
                                  engine=engine)
  local_prompts = rollout_config.prompts_per_step // data_parallel_size(mesh)
  layout = plan.layout
  depth = rounds.topology.depth if rounds is not None else 0
  widths_W = jnp.asarray(stage_widths(layout.num_slots, layout.compaction_min_width), jnp.int32)

  def shard(params, drafter_params, tokens_PxT, lengths_P, targets, rng, controller):
    rng = jax.random.fold_in(rng, jax.lax.axis_index(BATCH_AXES))
    num_prompts = tokens_PxT.shape[0]
    prompt_of_request_R = jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), group)
    last_request_P = jnp.arange(num_prompts, dtype=jnp.int32) * group + group - 1
    if hook is None:
      final = engine_rollout(graphdef, params, drafter_params, tokens_PxT, lengths_P,
                             prompt_of_request_R, last_request_P, rng, sampling=sampling,
                             layout=layout, rounds=rounds)
    else:
      final, controller = in_loop_rollout(
          graphdef, params, (drafter_params, controller), tokens_PxT, lengths_P,
          prompt_of_request_R, last_request_P, rng, sampling=sampling, layout=layout,
          hook=hook)
    request_targets = jax.tree.map(lambda t: jnp.repeat(t, group, axis=0), targets)
    tokens, mask, log_probs = build_rows(
        tokens_PxT[prompt_of_request_R], lengths_P[prompt_of_request_R], final.out_tokens_RxL,
        final.out_lengths_R, final.out_log_probs_RxL)
    rounds_by_width = final.counters["rounds_by_width"]
    counters = {"target_calls": final.counters["target_calls"],
                "slots": jnp.int32(layout.num_slots),
                # What the rounds cost in slots: with compaction, narrower ones cost less.
                "slot_rounds": jnp.sum(rounds_by_width * widths_W),
                "rounds_by_width": rounds_by_width,
                "tokens_by_width": final.counters["tokens_by_width"],
                "tail_rounds": jnp.sum(
                    final.counters["rounds_by_live"][:layout.num_slots // 2 + 1]),
                "request_rounds": jnp.sum(final.counters["request_rounds_R"]),
                "draft_rounds": final.counters.get("draft_rounds", jnp.int32(0)),
                # 1 on every shard whose "auto" attention fell back to the reference.
                "attention_fallback": jnp.int32(layout.attention_fallback is not None),
                "accepted_per_position": final.counters.get(
                    "accepted_per_position", jnp.zeros((depth,), jnp.int32))}
    per_shard = jax.tree.map(lambda x: x[None], (counters, final.pool.exhausted, controller))
    return (tokens, mask, log_probs, final.out_lengths_R,
            (request_targets, final.out_tokens_RxL), per_shard)

  rows = plan.rows
  # Each (data, fsdp) shard runs its own engine, with the weights (heads, MLP columns)
  # and the KV pages' heads split over its "tensor" group (``RolloutPlan.per_shard``).
  sharded = plan.per_shard(shard, in_specs=(P(), P(), rows, rows, rows, P(), P()),
                           out_specs=(rows,) * 6)
  score = reward_program(task, mesh, local_prompts * group)

  def rollout(params, drafter_params, prompts: PromptBatch, rng, version,
              controller: InLoopState | None = None) -> Trajectories:
    if (hook is None) != (controller is None):
      raise ValueError(
          "the rollout's controller: pass the carried InLoopState exactly when the spec is "
          f"adaptive (spec.adaptive={spec is not None and spec.adaptive}, controller "
          f"{'given' if controller is not None else 'None'}).")
    if hook is not None and controller.cost_SxW.shape != (len(hook.config.shapes),
                                                         len(hook.widths)):
      raise ValueError(f"controller.cost_SxW is shaped {controller.cost_SxW.shape}: expected "
                       f"{len(hook.config.shapes)} shapes {hook.config.labels} x "
                       f"{len(hook.widths)} widths {hook.widths}.")
    # Gathered over fsdp here, once: left to the partitioner, the gathers of weights
    # sharded over fsdp (a batch axis of the rollout) can sink into the decode loop, whose
    # trip count differs between batch shards, and its collectives then deadlock.
    params, drafter_params = jax.lax.with_sharding_constraint(
        (params, drafter_params), plan.shardings(params, drafter_params)[:2])
    tokens, mask, log_probs, lengths_R, (targets, response_RxL), per_shard = (
        sharded(params, drafter_params, prompts.tokens_PxT, prompts.lengths_P,
                dict(prompts.targets), rng, controller))
    counters, exhausted, after = per_shard
    rewards_R = score(targets, response_RxL, lengths_R)
    batch = Batch(tokens=tokens, response_mask=mask, rollout_logprobs=log_probs)
    counters = jax.tree.map(lambda x: jnp.sum(x, axis=0), counters)
    if hook is not None:
      after = merge_shards(controller, after)
      counters.update(step_counters(controller, after))
      after = fade(hook.config, controller, after)
    return Trajectories(batch=batch, rewards_R=rewards_R, lengths_R=lengths_R,
                        counters=counters, exhausted=jnp.any(exhausted),
                        policy_version=jnp.asarray(version, jnp.int32),
                        controller=after if hook is not None else None)

  return rollout


def shard_plan(model_config, rollout_config: RolloutConfig, mesh: Mesh, *, prompt_width: int,
               drafter: Drafter | None, spec: SpecConfig | None, engine: EngineConfig):
  """(plan, round hook of a fixed shape or None, in-loop hook or None) of each batch
  shard's engine: one request per sample (with EngineConfig(num_slots=0) a slot per
  sample), whole groups per shard."""
  shards = data_parallel_size(mesh)
  check(rollout_config.prompts_per_step % shards == 0, "RolloutConfig", "prompts_per_step",
        rollout_config.prompts_per_step,
        f"a multiple of the rollout mesh's data*fsdp size {shards} (each shard decodes whole "
        "groups)")
  local_prompts = rollout_config.prompts_per_step // shards
  width = padded_width(prompt_width, engine)
  sampling = rollout_config.sampling
  rounds = rounds_of(*speculation(model_config, sampling, drafter, spec))
  plan = plan_rollout(model_config, prompt_width=width,
                      prompt_pages=local_prompts * -(-width // engine.page_size),
                      num_requests=local_prompts * rollout_config.group_size,
                      sampling=sampling, engine=engine, rounds=rounds, mesh=mesh)
  layout = plan.layout
  hook = None if rounds is None else in_loop_hook(
      rounds.drafter, spec, rounds.draft_mode,
      stage_widths(layout.num_slots, layout.compaction_min_width))
  return plan, rounds, hook


def reward_program(task: Task, mesh: Mesh, rows_per_shard: int
                   ) -> Callable[[dict, Array, Array], Array]:
  """``(request targets, responses, lengths) -> rewards_R`` over the rollout's rows, in
  a region manual over every mesh axis: host callbacks (Python rewards) cannot run
  where an axis is left to the compiler, as "tensor" is in the decode loop. Each device
  scores its own block of rows (a tensor group shares its batch shard's rows between
  its devices when they divide evenly, else each of them scores them all)."""
  tensor = mesh.shape["tensor"]
  axes = (*BATCH_AXES, "tensor") if rows_per_shard % tensor == 0 else BATCH_AXES
  rows = P(axes)

  def score(targets, response_RxL, lengths_R):
    return task.reward(targets, response_RxL, lengths_R).astype(jnp.float32)

  return jax.shard_map(score, mesh=mesh, in_specs=(rows, rows, rows), out_specs=rows,
                       axis_names=set(mesh.axis_names), check_vma=False)


def rollout_metrics(trajectories: Trajectories, max_new_tokens: int) -> dict[str, Array]:
  """Reward, length and acceptance statistics of a rollout batch (device scalars)."""
  rewards, lengths = trajectories.rewards_R, trajectories.lengths_R
  counters = trajectories.counters
  rounds = jnp.maximum(counters["draft_rounds"], 1).astype(jnp.float32)
  accepted = counters["accepted_per_position"].astype(jnp.float32)
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
      # The long tail: rounds with at most half the slots live (with slot compaction they
      # run in narrower programs, counted per width).
      "tail_round_share": counters["tail_rounds"] / jnp.maximum(counters["target_calls"], 1),
      "rounds_by_width": counters["rounds_by_width"],
      "tokens_by_width": counters["tokens_by_width"],
      "acceptance_length": acceptance_length(accepted, counters["draft_rounds"]),
      "per_position_acceptance": accepted / rounds,
      "pool_exhausted": trajectories.exhausted,
      # The kernel that failed to compile is named in the warning it raised.
      "attention_fallback": counters["attention_fallback"] > 0,
      "policy_version": trajectories.policy_version,
      **({} if trajectories.controller is None
         else controller_metrics(trajectories.controller, counters)),
  }


def rollout_drafter_params(drafter: Drafter | None, online: OnlineDrafter | None
                           ) -> Callable[[Any], Any]:
  """``state -> drafter_params`` the rollout passes to ``drafter``: () without one,
  the online drafter's view of ``state.drafter_params`` when it trains online, else
  the drafter's own (fixed) params, read once here."""
  if drafter is None:
    return lambda state: ()
  if online is not None:
    return lambda state: online.rollout_params(state.compute_drafter_params())
  static = drafter.params()
  return lambda state: static
