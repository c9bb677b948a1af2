"""Orbax checkpoints: a model's nnx state, and whole train states under a manager.

Restoring takes a *target*: a pytree of arrays or ShapeDtypeStructs whose shardings
say where every restored shard goes. A checkpoint written on one mesh therefore
restores onto any other mesh shape (or host count): orbax reads each device's slice
of each array directly. All processes of a multi-host job call save and restore;
orbax coordinates them.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx


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


class TrainCheckpointManager:
  """Periodic checkpoints of a full train state: keep the newest N, resume the latest.

  ``save`` is asynchronous by default: it returns once the arrays are copied off the
  devices and writes in the background; ``wait_until_finished`` (or ``close``) blocks
  until the files are complete.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
               save_interval_steps: int = 1, async_save: bool = True):
    self.directory = _absolute(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
        enable_async_checkpointing=async_save, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, state: Any, *, force: bool = False) -> bool:
    """Saves ``state`` as ``step`` if the interval says so (or ``force``); True if saved."""
    return self._manager.save(int(step), args=ocp.args.StandardSave(state), force=force)

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
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
    abstract = abstract_with_shardings(target, shardings)
    return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

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
