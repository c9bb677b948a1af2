"""Orbax checkpoints: a model's nnx state, and whole train states under a manager.

Restoring takes a *target*: a pytree of arrays or ShapeDtypeStructs whose shardings
say where every restored shard goes. A checkpoint written on one mesh therefore
restores onto any other mesh shape (or host count): orbax reads each device's slice
of each array directly. All processes of a multi-host job call save and restore;
orbax coordinates them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx


IN_FLIGHT = "in_flight"


_EMPTY = "zero_size_array"


def _encode_host(tree: Any) -> Any:
  """Host data orbax can write: it refuses zero-size arrays (a counter per draft
  position without a drafter), kept as one element of their dtype and their shape."""
  def encode(leaf):
    leaf = np.asarray(leaf)
    if leaf.size:
      return leaf
    return {_EMPTY: np.zeros(1, leaf.dtype), "shape": np.asarray(leaf.shape, np.int64)}
  return jax.tree.map(encode, tree)


def _decode_host(tree: Any) -> Any:
  empty = lambda node: isinstance(node, dict) and set(node) == {_EMPTY, "shape"}
  return jax.tree.map(
      lambda node: np.zeros(tuple(node["shape"]), node[_EMPTY].dtype) if empty(node) else node,
      tree, is_leaf=empty)


def _absolute(directory: str | os.PathLike) -> str:
  directory = os.fspath(directory)
  # Remote paths (gs://...) are already absolute; orbax rejects relative local ones.
  return directory if "://" in directory else os.path.abspath(directory)


def abstract_with_shardings(tree: Any, shardings: Any = None) -> Any:
  """ShapeDtypeStructs describing ``tree`` with the given (or the leaves' own) shardings.

  ``tree`` may hold arrays or ShapeDtypeStructs. Every leaf must end up with a
  sharding: guessing one (say, the first device) would silently change the layout.
  """
  if shardings is None:
    def own(leaf):
      if getattr(leaf, "sharding", None) is None:
        raise ValueError(f"a restore target leaf {leaf} has no sharding: restore onto "
                         "arrays, ShapeDtypeStructs with shardings, or pass shardings=.")
      return leaf.sharding
    shardings = jax.tree.map(own, tree)
  return jax.tree.map(
      lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
      tree, shardings)


def save_model(directory: str | os.PathLike, model: nnx.Module) -> None:
  """Writes ``nnx.state(model)`` to ``directory`` (which must not exist yet)."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(_absolute(directory), nnx.state(model))


def restore_model(directory: str | os.PathLike, model: nnx.Module, *,
                  shardings: Any = None) -> nnx.Module:
  """Loads weights saved by ``save_model`` into ``model`` (updated in place, returned).

  ``model`` may be abstract (``nnx.eval_shape``), then ``shardings`` (a pytree matching
  ``nnx.state(model)``, e.g. ``parallel.named_shardings`` on a mesh) says where the
  arrays go; for a concrete model its arrays' shardings are the default.
  """
  target = abstract_with_shardings(nnx.state(model), shardings)
  with ocp.StandardCheckpointer() as checkpointer:
    state = checkpointer.restore(_absolute(directory), target)
  nnx.update(model, state)
  return model


class CheckpointDamagedError(Exception):
  """A checkpoint's files cannot be read back (truncated, corrupted)."""


def _layout(tree: Any) -> list[tuple[tuple[int, ...], str]]:
  """The sorted (shape, dtype) of every array of ``tree`` (arrays, ShapeDtypeStructs or
  orbax's array metadata)."""
  leaves = jax.tree.leaves(tree)
  return sorted((tuple(int(n) for n in leaf.shape), str(np.dtype(leaf.dtype)))
                for leaf in leaves)


class TrainCheckpointManager:
  """Periodic checkpoints of a full train state: keep the newest N, resume the latest.

  ``save`` is asynchronous by default: it returns once the arrays are copied off the
  devices and writes in the background; ``wait_until_finished`` (or ``close``) blocks
  until the files are complete.

  A checkpoint may carry host data beside the state (``save(..., in_flight=...)``:
  the async pipeline's trajectories not trained on yet); it is then written as
  ``{"state": state, "in_flight": data}`` in the same atomic step folder, and
  ``restore`` still returns the state alone.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
               save_interval_steps: int = 1, async_save: bool = True):
    self.directory = _absolute(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
        enable_async_checkpointing=async_save, create=True)
    # The handler named up front: a fresh manager can then read a step's metadata.
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=ocp.StandardCheckpointHandler())

  def save(self, step: int, state: Any, *, force: bool = False, in_flight: Any = None) -> bool:
    """Saves ``state`` as ``step`` if the interval says so (or ``force``); True if saved.

    ``in_flight``: a pytree of numpy arrays, the same on every process, saved with it.
    """
    item = state if in_flight is None else {"state": state, IN_FLIGHT: _encode_host(in_flight)}
    return self._manager.save(int(step), args=ocp.args.StandardSave(item), force=force)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, target: Any, *, step: int | None = None, shardings: Any = None) -> Any:
    """The state saved at ``step`` (default: the latest), laid out like ``target``.

    ``target`` is a train state on the mesh to resume on: arrays, or the allocation-
    free ``rl.abstract_train_state(...)``; ``shardings`` overrides its leaves'
    shardings. The mesh may differ from the one the checkpoint was written on.
    """
    return self.restore_with_in_flight(target, step=step, shardings=shardings)[0]

  def restore_with_in_flight(self, target: Any, *, step: int | None = None,
                             shardings: Any = None) -> tuple[Any, Any]:
    """(state, in_flight): ``restore``'s state and the host data saved with it (numpy
    arrays on every process), or None where the checkpoint has none."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
    abstract = abstract_with_shardings(target, shardings)
    saved = self._manager.item_metadata(step)
    if saved is None or set(saved.keys()) != {"state", IN_FLIGHT}:
      return self._manager.restore(step, args=ocp.args.StandardRestore(abstract)), None
    # numpy targets restore as numpy, read in full by every process.
    host = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), saved[IN_FLIGHT])
    restored = self._manager.restore(step, args=ocp.args.StandardRestore(
        {"state": abstract, IN_FLIGHT: host}))
    return restored["state"], _decode_host(restored[IN_FLIGHT])

  def layout_mismatch(self, target: Any, step: int) -> str | None:
    """Why checkpoint ``step`` cannot hold ``target``'s arrays, from its metadata: a
    different number of arrays, or of shapes and dtypes; None when they are the
    same (a restore that fails then found the checkpoint damaged, not foreign).
    Raises CheckpointDamagedError when the metadata itself cannot be read."""
    try:
      saved = self._manager.item_metadata(step)
      if saved is not None and set(saved.keys()) == {"state", IN_FLIGHT}:
        saved = saved["state"]
      recorded = _layout(saved)
    except Exception as error:  # orbax raises whatever its reader hit
      raise CheckpointDamagedError(f"its metadata cannot be read ({type(error).__name__}: "
                                   f"{str(error)[:200]})") from error
    wanted = _layout(target)
    if recorded == wanted:
      return None
    if len(recorded) != len(wanted):
      return f"it holds {len(recorded)} arrays, this train state {len(wanted)}"
    first = next(i for i, (a, b) in enumerate(zip(recorded, wanted)) if a != b)
    return (f"its arrays' shapes and dtypes differ, e.g. {recorded[first]} where the train "
            f"state has {wanted[first]}")

  def set_aside(self, step: int) -> str:
    """Moves checkpoint ``step`` out of the manager's sight, to ``damaged-<step>``
    beside the others (kept for inspection); the new path."""
    source = os.path.join(self.directory, str(int(step)))
    target = os.path.join(self.directory, f"damaged-{int(step)}")
    if os.path.exists(target):
      target = f"{target}-{os.getpid()}-{int(time.time())}"
    if jax.process_index() == 0:
      os.rename(source, target)
    self._manager.reload()
    return target

  def delete(self, step: int) -> None:
    """Removes the checkpoint of ``step``."""
    self._manager.delete(int(step))

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> "TrainCheckpointManager":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
