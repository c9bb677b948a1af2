"""The device mesh and how a global batch is laid out on it.

Every parallel program here runs over one mesh with axes ("data", "fsdp", "tensor"):
the batch is split over data and fsdp, parameters are sharded over fsdp (and over
tensor for heads and MLP columns). Only jax.distributed-compatible APIs are used, so
the same code runs on one CPU, on a multi-GPU host and on a multi-host TPU pod.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specrl_jax.config import check

AXES = ("data", "fsdp", "tensor")
# The batch dimension is split over both data-parallel axes: fsdp shards parameters
# but, like data, gives each shard different examples.
BATCH_AXES = ("data", "fsdp")


def make_mesh(shape: Sequence[int], *, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh of shape (data, fsdp, tensor) over ``devices`` (default: all global devices).

  The product of ``shape`` must equal the number of devices: a mesh that silently
  used a subset would leave accelerators idle and change the data-parallel size.
  """
  shape = tuple(shape)
  check(len(shape) == len(AXES)
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape),
        "make_mesh", "shape", shape, f"three positive sizes for the axes {AXES}")
  devices = list(jax.devices() if devices is None else devices)
  check(math.prod(shape) == len(devices), "make_mesh", "shape", shape,
        f"sizes whose product equals the {len(devices)} available devices "
        f"(got product {math.prod(shape)})")
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                       devices=devices)


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways the batch is split: data * fsdp."""
  return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension over data and fsdp; all other dimensions whole."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def process_batch_rows(global_batch_size: int) -> slice:
  """The rows of the global batch that this process loads.

  Each host reads only its slice (by ``jax.process_index()``); ``shard_batch`` then
  assembles the global array without moving data between hosts.
  """
  processes = jax.process_count()
  check(global_batch_size % processes == 0, "process_batch_rows", "global_batch_size",
        global_batch_size, f"a multiple of the process count {processes}")
  rows = global_batch_size // processes
  start = jax.process_index() * rows
  return slice(start, start + rows)


def shard_batch(local_batch: Any, mesh: Mesh) -> Any:
  """Global batch arrays from each process's local rows, split as ``batch_sharding``.

  ``local_batch`` is a pytree of host arrays holding this process's rows (all rows on
  a single host). Row order follows process index, matching ``process_batch_rows``.
  """
  sharding = batch_sharding(mesh)
  processes = jax.process_count()

  def to_global(local):
    local = np.asarray(local)
    global_shape = (local.shape[0] * processes,) + local.shape[1:]
    return jax.make_array_from_process_local_data(sharding, local, global_shape)

  return jax.tree.map(to_global, local_batch)
