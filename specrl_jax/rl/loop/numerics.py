"""The finite-update guard of the train step (traceable).

The new weights and optimizer state are checked before they are kept: a step whose
update holds a NaN or infinity returns the state it was given (step counter included)
with ``update_finite`` false and the index of the first non-finite leaf, so that the
host can stop the run before anything non-finite is checkpointed. Checking the loss
alone is not enough: an overflowing learning rate turns a finite loss and gradient
into NaN weights.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# The parts of a TrainState an update writes and a checkpoint keeps.
UPDATED = ("params", "opt_state", "drafter_params", "drafter_opt_state")


def _float_leaves(state) -> list[tuple[str, Any]]:
  """(path, leaf) of every floating-point leaf of the updated parts, in a fixed order."""
  leaves = []
  for part in UPDATED:
    tree = getattr(state, part)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if jnp.issubdtype(leaf.dtype, jnp.inexact):
        leaves.append((part + jax.tree_util.keystr(path), leaf))
  return leaves


def leaf_name(state, index: int) -> str:
  """The path of leaf ``index`` as ``first_nonfinite_leaf`` counts (any state of the
  same structure: concrete, abstract or the one the step was compiled for)."""
  return _float_leaves(state)[index][0]


def first_nonfinite_leaf(state) -> jax.Array:
  """int32 index of the first leaf holding a NaN or infinity, -1 if all are finite."""
  leaves = [leaf for _, leaf in _float_leaves(state)]
  if not leaves:
    return jnp.int32(-1)
  bad = jnp.stack([jnp.logical_not(jnp.all(jnp.isfinite(leaf))) for leaf in leaves])
  return jnp.where(jnp.any(bad), jnp.argmax(bad), -1).astype(jnp.int32)


def keep_if_finite(new_state, old_state) -> tuple[Any, dict[str, jax.Array]]:
  """(``new_state`` if its updated parts are all finite, else ``old_state``; metrics
  ``update_finite`` and ``nonfinite_leaf``). Traceable."""
  index = first_nonfinite_leaf(new_state)
  finite = index < 0
  kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, old_state)
  return kept, {"update_finite": finite, "nonfinite_leaf": index}
