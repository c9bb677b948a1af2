"""LoRA: train low-rank adapters on the policy's projection matrices, the base frozen.

Each targeted weight W (a decoder projection, viewed as a matrix [inputs, outputs]:
``o_proj [H, Dh, D]`` has two input axes, the others one) gets ``A [inputs, r]`` and
``B [r, outputs]``; the model computes with ``W + (alpha / r) A B``. B starts at zero,
so training starts from the base policy exactly. The train state then holds the
adapters as its ``params`` (with their float32 master copies and Adam moments: a few
MB) and the base weights frozen in ``frozen_params``; the loss, the log-prob pass and
the rollout all read the merged weights (``TrainState.compute_params``), merged once
per step, so sampling and learning see the same policy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from specrl_jax.config import check, check_positive_int, is_finite_number

Array = jax.Array

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
  """rank: r of every adapter; alpha: the update is scaled by alpha / r; targets: the
  projection names that get adapters (``PROJECTIONS``)."""
  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = PROJECTIONS

  def __post_init__(self):
    owner = "LoRAConfig"
    check_positive_int(owner, "rank", self.rank)
    check(is_finite_number(self.alpha) and self.alpha > 0, owner, "alpha", self.alpha,
          "a finite number > 0")
    check(isinstance(self.targets, tuple) and self.targets
          and all(t in PROJECTIONS for t in self.targets), owner, "targets", self.targets,
          f"a non-empty tuple of names from {PROJECTIONS}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def _name(path) -> str:
  """'layers.0.attn.q_proj' for the key path of a weight (nnx's trailing 'value' off)."""
  parts = []
  for key in path:
    part = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
    parts.append(str(part))
  if parts and parts[-1] == "value":
    parts = parts[:-1]
  return ".".join(parts)


def _matrix_shape(name: str, shape) -> tuple[int, int]:
  inputs = 2 if name.endswith("o_proj") else 1
  return math.prod(shape[:inputs]), math.prod(shape[inputs:])


def targeted(params, config: LoRAConfig) -> dict[str, Any]:
  """{name: weight} of the weights of ``params`` that get adapters."""
  found = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = _name(path)
    if name.split(".")[-1] in config.targets and leaf.ndim >= 2:
      found[name] = leaf
  check(bool(found), "LoRAConfig", "targets", config.targets,
        "names of projection weights the model has")
  return found


def init_adapters(params, config: LoRAConfig, rng: Array, dtype=jnp.float32
                  ) -> dict[str, dict[str, Array]]:
  """{name: {"a": [inputs, r], "b": [r, outputs]}}: A drawn with std 1/sqrt(inputs), B
  zero, so the merged model starts as the base one."""
  adapters = {}
  for index, (name, weight) in enumerate(sorted(targeted(params, config).items())):
    inputs, outputs = _matrix_shape(name, weight.shape)
    key = jax.random.fold_in(rng, index)
    adapters[name] = {
        "a": jax.random.normal(key, (inputs, config.rank), dtype) / math.sqrt(inputs),
        "b": jnp.zeros((config.rank, outputs), dtype)}
  return adapters


def merge(base, adapters: dict[str, dict[str, Array]], config: LoRAConfig):
  """``base`` with W + scale * A B in each adapted weight, in the base weight's dtype
  (the sum taken in float32)."""
  def merged(path, weight):
    name = _name(path)
    if name not in adapters:
      return weight
    delta = adapters[name]["a"].astype(jnp.float32) @ adapters[name]["b"].astype(jnp.float32)
    total = weight.astype(jnp.float32) + config.scale * delta.reshape(weight.shape)
    return total.astype(weight.dtype)

  return jax.tree_util.tree_map_with_path(merged, base)
