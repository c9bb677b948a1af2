"""Generation on a device mesh: requests over ("data", "fsdp"), heads over "tensor".

Each (data, fsdp) shard runs an engine of its own (page pool, slots, queue) on a
contiguous block of the requests. Within a shard the "tensor" axis is left to the
compiler: the weights are placed with heads and MLP columns split over it (the
partition rules of ``specrl_jax.parallel.rules``), and the KV pages, written from the
head-sharded key and value projections, are split by KV head with them (replicated
where there are fewer KV heads than tensor shards). Nothing here changes what a
sequence samples: only where its arithmetic runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specrl_jax.parallel.mesh import BATCH_AXES, data_parallel_size
from specrl_jax.parallel.rules import (
    TRANSFORMER_RULES, PartitionRules, named_shardings, rollout_rules,
)
from specrl_jax.sampling.memory import tree_bytes

# A drafter whose weights are at most this share of the target's is replicated: its
# layers are too narrow for splitting them to pay for the collectives it adds.
REPLICATE_DRAFTER_BELOW = 0.1


def place_weights(params: Any, mesh: Mesh, rules: PartitionRules = TRANSFORMER_RULES) -> Any:
  """The policy's weights laid out for decoding on ``mesh``: split over "tensor" by
  ``rules`` and whole along the batch axes (already-placed arrays are not copied)."""
  return jax.device_put(params, named_shardings(params, mesh, rollout_rules(rules)))


def drafter_placement(drafter_params: Any, target_params: Any, mesh: Mesh) -> str:
  """"replicated" (a drafter at most ``REPLICATE_DRAFTER_BELOW`` of the target's
  bytes, or a mesh without a tensor axis) or "tensor" (split like the target). Reads
  shapes only: works on placed, abstract and traced weights alike."""
  small = (tree_bytes(drafter_params, per_device=False)
           <= REPLICATE_DRAFTER_BELOW * tree_bytes(target_params, per_device=False))
  return "replicated" if small or mesh.shape["tensor"] == 1 else "tensor"


def rollout_shardings(target_params: Any, drafter_params: Any, mesh: Mesh
                      ) -> tuple[Any, Any, str]:
  """Where a rollout on ``mesh`` reads its weights: (the target's shardings, the
  drafter's, ``drafter_placement``). ``generate``, the sync RL step and the async
  pipeline's weight push all lay weights out by this."""
  target = named_shardings(target_params, mesh, rollout_rules())
  placement = drafter_placement(drafter_params, target_params, mesh)
  drafter = (jax.tree.map(lambda _: NamedSharding(mesh, P()), drafter_params)
             if placement == "replicated"
             else named_shardings(drafter_params, mesh, rollout_rules()))
  return target, drafter, placement


def place_drafter(drafter_params: Any, target_params: Any, mesh: Mesh
                  ) -> tuple[Any, str]:
  """(drafter weights on ``mesh``, "replicated" or "tensor"): see ``rollout_shardings``."""
  _, shardings, placement = rollout_shardings(target_params, drafter_params, mesh)
  return jax.device_put(drafter_params, shardings), placement


@dataclasses.dataclass(frozen=True)
class RequestBlocks:
  """The requests split into one equal-sized block per batch shard.

  blocks[s]: shard s's prompts, padded by repeating its last real request (a padded
  request decodes and is dropped); real[s]: how many of them are real.
  """
  blocks: tuple[tuple[tuple[int, ...], ...], ...]
  real: tuple[int, ...]

  @classmethod
  def split(cls, prompts: Sequence[Sequence[int]], shards: int) -> "RequestBlocks":
    per_shard = -(-len(prompts) // shards)
    blocks, real = [], []
    for shard in range(shards):
      block = [tuple(p) for p in prompts[shard * per_shard:(shard + 1) * per_shard]]
      real.append(len(block))
      filler = block[-1] if block else tuple(prompts[-1])
      blocks.append(tuple(block + [filler] * (per_shard - len(block))))
    return cls(blocks=tuple(blocks), real=tuple(real))

  def gather_rows(self, stacked_SxRx: np.ndarray) -> np.ndarray:
    """The real requests' rows of a per-shard [Q, R_s, ...] array, in request order."""
    return np.concatenate([rows[:count] for rows, count in zip(stacked_SxRx, self.real)])


def pack_blocks(blocks: RequestBlocks, group_prompts, pack_prompts, width: int
                ) -> tuple[tuple[np.ndarray, ...], int]:
  """Per-shard engine inputs stacked on a leading shard axis, all shards one shape:
  (tokens_QxUxT, lengths_QxU, prompt_of_request_QxR, last_request_QxU) and the most
  distinct prompts any shard has. A shard with fewer distinct prompts is padded with
  one-token prompts that no request samples (their pages are held to the end)."""
  grouped = [group_prompts([list(p) for p in block]) for block in blocks.blocks]
  most = max(len(unique) for unique, _, _ in grouped)
  stacked = []
  for unique, prompt_of_request, last_request in grouped:
    filler = most - len(unique)
    tokens, lengths = pack_prompts(list(unique) + [(0,)] * filler, width)
    last = np.concatenate([last_request, np.full(filler, -1, np.int32)])
    stacked.append((tokens, lengths, prompt_of_request, last))
  return tuple(np.stack(parts) for parts in zip(*stacked)), most


def per_shard(fn, mesh: Mesh, num_replicated: int):
  """``fn(*replicated, *shard_args)`` once per batch shard: the last arguments carry a
  leading shard axis (one entry each), the first ``num_replicated`` are whole; every
  output gets the leading shard axis back."""
  rows = P(BATCH_AXES)

  def body(*args):
    replicated, sharded = args[:num_replicated], args[num_replicated:]
    local = jax.tree.map(lambda x: x[0], sharded)
    return jax.tree.map(lambda x: x[None], fn(*replicated, *local))

  def run(*args):
    in_specs = (P(),) * num_replicated + (rows,) * (len(args) - num_replicated)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=rows,
                         axis_names=manual_axes(mesh), check_vma=False)(*args)
  return run


def manual_axes(mesh: Mesh) -> set[str]:
  """The axes a per-shard program handles itself: the batch axes, and "tensor" too when
  it has one device (host callbacks, e.g. Python rewards, need a fully manual region)."""
  return set(BATCH_AXES) if mesh.shape["tensor"] > 1 else set(mesh.axis_names)


def batch_shards(mesh: Mesh | None) -> int:
  return 1 if mesh is None else data_parallel_size(mesh)


def on_rows(mesh: Mesh, arrays: Any) -> Any:
  """Host arrays with a leading shard axis, split over the batch axes."""
  return jax.device_put(arrays, NamedSharding(mesh, P(BATCH_AXES)))


def replicate(mesh: Mesh, arrays: Any) -> Any:
  return jax.device_put(arrays, NamedSharding(mesh, P()))


def sum_shards(tree: Any) -> Any:
  """Counters of the shards added up (host arrays with a leading shard axis)."""
  return jax.tree.map(lambda x: np.sum(np.asarray(x), axis=0), tree)


def check_mesh(mesh: Mesh) -> None:
  missing = [axis for axis in (*BATCH_AXES, "tensor") if axis not in mesh.shape]
  if missing:
    raise ValueError(f"mesh has axes {tuple(mesh.shape)}; generate needs ('data', 'fsdp', "
                     f"'tensor') (make one with specrl_jax.parallel.make_mesh), missing "
                     f"{missing}.")


def engine_for_mesh(engine, mesh: Mesh | None):
  """``engine`` as it can run on ``mesh``: the Pallas kernels have no partitioning rule
  over split heads yet, so with a "tensor" axis > 1 attention is the reference
  ("auto" picks it there; an explicit "pallas" is refused)."""
  if mesh is None or mesh.shape.get("tensor", 1) == 1 or engine.attention == "reference":
    return engine
  if engine.attention == "pallas":
    raise ValueError(f"EngineConfig.attention='pallas' cannot run on mesh {dict(mesh.shape)}: "
                     "the kernels do not split KV heads over 'tensor' yet. Use "
                     "attention='auto' or 'reference' there, or a mesh with tensor=1.")
  return dataclasses.replace(engine, attention="reference")
