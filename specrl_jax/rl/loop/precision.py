"""Master weights in float32, compute in the model's own dtype.

A bfloat16 model trained with bfloat16 weights and Adam moments loses every update
smaller than half a bf16 ulp of its weight (about 0.4% of it) and keeps moments to 3
significant digits. The train state therefore keeps a *master* copy of every
floating-point leaf (weights and, through them, the optimizer's moments) in
``master_dtype``; the loss and the rollout read the *compute* copy, each leaf cast back
to the dtype the model was built in, so the forward the learner differentiates is the
forward the sampler runs, rounding included.

The compute dtypes are recorded per leaf, as strings, when the state is built; they
are static (part of the state's structure, not its data), so a restored checkpoint
gets them from the abstract state it is restored onto.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Allowed master dtypes; None keeps each leaf in the dtype it came in.
MASTER_DTYPES = ("float32", None)

Dtypes = tuple[str, ...]


def _floating(leaf) -> bool:
  return jnp.issubdtype(leaf.dtype, jnp.floating)


def leaf_dtypes(tree) -> Dtypes:
  """The dtype of every leaf of ``tree`` (concrete or abstract), in flattening order."""
  return tuple(str(jnp.dtype(leaf.dtype)) for leaf in jax.tree.leaves(tree))


def master_copy(tree, master_dtype: str | None):
  """``tree`` with every floating leaf in ``master_dtype`` (None: unchanged)."""
  if tree is None or master_dtype is None:
    return tree
  dtype = jnp.dtype(master_dtype)
  return jax.tree.map(lambda x: x.astype(dtype) if _floating(x) else x, tree)


def compute_copy(tree, dtypes: Dtypes | None):
  """``tree`` cast leaf by leaf to ``dtypes`` (``leaf_dtypes`` of the model as built);
  None, or leaves already in their dtype, are returned as they are (no copy)."""
  if tree is None or dtypes is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  if len(leaves) != len(dtypes):
    raise ValueError(f"{len(dtypes)} compute dtypes recorded for a tree of {len(leaves)} "
                     "leaves: the state was built for another model")
  cast = [leaf if leaf.dtype == jnp.dtype(dtype) else leaf.astype(dtype)
          for leaf, dtype in zip(leaves, dtypes)]
  return jax.tree.unflatten(treedef, cast)


def compute_dtypes_if_changed(tree, master: Any) -> Dtypes | None:
  """The dtypes to cast ``master`` (the master copy of ``tree``) back to, or None when
  the master copy already is the compute copy."""
  if tree is None:
    return None
  dtypes = leaf_dtypes(tree)
  return None if dtypes == leaf_dtypes(master) else dtypes
