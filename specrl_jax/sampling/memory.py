"""The engine's side of memory planning: its config and drafter in, a ``MemoryPlan`` out."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from specrl_jax.config import ModelConfig
from specrl_jax.kv.planner import MemoryPlan, device_memory_stats, plan_memory
from specrl_jax.parallel.rules import named_shardings, rollout_rules
from specrl_jax.sampling.hooks import RoundHook


def tree_bytes(tree, *, per_device: bool = True) -> int:
  """Bytes of the arrays in ``tree``. per_device: on the device holding the most of
  them (all of each leaf that is a host array, unsharded, or abstract); else their
  logical size, from shapes and dtypes alone (tracers and abstract arrays too)."""
  held: dict = {}
  for leaf in jax.tree.leaves(tree):
    if not hasattr(leaf, "dtype"):
      continue
    shards = getattr(leaf, "addressable_shards", None) if per_device else None
    if shards is None:
      held[None] = held.get(None, 0) + math.prod(np.shape(leaf)) * np.dtype(leaf.dtype).itemsize
      continue
    for shard in shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  host = held.pop(None, 0)
  return host + max(held.values(), default=0)


def sharded_bytes(params, mesh: Mesh) -> int:
  """Bytes of ``params`` on one device once laid out for decoding on ``mesh`` (the
  rollout rules), from shapes alone: nothing is placed."""
  shardings = jax.tree.leaves(named_shardings(params, mesh, rollout_rules()))
  return sum(math.prod(sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
             for leaf, sharding in zip(jax.tree.leaves(params), shardings, strict=True))


def plan_engine_memory(config: ModelConfig, engine, drafter: RoundHook | None = None, *,
                       weight_bytes: int | None = None, tensor_shards: int = 1
                       ) -> MemoryPlan | None:
  """The plan for ``engine``'s memory budget, or None when it sizes the pool otherwise.

  weight_bytes: the target's weights on one device; default: ``config``'s parameters in
    its param dtype over ``tensor_shards`` (roughly: norms are replicated). A drafter's
    weights are added, whole.
  """
  if engine.memory_fraction is None and engine.memory_budget_bytes is None:
    return None
  if weight_bytes is None:
    itemsize = np.dtype(jax.numpy.dtype(config.param_dtype)).itemsize
    weight_bytes = config.num_params() * itemsize // tensor_shards
  extra_layers = ()
  if drafter is not None:
    weight_bytes += tree_bytes(drafter.params())
    extra_layers = drafter.kv_layers()
  return plan_memory(
      config, kv_dtype=engine.kv_dtype or config.dtype, page_size=engine.page_size,
      weight_bytes=weight_bytes,
      memory_budget_bytes=engine.memory_budget_bytes, memory_fraction=engine.memory_fraction,
      memory_stats=device_memory_stats() if engine.memory_fraction is not None else None,
      tensor_shards=tensor_shards, extra_kv_layers=extra_layers)
