"""The in-loop draft-shape controller of a `specrl train` run (``--drafter.adaptive``):
its round-cost table (given by ``--drafter.round_seconds`` or measured at the start of
a fresh run on the run's own device) and its place in the train state, fresh or as a
checkpoint's restore target (a resumed run takes the checkpoint's, measurements and
all, and measures nothing)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specrl_jax.config import ConfigError
from specrl_jax.rl.app.drafter_section import DrafterSection
from specrl_jax.rl.loop.rollout import RolloutConfig
from specrl_jax.rl.loop.shape_calibration import calibrate_rollout, rollout_widths
from specrl_jax.rl.loop.shape_control import with_controller
from specrl_jax.rl.loop.train_state import TrainState
from specrl_jax.rl.tasks.base import PromptBatch
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.inloop import InLoopState
from specrl_jax.speculative.inloop_rollout import in_loop_config


def round_cost_table(section: DrafterSection, policy: nnx.Module, drafter: Drafter,
                     rollout_config: RolloutConfig, rollout_mesh: Mesh, *,
                     prompts: PromptBatch, prompt_width: int, engine: EngineConfig,
                     rng: jax.Array, log: Callable[[str], None]) -> tuple[np.ndarray, float]:
  """(seconds per round [shapes, widths], seconds of a rollout outside its rounds):
  ``section.round_seconds`` reshaped (and 0), or both measured."""
  spec = section.spec()
  widths = rollout_widths(policy.config, rollout_config, rollout_mesh,
                          prompt_width=prompt_width, drafter=drafter, spec=spec,
                          engine=engine)
  shapes = len(in_loop_config(spec).shapes)
  if section.round_seconds:
    if len(section.round_seconds) != shapes * len(widths):
      raise ConfigError(
          f"DrafterSection.round_seconds has {len(section.round_seconds)} entries: expected "
          f"{shapes} shapes x {len(widths)} widths {widths} = {shapes * len(widths)} "
          "(rows plain, chains, trees; columns widest first).")
    return np.asarray(section.round_seconds, np.float32).reshape(shapes, len(widths)), 0.0
  # Every process must choose alike: process 0 measures (it holds the rollout mesh's
  # first devices) and the others take its table; their clocks would differ.
  if jax.process_index() == 0:
    graphdef, params = nnx.split(policy)
    calibration = calibrate_rollout(graphdef, params, drafter.params(), policy.config,
                                    rollout_config, rollout_mesh, prompts=prompts,
                                    prompt_width=prompt_width, drafter=drafter, spec=spec,
                                    engine=engine, rng=rng,
                                    repeats=section.calibration_repeats)
    cost_SxW, fixed = calibration.cost_SxW, np.float32(calibration.fixed_seconds)
  else:
    cost_SxW, fixed = np.zeros((shapes, len(widths)), np.float32), np.float32(0)
  if jax.process_count() > 1:
    cost_SxW, fixed = multihost_utils.broadcast_one_to_all((cost_SxW, fixed))
  labels = in_loop_config(spec).labels
  log("in-loop controller: round seconds measured per width "
      + ", ".join(f"{label} " + "/".join(f"{x * 1e3:.2f}" for x in row) + " ms"
                  for label, row in zip(labels, cost_SxW))
      + f" at widths {widths}, {float(fixed) * 1e3:.1f} ms a rollout outside the rounds")
  return np.asarray(cost_SxW), float(fixed)


def add_controller(state: TrainState, section: DrafterSection,
                   table: tuple[np.ndarray, float], mesh: Mesh) -> TrainState:
  """``state`` with a fresh controller on ``round_cost_table``'s ``table``."""
  return with_controller(state, section.spec(), table[0], mesh, fixed_seconds=table[1])


def abstract_controller(state: TrainState, section: DrafterSection, widths: int,
                        mesh: Mesh) -> TrainState:
  """``state`` (abstract) with the controller's ShapeDtypeStructs: what a checkpoint
  of an adaptive run restores onto."""
  config = in_loop_config(section.spec())
  controller = InLoopState.initial(config, np.ones((len(config.shapes), widths)))
  replicated = NamedSharding(mesh, P())
  return state.replace(controller=jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated), controller))
