"""Measuring the in-loop controller's round costs on the RL rollout's own engine.

``calibrate_rollout`` times each shape of the menu on the first batch shard's prompts
of a step, with that shard's layout (slots, pages, compaction widths) and the same
round hook the rollout compiles, on the first device of the rollout mesh that this
process drives: one compiled program per compaction width, each timed apart
(``speculative.inloop_calibration.time_shapes``).
On a mesh that splits heads over "tensor" the calibration still decodes with whole
weights on one device, so its costs are those of one shard's work done alone.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from specrl_jax.config import SpecConfig
from specrl_jax.parallel.mesh import data_parallel_size
from specrl_jax.rl.loop.rollout import RolloutConfig, shard_plan
from specrl_jax.rl.tasks.base import PromptBatch
from specrl_jax.sampling.compaction import stage_widths
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.rollout import generate_whole
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.inloop import InLoopState
from specrl_jax.speculative.inloop_calibration import REPEATS, Calibration, time_shapes
from specrl_jax.speculative.inloop_rollout import in_loop_config


def rollout_widths(model_config, rollout_config: RolloutConfig, mesh: Mesh, *,
                   prompt_width: int, drafter: Drafter, spec: SpecConfig,
                   engine: EngineConfig) -> tuple[int, ...]:
  """The compaction widths each batch shard of the rollout decodes in."""
  layout = shard_plan(model_config, rollout_config, mesh, prompt_width=prompt_width,
                      drafter=drafter, spec=spec, engine=engine)[0].layout
  return stage_widths(layout.num_slots, layout.compaction_min_width)


def calibrate_rollout(graphdef: nnx.GraphDef, params, drafter_params, model_config,
                      rollout_config: RolloutConfig, mesh: Mesh, *, prompts: PromptBatch,
                      prompt_width: int, drafter: Drafter, spec: SpecConfig,
                      engine: EngineConfig, rng: jax.Array,
                      repeats: int = REPEATS) -> Calibration:
  """Seconds per round of each menu shape at each width (``Calibration``), timed on
  ``prompts`` (host arrays: a step's prompts; the first shard's are decoded)."""
  plan, _, hook = shard_plan(model_config, rollout_config, mesh, prompt_width=prompt_width,
                             drafter=drafter, spec=spec, engine=engine)
  layout = plan.layout
  widths = stage_widths(layout.num_slots, layout.compaction_min_width)
  local = rollout_config.prompts_per_step // data_parallel_size(mesh)
  group = rollout_config.group_size
  # A device this process drives: under multi-process async the rollout mesh is not
  # every process's, and jax.devices()[0] is process 0's.
  device = next((d for d in mesh.devices.flat if d.process_index == jax.process_index()),
                None)
  if device is None:
    raise ValueError(f"calibrate_rollout: process {jax.process_index()} holds none of the "
                     "rollout mesh's devices; call it on a process that does (process 0).")
  inputs = jax.device_put((
      np.asarray(prompts.tokens_PxT)[:local], np.asarray(prompts.lengths_P)[:local],
      np.repeat(np.arange(local, dtype=np.int32), group),
      np.arange(local, dtype=np.int32) * group + group - 1), device)
  params, drafter_params = jax.device_put((jax.device_get(params),
                                           jax.device_get(drafter_params)), device)

  def run(controller: InLoopState, key: jax.Array):
    return generate_whole(graphdef, params, inputs, key, sampling=rollout_config.sampling,
                          layout=layout, rounds=hook,
                          hook_params=(drafter_params, jax.device_put(controller, device)))

  return time_shapes(run, in_loop_config(spec), widths, rng=rng, repeats=repeats)


def controller_shape(spec: SpecConfig, widths: tuple[int, ...]) -> tuple[int, int]:
  """(shapes, widths) of the controller's round-cost table."""
  return len(in_loop_config(spec).shapes), len(widths)


