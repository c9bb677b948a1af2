"""Tiny random models whose next-token distributions are worth testing samplers on.

A freshly initialised transformer predicts an almost uniform distribution that barely
depends on the context, so a sampler that mixes up positions or sequences would still
pass. Scaling every weight matrix up makes the distributions peaked and strongly
dependent on the earlier tokens (not only the last one).
"""

from __future__ import annotations

import jax
from flax import nnx

from specrl_jax.config import ModelConfig
from specrl_jax.models.transformer import Transformer


def peaked_random_model(config: ModelConfig, *, seed: int = 0,
                        weight_scale: float = 10.0) -> Transformer:
  """A Transformer with random weights whose matrices are ``weight_scale`` times the
  default initialisation (norm scales untouched)."""
  graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(seed)))
  state = jax.tree.map(lambda w: w * weight_scale if w.ndim >= 2 else w, state)
  return nnx.merge(graphdef, state)


def perturbed_model(model: Transformer, *, seed: int, noise: float = 0.3) -> Transformer:
  """A different model of the same architecture: each weight matrix W becomes
  W + noise * std(W) * N(0, 1). Useful as a draft model that agrees with the target
  often but not always."""
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [w + noise * w.std() * jax.random.normal(key, w.shape, w.dtype) if w.ndim >= 2 else w
           for w, key in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))
