"""Multi-process JAX: start-up with bounded waits and clear errors, process-local data,
and moving arrays between sub-meshes that live on different processes.

    distributed.initialize(DistributedConfig(coordinator="10.0.0.1:1234",
                                             num_processes=4, process_id=rank))
    distributed.initialize(DistributedConfig())   # TPU VM, SLURM, Open MPI, k8s: detected

Every process runs the same program over one global view of all devices; only data
loading (``process_rows``) and logging (``is_primary``) look at the process index.

Failures are bounded in time. A non-coordinator process that cannot reach the
coordinator raises ``DistributedError`` after ``initialization_timeout`` seconds;
processes that do not all join stop with exit code ``INIT_TIMEOUT_EXIT_CODE`` and a
message naming what was waited for; once running, a process that dies makes JAX's
coordination service stop every other process within ``heartbeat_timeout`` seconds
("The following tasks are unhealthy (stopped sending heartbeats)"), so no collective
waits forever on a dead peer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specrl_jax.config import check, check_positive_int

# A process whose peers did not all join within the timeout exits with this code
# (jax.distributed would abort the process a moment later with SIGABRT).
INIT_TIMEOUT_EXIT_CODE = 3


class DistributedError(RuntimeError):
  """Processes could not be started together, or they disagree about the job."""


def _parse_address(owner: str, name: str, address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  check(bool(host) and port.isdigit() and 0 < int(port) < 65536, owner, name, address,
        "HOST:PORT with a port in 1..65535")
  return host.strip("[]"), int(port)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
  """How this process joins a multi-process job.

  coordinator, num_processes, process_id: all three given ("HOST:PORT" of process 0,
    the process count, this process's id in 0..num_processes-1), or all None to let
    jax.distributed detect them from the environment (Cloud TPU VMs, SLURM, Open MPI,
    Kubernetes indexed jobs, or JAX_COORDINATOR_ADDRESS with a detected count).
  local_device_ids: restrict this process to these local accelerators (None: all).
  initialization_timeout: seconds to wait for the coordinator and for every process
    to join.
  heartbeat_timeout: seconds after which a silent process counts as dead and the
    others are stopped.
  shutdown_timeout: seconds a finishing process waits for the others at exit.
  """
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_device_ids: tuple[int, ...] | None = None
  initialization_timeout: int = 300
  heartbeat_timeout: int = 100
  shutdown_timeout: int = 300

  def __post_init__(self):
    owner = "DistributedConfig"
    given = [v is not None for v in (self.coordinator, self.num_processes, self.process_id)]
    check(all(given) or not any(given), owner, "coordinator",
          (self.coordinator, self.num_processes, self.process_id),
          "coordinator, num_processes and process_id all given, or none of them "
          "(auto-detection)")
    if self.coordinator is not None:
      _parse_address(owner, "coordinator", self.coordinator)
      check_positive_int(owner, "num_processes", self.num_processes)
      check(isinstance(self.process_id, int) and 0 <= self.process_id < self.num_processes,
            owner, "process_id", self.process_id, f"an integer in 0..{self.num_processes - 1}")
    for name in ("initialization_timeout", "heartbeat_timeout", "shutdown_timeout"):
      value = getattr(self, name)
      check(isinstance(value, int) and not isinstance(value, bool) and value > 0, owner, name,
            value, "a positive number of seconds")

  @property
  def auto_detect(self) -> bool:
    return self.coordinator is None


def _stderr(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def wait_for_coordinator(address: str, timeout: float) -> None:
  """Returns once something accepts TCP connections at ``address``; raises
  DistributedError after ``timeout`` seconds (jax.distributed itself would abort
  the process with a gRPC deadline message)."""
  host, port = _parse_address("wait_for_coordinator", "address", address)
  deadline = time.monotonic() + timeout
  while True:
    try:
      with socket.create_connection((host, port), timeout=max(0.1, min(1.0, timeout))):
        return
    except OSError as error:
      if time.monotonic() >= deadline:
        raise DistributedError(
            f"could not reach the coordinator at {address} within {timeout:g}s ({error}). "
            "Process 0 must be running and listening there: start it, and check the host, "
            "the port and any firewall between the hosts.") from None
      time.sleep(0.2)


def _watchdog(config: DistributedConfig, seconds: float) -> threading.Timer:
  """Ends the process with a clear message unless start-up is done in ``seconds``."""
  if config.auto_detect:
    what = "the processes detected from the environment did not all join"
  else:
    what = (f"process {config.process_id} reached the coordinator at {config.coordinator} "
            f"but not all {config.num_processes} processes joined")

  def expire():
    _stderr(f"specrl: jax.distributed did not start within {config.initialization_timeout}s: "
            f"{what}. Start every process with the same coordinator and process count, and "
            "each with its own process id.")
    os._exit(INIT_TIMEOUT_EXIT_CODE)  # the main thread is blocked inside jax

  timer = threading.Timer(seconds, expire)
  timer.daemon = True
  return timer


def initialize(config: DistributedConfig, *, log: Callable[[str], None] = _stderr) -> None:
  """Joins the multi-process job; call before any other JAX computation.

  CPU devices communicate with gloo collectives (over TCP), accelerators with their
  own (NCCL, ICI). ``log`` receives one line saying which process this is.
  """
  if jax.distributed.is_initialized():
    raise DistributedError("jax.distributed is already initialized in this process.")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  deadline = time.monotonic() + config.initialization_timeout
  if not config.auto_detect and config.process_id != 0:
    wait_for_coordinator(config.coordinator, config.initialization_timeout)
  timer = _watchdog(config, max(1.0, deadline - time.monotonic()))
  timer.start()
  try:
    # jax's own deadline comes after the watchdog's, so the clearer message wins.
    jax.distributed.initialize(
        coordinator_address=config.coordinator, num_processes=config.num_processes,
        process_id=config.process_id,
        local_device_ids=(list(config.local_device_ids) if config.local_device_ids is not None
                          else None),
        initialization_timeout=config.initialization_timeout + 30,
        heartbeat_timeout_seconds=config.heartbeat_timeout,
        shutdown_timeout_seconds=config.shutdown_timeout)
  except RuntimeError as error:
    # JAX has no public name for "devices already created"; its own check is the
    # first thing initialize does.
    if "must be called before" not in str(error):
      raise
    raise DistributedError(
        "JAX already created its devices in this process, so it can no longer join a "
        "multi-process job: call distributed.initialize before any JAX computation.") from error
  except ValueError as error:
    if config.auto_detect:
      raise DistributedError(
          f"no cluster environment was detected ({error}): on Cloud TPU, SLURM, Open MPI or "
          "a Kubernetes indexed job the arguments are found automatically; elsewhere pass "
          "the coordinator address, the process count and this process's id.") from error
    raise
  finally:
    timer.cancel()
  log(f"process {jax.process_index()} of {jax.process_count()}: "
      f"{jax.local_device_count()} local / {jax.device_count()} global "
      f"{jax.devices()[0].platform} devices; a process that dies stops the others within "
      f"{config.heartbeat_timeout}s")


def is_primary() -> bool:
  """True on the one process that writes logs, metrics files and plots."""
  return jax.process_index() == 0


def check_same_on_all_processes(text: str, what: str) -> None:
  """Raises DistributedError on every process if ``text`` differs between processes
  (e.g. the run configuration): processes that run different programs would deadlock
  in their first collective instead of failing."""
  digest = np.array([zlib.crc32(text.encode())], np.uint32)
  digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
  if len(set(digests.tolist())) > 1:
    groups = {}
    for process, value in enumerate(digests.tolist()):
      groups.setdefault(value, []).append(process)
    raise DistributedError(f"the processes disagree about {what}: processes "
                           f"{sorted(groups.values())} hold different values. Start every "
                           "process with the same arguments.")


def process_rows(sharding: jax.sharding.Sharding, num_rows: int) -> slice:
  """The rows (leading dimension) of a ``num_rows`` array laid out by ``sharding``
  that this process's devices hold: what it loads for
  ``jax.make_array_from_process_local_data``. Raises if they are not one block."""
  spans = sorted({(index[0].start or 0, num_rows if index[0].stop is None else index[0].stop)
                  for index in sharding.addressable_devices_indices_map((num_rows,)).values()})
  if not spans:
    return slice(0, 0)
  start, stop = spans[0]
  for begin, end in spans[1:]:
    if begin > stop:
      raise DistributedError(
          f"process {jax.process_index()} holds rows {spans} of the batch, not one block: "
          "order the mesh's devices so each process's devices are adjacent on the batch "
          "axes.")
    stop = max(stop, end)
  return slice(start, stop)


def local_batch_to_global(local: Any, sharding: NamedSharding, num_rows: int) -> Any:
  """Global arrays of ``num_rows`` rows laid out by ``sharding`` from each process's
  rows ``process_rows(sharding, num_rows)`` (a pytree of host arrays)."""
  def to_global(x):
    x = np.asarray(x)
    shape = (num_rows,) + x.shape[1:]
    if not sharding.addressable_devices:  # a sub-mesh of other processes' devices
      return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=x.dtype)
    return jax.make_array_from_process_local_data(sharding, x, shape)
  return jax.tree.map(to_global, local)


# --------------------------------------------------------------- moving arrays

def _devices(sharding: jax.sharding.Sharding) -> list[jax.Device]:
  if isinstance(sharding, NamedSharding):
    return list(sharding.mesh.devices.flat)
  return sorted(sharding.device_set, key=lambda d: d.id)


@functools.lru_cache(maxsize=64)
def _broadcast_rows(union: Mesh):
  """Jitted over ``union`` (rows: the source, then copies to fill): every leaf's row 0
  replicated on all devices. XLA lowers it to a broadcast between the processes."""
  return jax.jit(lambda tree: jax.tree.map(lambda x: x[0], tree),
                 out_shardings=NamedSharding(union, P()))


def _from_buffers(shape, dtype, sharding: NamedSharding,
                  buffers: dict[jax.Device, jax.Array]) -> jax.Array:
  """The global array whose shard on each of this process's devices is ``buffers``."""
  local = [buffers[d] for d in sharding.addressable_devices_indices_map(shape)]
  return jax.make_array_from_single_device_arrays(shape, sharding, local, dtype=dtype)


def transfer(tree: Any, shardings: Any) -> Any:
  """``tree``'s arrays laid out by ``shardings`` (one sharding or a matching pytree),
  device to device, also between sub-meshes that live on different processes.

  Within one process, or between layouts of the same devices, this is
  ``jax.device_put``. Otherwise (where device_put cannot move data) the arrays are
  replicated on their source devices and broadcast to the destination devices they
  are not on yet by one jitted collective over a mesh spanning both (gloo on CPU,
  NCCL or ICI on accelerators), then laid out as asked. Every process must call it
  with the same arguments, like any computation over other processes' devices.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  targets = ([shardings] * len(leaves) if isinstance(shardings, jax.sharding.Sharding)
             else treedef.flatten_up_to(shardings))
  sources = {frozenset(leaf.sharding.device_set) for leaf in leaves}
  destinations = {frozenset(target.device_set) for target in targets}
  if len(sources) != 1 or len(destinations) != 1:
    raise ValueError("transfer moves a tree from one set of devices to one set of devices; "
                     f"got {len(sources)} source and {len(destinations)} destination sets.")
  source_set, destination_set = sources.pop(), destinations.pop()
  local = set(jax.local_devices())
  # Branches that issue collectives must be taken alike on every process.
  if source_set == destination_set:
    return jax.device_put(tree, shardings)
  owners = {device.process_index for device in source_set | destination_set}
  if len(owners) == 1:  # one process moves the data locally; the others hold no part
    if owners == {jax.process_index()}:
      return jax.device_put(tree, shardings)
    return jax.tree.unflatten(treedef, [
        jax.make_array_from_single_device_arrays(leaf.shape, target, [], dtype=leaf.dtype)
        for leaf, target in zip(leaves, targets)])
  source, destination = _devices(leaves[0].sharding), _devices(targets[0])
  # Typed PRNG keys travel as their raw data.
  impls = [jax.random.key_impl(leaf)
           if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else None
           for leaf in leaves]
  leaves = [jax.random.key_data(leaf) if impl is not None else leaf
            for leaf, impl in zip(leaves, impls)]
  on_source = jax.device_put(leaves, NamedSharding(Mesh(np.array(source), ("d",)), P()))
  buffers = [{shard.device: shard.data for shard in leaf.addressable_shards}
             for leaf in on_source]
  new = [device for device in destination if device not in source_set]
  if new:
    # Rows of `width` devices: row 0 sends (a slice of the source), the others tile
    # the new devices and receive.
    width = math.gcd(len(source), len(new))
    union = Mesh(np.array(source[:width] + new).reshape(-1, width), ("row", "copy"))
    rows = NamedSharding(union, P("row"))
    stacked = []
    for leaf, held in zip(on_source, buffers):
      rows_buffers = {device: held[device][None] for device in source[:width]
                      if device in local}
      for device in new:
        if device in local:
          rows_buffers[device] = jnp.zeros((1,) + leaf.shape, leaf.dtype, device=device)
      stacked.append(_from_buffers((union.devices.shape[0],) + leaf.shape, leaf.dtype,
                                   rows, rows_buffers))
    for held, received in zip(buffers, _broadcast_rows(union)(stacked)):
      held.update({shard.device: shard.data for shard in received.addressable_shards
                   if shard.device in new})
  replicated = NamedSharding(Mesh(np.array(destination), ("d",)), P())
  landed = [_from_buffers(leaf.shape, leaf.dtype, replicated, held)
            for leaf, held in zip(on_source, buffers)]
  landed = [leaf if impl is None else jax.random.wrap_key_data(leaf, impl=impl)
            for leaf, impl in zip(landed, impls)]
  return jax.device_put(jax.tree.unflatten(treedef, landed), shardings)


def everywhere() -> NamedSharding:
  """Replicated on every device of every process: what all processes can read."""
  return NamedSharding(Mesh(np.array(jax.devices()), ("devices",)), P())


def fetch(tree: Any) -> Any:
  """Host (numpy) copies of ``tree``'s arrays on every process, wherever they live:
  arrays not replicated on every process are first transferred to every device (one
  transfer per source device set)."""
  leaves, treedef = jax.tree.flatten(tree)
  processes = jax.process_count()

  def readable_everywhere(leaf) -> bool:  # the same answer on every process
    return processes == 1 or (leaf.is_fully_replicated and len(
        {device.process_index for device in leaf.sharding.device_set}) == processes)

  groups: dict[frozenset, list[int]] = {}
  for index, leaf in enumerate(leaves):
    if not readable_everywhere(leaf):
      groups.setdefault(frozenset(leaf.sharding.device_set), []).append(index)
  for indices in groups.values():
    for index, moved in zip(indices, transfer([leaves[i] for i in indices], everywhere())):
      leaves[index] = moved
  return jax.tree.unflatten(treedef, [np.asarray(x) for x in jax.device_get(leaves)])
