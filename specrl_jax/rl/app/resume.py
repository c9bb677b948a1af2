"""Resuming a run: the latest checkpoint that is finite and readable.

A checkpoint holding a NaN or infinity (written before the finite-update guard existed)
is deleted with a warning; one whose files are damaged (its recorded shapes fit the
train state, its arrays cannot be read back) is set aside as ``damaged-<step>``; in
both cases the one before it is tried. A checkpoint that does not fit the
configuration's train state is an error, never skipped: it belongs to another run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from specrl_jax import checkpoint
from specrl_jax.config import ConfigError
from specrl_jax.parallel import distributed
from specrl_jax.rl.loop import numerics
from specrl_jax.rl.loop.learner import TrainState


def restore_latest(manager: checkpoint.TrainCheckpointManager, abstract: TrainState, *,
                   log: Callable[[str], None]
                   ) -> tuple[TrainState, dict[str, Any] | None, int] | None:
  """(state, in_flight, step) of the newest good checkpoint; None when none is."""
  first_bad = jax.jit(numerics.first_nonfinite_leaf)
  for step in reversed(manager.all_steps()):
    restored = restore_step(manager, abstract, step, log=log)
    if restored is None:
      continue
    state, in_flight = restored
    bad = int(distributed.fetch(first_bad(state)))
    if bad < 0:
      return state, in_flight, step
    log(f"warning: checkpoint step {step} holds a non-finite "
        f"{numerics.leaf_name(state, bad)}: deleted, trying the one before")
    manager.delete(step)
  return None


def restore_step(manager: checkpoint.TrainCheckpointManager, abstract: TrainState, step: int,
                 *, log: Callable[[str], None]
                 ) -> tuple[TrainState, dict[str, Any] | None] | None:
  """(state, in_flight) of checkpoint ``step``; None when its files are damaged (it
  is set aside with a warning, so the one before is tried). Raises ConfigError for
  a checkpoint that does not fit this configuration's train state."""
  try:
    return manager.restore_with_in_flight(abstract, step=step)
  except Exception as error:  # orbax raises whatever its reader hit
    failure = f"{type(error).__name__}: {str(error)[:300]}"
    try:
      mismatch = manager.layout_mismatch(abstract, step)
    except checkpoint.CheckpointDamagedError as damage:
      mismatch, failure = None, str(damage)
    if mismatch is not None:
      raise ConfigError(
          f"checkpoint step {step} in {manager.directory} does not fit this "
          f"configuration's train state ({mismatch}; {failure}); resume with the "
          "configuration that wrote it, or --output.resume=false.") from error
  moved = manager.set_aside(step)
  log(f"warning: checkpoint step {step} in {manager.directory} is damaged (its "
      f"arrays fit this configuration but cannot be read back: {failure[:200]}): "
      f"moved to {moved}, resuming from the checkpoint before it")
  return None
