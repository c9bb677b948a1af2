"""One rollout plan: what a rollout on a mesh is, decided in one place.

``plan_rollout`` turns (model config, the prompt batch's shape, sampling, engine, round
hook, mesh) into a ``RolloutPlan``: the engine as it can run on the mesh, the layout of
each batch shard's decode program, where the target's and the hook's weights live
(``sharded.rollout_shardings``: split over "tensor", a small drafter replicated), and
the per-shard program (manual over the batch axes; "tensor" left to the compiler, so
every layer and the KV pages' heads split over it). ``sj.generate`` (plain, fixed and
adaptive speculation) and the RL rollouts (sync and async) all build theirs here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from specrl_jax.config import SamplingParams
from specrl_jax.parallel.mesh import BATCH_AXES
from specrl_jax.sampling import sharded
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.hooks import RoundHook
from specrl_jax.sampling.layout import (
    Layout, engine_layout, group_prompts, pack, pack_prompts, padded_width, tensor_shards_of,
    weight_bytes_for,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutPlan:
  """engine: as it runs on ``mesh``; layout: one batch shard's decode program (the
  whole batch's without a mesh); rounds: the round hook (None: plain rounds); shards:
  batch shards (data * fsdp; 1 without a mesh)."""
  engine: EngineConfig
  layout: Layout
  rounds: RoundHook | None
  mesh: Mesh | None
  shards: int

  def shardings(self, params: Any, hook_params: Any) -> tuple[Any, Any, str | None]:
    """(the target's shardings, the hook's, its placement: "replicated" / "tensor";
    all None without a mesh). Reads shapes only: traced weights work too."""
    if self.mesh is None:
      return None, None, None
    return sharded.rollout_shardings(params, hook_params, self.mesh)

  def place(self, params: Any, hook_params: Any) -> tuple[Any, Any, str | None]:
    """(params, hook_params) put where ``shardings`` says, and the hook's placement."""
    if self.mesh is None:
      return params, hook_params, None
    target, hook, placement = self.shardings(params, hook_params)
    return jax.device_put(params, target), jax.device_put(hook_params, hook), placement

  def per_shard(self, fn: Callable, *, in_specs: tuple, out_specs: Any) -> Callable:
    """``fn`` once per batch shard (``shard_map`` manual over the batch axes, and over
    "tensor" too when it has one device)."""
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=sharded.manual_axes(self.mesh), check_vma=False)

  @property
  def rows(self) -> P:
    """The partition of per-request (or per-shard) arrays over the batch shards."""
    return P(BATCH_AXES)


def plan_rollout(config, *, prompt_width: int, prompt_pages: int, num_requests: int,
                 sampling: SamplingParams, engine: EngineConfig, rounds: RoundHook | None,
                 mesh: Mesh | None, weight_bytes: int | None = None) -> RolloutPlan:
  """The plan of a rollout whose batch shards each decode ``num_requests`` samples of
  prompts ``prompt_width`` wide (padded) holding ``prompt_pages`` pages (per shard).
  weight_bytes: the target's on one device, for a memory budget (default: estimated
  from ``config``). Refuses a mesh without the axes or an engine that cannot run on
  it before anything compiles."""
  if mesh is not None:
    sharded.check_mesh(mesh)
  engine = sharded.engine_for_mesh(engine, mesh)
  layout = engine_layout(config, prompt_width=prompt_width, prompt_pages=prompt_pages,
                         num_requests=num_requests, sampling=sampling, engine=engine,
                         drafter=rounds, weight_bytes=weight_bytes,
                         tensor_shards=tensor_shards_of(mesh))
  return RolloutPlan(engine=engine, layout=layout, rounds=rounds, mesh=mesh,
                     shards=sharded.batch_shards(mesh))


def plan_for_prompts(config, prompts: list[list[int]], *, sampling: SamplingParams,
                     engine: EngineConfig, rounds: RoundHook | None, mesh: Mesh | None,
                     params: Any = None
                     ) -> tuple[RolloutPlan, tuple, sharded.RequestBlocks | None]:
  """``plan_rollout`` for validated ``prompts``, with their packed inputs: (plan,
  inputs, blocks). Without batch shards inputs are (tokens_UxT, lengths_U,
  prompt_of_request_R, last_request_U) as device arrays (``layout.pack``) and blocks
  is None; with them the requests are split into contiguous blocks
  (``sharded.RequestBlocks``) and inputs are host arrays with a leading shard axis.
  params: the target's weights, whose bytes a memory budget counts."""
  if mesh is not None:
    sharded.check_mesh(mesh)
  weight_bytes = weight_bytes_for(params, engine, mesh) if params is not None else None
  shards = sharded.batch_shards(mesh)
  if shards == 1:
    engine = sharded.engine_for_mesh(engine, mesh)
    inputs, layout = pack(config, prompts, sampling, engine, rounds=rounds,
                          weight_bytes=weight_bytes, tensor_shards=tensor_shards_of(mesh))
    return RolloutPlan(engine=engine, layout=layout, rounds=rounds, mesh=mesh,
                       shards=1), inputs, None
  blocks = sharded.RequestBlocks.split(prompts, shards)
  width = padded_width(max(len(p) for p in prompts), engine)
  inputs, _ = sharded.pack_blocks(blocks, group_prompts, pack_prompts, width)
  plan = plan_rollout(config, prompt_width=width,
                      prompt_pages=int(np.max(np.sum(-(-inputs[1] // engine.page_size),
                                                     axis=1))),
                      num_requests=len(blocks.blocks[0]), sampling=sampling, engine=engine,
                      rounds=rounds, mesh=mesh, weight_bytes=weight_bytes)
  return plan, inputs, blocks
