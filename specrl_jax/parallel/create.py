"""Random-weight models created where they will live: in their param dtype, sharded.

A model of a real preset does not fit one device in float32 (8B parameters are 32 GB),
and materialising it whole before sharding would need that device anyway. Here the
structure is traced abstractly (``nnx.eval_shape``) to learn every parameter's shape and
path, the partition rules give each its sharding, and one jitted program with those
``out_shardings`` draws the weights: with JAX's partitionable threefry (the default)
each device computes only its own shard of every random draw.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from specrl_jax.config import ModelConfig
from specrl_jax.models.transformer import Transformer
from specrl_jax.parallel.rules import PartitionRules, named_shardings, rollout_rules


def create_model(config: ModelConfig, *, rng: int | jax.Array, mesh: Mesh | None = None,
                 rules: PartitionRules = rollout_rules()) -> Transformer:
  """A random-weight ``Transformer`` whose parameters are created in
  ``config.param_dtype``, laid out on ``mesh`` by ``rules`` (default: the rollout's
  tensor-parallel layout); on the default device when ``mesh`` is None.

  rng: a seed or key, as ``nnx.Rngs`` takes it. The weights equal those of
    ``Transformer(config, rngs=nnx.Rngs(rng))`` whatever the mesh.
  """
  key = jax.random.key(rng) if isinstance(rng, int) else rng
  if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(key)))
  graphdef, abstract_state = nnx.split(abstract)
  shardings = None if mesh is None else named_shardings(abstract_state, mesh, rules)

  def build(key):
    return nnx.split(Transformer(config, rngs=nnx.Rngs(key)))[1]

  state = jax.jit(build, out_shardings=shardings)(key)
  return nnx.merge(graphdef, state)


def bytes_per_device(model: nnx.Module) -> dict[jax.Device, int]:
  """Bytes of ``model``'s parameters resident on each device (its addressable shards)."""
  held: dict[jax.Device, int] = {}
  for leaf in jax.tree.leaves(nnx.state(model)):
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return held
