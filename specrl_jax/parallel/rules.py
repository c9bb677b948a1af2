"""Partition rules: which mesh axes each parameter's dimensions are split over.

Rules are (path regex, PartitionSpec) pairs matched with ``re.search`` against a
leaf's path, e.g. "params/layers/0/attn/q_proj". The first matching rule wins and
unmatched leaves are replicated. Because the optimizer's moments reuse the
parameter paths as suffixes ("opt_state/0/mu/layers/0/attn/q_proj"), one rule set
shards parameters and their Adam moments identically, and a drafter built from the
same layers picks up the same layout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

PartitionRules = Sequence[tuple[str, P]]

# specrl_jax.Transformer stores heads explicitly (q_proj [D, H, Dh], o_proj [H, Dh, D]),
# so "heads over tensor" is a per-dimension rule with no reshapes. D (the model width)
# is split over fsdp: every large matrix has one, so FSDP shards all of them.
TRANSFORMER_RULES: PartitionRules = (
    (r"(^|/)embed$", P("tensor", "fsdp")),             # [V, D]
    (r"(^|/)lm_head$", P("fsdp", "tensor")),           # [D, V]
    (r"(^|/)(q|k|v)_proj$", P("fsdp", "tensor", None)),  # [D, heads, Dh]
    (r"(^|/)o_proj$", P("tensor", None, "fsdp")),      # [H, Dh, D]
    (r"(^|/)(q|k|v)_bias$", P("tensor", None)),        # [heads, Dh]
    (r"(^|/)(gate|up)_proj$", P("fsdp", "tensor")),    # [D, F]
    (r"(^|/)down_proj$", P("tensor", "fsdp")),         # [F, D]
    (r"(^|/)scale$", P()),                             # norm weights: tiny, replicated
)


# In a rollout the vocabulary stays whole and the embedding's width is split instead:
# logits then come out of one all-reduce over the tensor group, replicated, and sampling
# reads them locally. Vocabulary-split logits made the partitioner slice them with
# collective permutes inside the decode loop, which XLA:CPU rendezvouses over every
# device, so batch shards that leave the loop at different rounds deadlocked.
_ROLLOUT_VOCABULARY_RULES: PartitionRules = (
    (r"(^|/)embed$", P(None, "tensor")),               # [V, D]
    (r"(^|/)lm_head$", P("tensor", None)),             # [D, V]
)


def rollout_rules(rules: PartitionRules = TRANSFORMER_RULES) -> PartitionRules:
  """``rules`` for decoding: "fsdp" dropped. In a rollout fsdp is a batch axis (each
  shard decodes its own requests), so weights are whole along it and split over
  "tensor" only (the embedding and LM head over their width, not the vocabulary)."""
  def without_fsdp(spec: P) -> P:
    def keep(axes):
      names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
      names = tuple(name for name in names if name != "fsdp")
      return None if not names else names[0] if len(names) == 1 else names
    return P(*(keep(axes) for axes in spec))
  return _ROLLOUT_VOCABULARY_RULES + tuple((pattern, without_fsdp(spec))
                                           for pattern, spec in rules)


# Wrappers that carry a value but are not part of the parameter's name.
_VALUE_KEYS = ("value", "raw_value")


def _key_name(key) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def path_string(path) -> str:
  """"layers/0/attn/q_proj" for a jax key path (nnx Variable ``.value`` dropped)."""
  names = [_key_name(key) for key in path]
  while names and names[-1] in _VALUE_KEYS:
    names.pop()
  return "/".join(names)


def _fit_to_mesh(spec: P, shape: tuple[int, ...], mesh: Mesh | None) -> P:
  """Drops mesh axes from dimensions they do not divide (e.g. 2 KV heads, tensor=4).

  A dimension too small to split is replicated rather than failing, since GQA models
  routinely have fewer KV heads than tensor shards.
  """
  if mesh is None:
    return spec
  fitted = []
  for size, axes in zip(shape, spec):
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    ways = 1
    for name in names:
      ways *= mesh.shape[name]
    fitted.append(axes if size % ways == 0 else None)
  return P(*fitted)


def spec_for(path: str, shape: tuple[int, ...], rules: PartitionRules,
             mesh: Mesh | None = None) -> P:
  """The PartitionSpec the first matching rule gives a leaf of this path and shape.

  A rule whose rank differs from the leaf's (scalars such as optimizer step counts,
  factored second moments) replicates the leaf.
  """
  for pattern, spec in rules:
    if re.search(pattern, path):
      if len(spec) not in (0, len(shape)):
        return P()
      return _fit_to_mesh(spec, shape, mesh)
  return P()


def partition_specs(tree: Any, rules: PartitionRules, mesh: Mesh | None = None) -> Any:
  """A pytree of PartitionSpecs with ``tree``'s structure (leaves need ``.shape``)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: spec_for(path_string(path), tuple(leaf.shape), rules, mesh), tree)


def named_shardings(tree: Any, mesh: Mesh, rules: PartitionRules) -> Any:
  """A pytree of NamedShardings on ``mesh`` for a state pytree (arrays or abstract)."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                      partition_specs(tree, rules, mesh),
                      is_leaf=lambda x: isinstance(x, P))
