"""The RL side of the in-loop draft-shape controller (``speculative.inloop``): its
carried state in the train state, and what a step reports of it.

Metrics (per RL step; W widths of slot compaction, widest first):
  inloop_shape_by_width [W]: the shape index that ran the most rounds at each width
    (0 plain, k a chain of k drafts, K + 1 + t the t-th tree; -1: the width never ran);
  inloop_rounds_<label> [W]: rounds of that shape at each width;
  inloop_round_seconds_<label> [W]: the round-cost table the step chose with (async
    runs with ``refresh_weight`` > 0: refreshed from every rollout's own time);
  inloop_fixed_seconds: the table's seconds of a rollout outside its rounds (prefill,
    dispatch), which a refresh takes off a rollout's own seconds first;
  inloop_acceptance [K]: the carried per-position acceptance estimate;
  inloop_exploration_rounds [W]: rounds run to explore (untried shapes, re-tries).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specrl_jax.config import ConfigError, SpecConfig
from specrl_jax.parallel import distributed
from specrl_jax.speculative.inloop import InLoopState, acceptance_rates
from specrl_jax.speculative.inloop_calibration import refresh
from specrl_jax.speculative.inloop_rollout import in_loop_config

Array = jax.Array


def is_adaptive(spec: SpecConfig | None) -> bool:
  return spec is not None and spec.adaptive


def check_controller(state, spec: SpecConfig | None) -> None:
  """A train state carries a controller exactly when the rollouts are adaptive."""
  adaptive, carried = is_adaptive(spec), getattr(state, "controller", None) is not None
  if adaptive and not carried:
    raise ConfigError(
        "spec is adaptive (the draft shape is chosen inside the rollout) but the train "
        "state has no controller: add one with rl.loop.shape_control.with_controller("
        "state, spec, cost_SxW, mesh), cost_SxW from speculative.inloop_calibration.")
  if carried and not adaptive:
    raise ConfigError("the train state carries an in-loop controller but spec is not "
                      "adaptive: pass SpecConfig(..., adaptive=True) or drop the controller.")


def with_controller(state, spec: SpecConfig, cost_SxW, mesh: Mesh, fixed_seconds: float = 0.0):
  """``state`` with a fresh controller for ``spec``'s menu and the measured round
  seconds ``cost_SxW`` [shapes, widths] (and rollout seconds outside the rounds),
  replicated on ``mesh``."""
  controller = InLoopState.initial(in_loop_config(spec), np.asarray(cost_SxW), fixed_seconds)
  replicated = NamedSharding(mesh, P())
  return state.replace(controller=jax.device_put(
      controller, jax.tree.map(lambda _: replicated, controller)))


def refreshed(controller: InLoopState, rounds_SxW, seconds: float, *, weight: float,
              shards: int) -> InLoopState:
  """``controller`` with its round costs refreshed from one rollout's own time
  (``speculative.inloop_calibration.refresh``): it ran ``rounds_SxW`` (summed over its
  ``shards`` batch shards, which decode side by side, so one shard ran a share) in
  ``seconds``. ``seconds`` must be the same on every process."""
  table, fixed = distributed.fetch((controller.cost_SxW, controller.fixed_seconds))
  cost_SxW = refresh(np.asarray(table), float(fixed), np.asarray(rounds_SxW) / shards,
                     seconds, weight)
  return controller.replace(cost_SxW=jax.device_put(cost_SxW, controller.cost_SxW.sharding))


def shape_labels(controller: InLoopState) -> tuple[str, ...]:
  """Metric labels of the menu from its arrays: plain, chain_k1.., tree0, tree1."""
  k = controller.accepted_Z.shape[0]
  trees = controller.cost_SxW.shape[0] - k - 1
  return ("plain",) + tuple(f"chain_k{i}" for i in range(1, k + 1)) + tuple(
      f"tree{t}" for t in range(trees))


def step_counters(before: InLoopState, after: InLoopState) -> dict[str, Array]:
  """What one rollout ran: rounds per (shape, width) and exploration rounds per width."""
  return {"shape_rounds_SxW": after.rounds_SxW - before.rounds_SxW,
          "exploration_rounds_W": after.probes_W - before.probes_W}


def controller_metrics(controller: InLoopState, counters: dict[str, Array]
                       ) -> dict[str, Array]:
  rounds_SxW = counters["shape_rounds_SxW"]
  ran_W = jnp.sum(rounds_SxW, axis=0) > 0
  metrics = {
      "inloop_shape_by_width": jnp.where(ran_W, jnp.argmax(rounds_SxW, axis=0), -1),
      "inloop_acceptance": acceptance_rates(controller.accepted_Z, controller.reached_Z),
      "inloop_exploration_rounds": counters["exploration_rounds_W"],
      "inloop_fixed_seconds": controller.fixed_seconds}
  for s, label in enumerate(shape_labels(controller)):
    metrics[f"inloop_rounds_{label}"] = rounds_SxW[s]
    metrics[f"inloop_round_seconds_{label}"] = controller.cost_SxW[s]
  return metrics
