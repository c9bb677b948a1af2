"""The meshes of `specrl train`: where the rollout, the update and the checkpoints'
arrays live, and whether a step's batch splits over them."""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh

from specrl_jax.config import ConfigError
from specrl_jax.parallel.mesh import data_parallel_size, make_mesh
from specrl_jax.rl.app.experiment import RLSection


def run_meshes(rl: RLSection) -> tuple[Mesh, Mesh | None]:
  """(train mesh, rollout mesh or None for sync)."""
  devices = jax.devices()
  processes = jax.process_count()
  if rl.mode == "sync":
    size = math.prod(rl.mesh)
    if size > len(devices):
      raise ConfigError(f"RLSection.mesh={rl.mesh} needs {size} devices; {len(devices)} "
                        "are available.")
    if processes > 1 and size != len(devices):
      raise ConfigError(f"RLSection.mesh={rl.mesh} has {size} devices but the {processes} "
                        f"processes have {len(devices)}: a multi-process mesh must use "
                        "every device (each process feeds its own).")
    return make_mesh(rl.mesh, devices=devices[:size]), None
  needed = rl.rollout_devices + rl.train_devices
  if needed > len(devices):
    raise ConfigError(f"async RL with rollout_devices={rl.rollout_devices} and train_devices="
                      f"{rl.train_devices} needs {needed} devices; {len(devices)} are "
                      "available (on CPU set JAX_NUM_CPU_DEVICES).")
  # Async meshes take the tensor size of rl.mesh (checked by RLSection): the rollout
  # and the train mesh each split heads that many ways and their batch the rest.
  tensor = rl.mesh[2]
  rollout = make_mesh((rl.rollout_devices // tensor, 1, tensor),
                      devices=devices[:rl.rollout_devices])
  train = make_mesh((rl.train_devices // tensor, 1, tensor),
                    devices=devices[rl.rollout_devices:needed])
  return train, rollout


def checkpoint_mesh(train_mesh: Mesh) -> Mesh:
  """The mesh checkpoints are written from and read onto: the train mesh, unless it
  leaves some process out (orbax writes only arrays that span every process; an
  async train mesh may sit on a few hosts), then an FSDP mesh over every device."""
  processes = {device.process_index for device in train_mesh.devices.flat}
  if len(processes) == jax.process_count():
    return train_mesh
  return make_mesh((1, jax.device_count(), 1))


def check_layout(rl: RLSection, train_mesh: Mesh, rollout_mesh: Mesh | None) -> None:
  """Raises ConfigError unless a step's batch splits over the meshes (checked before
  the warm start rather than at the first step's compilation)."""
  shards = data_parallel_size(rollout_mesh or train_mesh)
  if rl.prompts_per_step % shards:
    raise ConfigError(f"RLSection.prompts_per_step={rl.prompts_per_step} is invalid: expected "
                      f"a multiple of the rollout mesh's data*fsdp size {shards} (each shard "
                      "decodes whole groups).")
  rows, replicas = rl.prompts_per_step * rl.group_size, data_parallel_size(train_mesh)
  if rows % replicas:
    raise ConfigError(f"RLSection.prompts_per_step x group_size = {rows} samples is invalid: "
                      f"expected a multiple of the train mesh's data*fsdp size {replicas}.")
