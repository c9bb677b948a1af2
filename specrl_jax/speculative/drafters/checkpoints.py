"""Native checkpoints of hidden-state drafters: their weights (safetensors, nnx paths)
and draft vocabulary, loaded back into a drafter built for the target."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from specrl_jax.config import ConfigError
from specrl_jax.parallel.rules import path_string
from specrl_jax.speculative.drafters.eagle3 import check_draft_to_target
from specrl_jax.speculative.drafters.hidden_state import HiddenStateDrafter, check_weights

_TABLE_KEY = "draft_to_target"


def save_drafter(directory: str | os.PathLike, drafter: HiddenStateDrafter) -> None:
  """Writes the drafter's weights (safetensors, nnx paths) and its table."""
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  tensors = {f"{part}/{path_string(path)}": np.asarray(leaf)
             for part in ("trainable", "shared")
             for path, leaf in jax.tree_util.tree_leaves_with_path(drafter.weights[part])}
  if drafter.draft_to_target is not None:
    tensors[_TABLE_KEY] = np.asarray(drafter.draft_to_target, np.int32)
  save_file(tensors, os.path.join(directory, "drafter.safetensors"))
  with open(os.path.join(directory, "drafter.json"), "w") as f:
    json.dump({"kind": type(drafter).__name__,
               "hidden_layers": list(drafter.hidden_layers)}, f)


def load_drafter(directory: str | os.PathLike, template: HiddenStateDrafter
                 ) -> HiddenStateDrafter:
  """The weights saved by ``save_drafter`` put into a drafter shaped like ``template``
  (same class, built for the target); shapes are checked with a clear error."""
  directory = os.fspath(directory)
  with open(os.path.join(directory, "drafter.json")) as f:
    meta = json.load(f)
  if meta["kind"] != type(template).__name__:
    raise ConfigError(f"{directory} holds a {meta['kind']} drafter; the template is a "
                      f"{type(template).__name__}.")
  tensors = load_file(os.path.join(directory, "drafter.safetensors"))
  parts = {}
  for part in ("trainable", "shared"):
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template.weights[part])
    names = [f"{part}/{path_string(path)}" for path, _ in leaves_with_path]
    missing = [n for n in names if n not in tensors]
    if missing:
      raise ConfigError(f"{directory} lacks drafter weights {missing}.")
    parts[part] = jax.tree.unflatten(treedef, [jnp.asarray(tensors[n]) for n in names])
  check_weights(type(template).__name__, template.weights, parts)
  drafter = template.with_weights(parts)
  if _TABLE_KEY in tensors:
    size = None if template.draft_to_target is None else np.size(template.draft_to_target)
    if size != tensors[_TABLE_KEY].size:
      raise ConfigError(f"{directory} holds a draft vocabulary of {tensors[_TABLE_KEY].size} "
                        f"ids; the template's has {size or 'none (the full vocabulary)'}.")
    drafter.draft_to_target = check_draft_to_target(tensors[_TABLE_KEY], template.vocab_size,
                                                    size)
  return drafter
