"""Random-weight models created in their param dtype and sharded at creation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax.parallel.create import bytes_per_device, create_model
from specrl_jax.parallel.mesh import make_mesh
from specrl_jax.parallel.rules import named_shardings, rollout_rules


CONFIG = sj.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=8, num_kv_heads=4, head_dim=16, attention_bias=True,
                        param_dtype="bfloat16", dtype="bfloat16")


@pytest.fixture(scope="module")
def tensor_mesh():
  return make_mesh((1, 1, 4), devices=jax.devices()[:4])


@pytest.fixture(scope="module")
def sharded(tensor_mesh):
  return create_model(CONFIG, rng=7, mesh=tensor_mesh)


@pytest.fixture(scope="module")
def eager():
  return sj.Transformer(CONFIG, rngs=nnx.Rngs(7))


def test_each_device_of_a_four_way_tensor_mesh_holds_a_quarter_of_the_weights(
    tensor_mesh, sharded):
  held = bytes_per_device(sharded)
  assert set(held) == set(tensor_mesh.devices.reshape(-1).tolist())
  total = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(sharded)))
  for device_bytes in held.values():
    # Only the norm scales (a few hundred bytes here) are replicated.
    assert device_bytes == pytest.approx(total / 4, rel=0.02)


def test_parameters_are_created_in_the_configured_dtype(sharded):
  assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(sharded))} == {jnp.dtype("bfloat16")}


def test_the_same_rng_gives_the_weights_of_unsharded_creation(sharded, eager):
  for a, b in zip(jax.tree.leaves(nnx.state(sharded)), jax.tree.leaves(nnx.state(eager)),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_sharded_model_computes_what_the_unsharded_one_does(sharded, eager):
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  forward = jax.jit(lambda model, tokens: model(tokens))
  logits = np.asarray(forward(eager, tokens))
  # bfloat16 sums split over four devices round differently; logits here span ~0.6.
  np.testing.assert_allclose(forward(sharded, tokens), logits,
                             atol=0.02 * np.abs(logits).max())


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
                                  "llama-3.2-1b", "llama-3.1-8b"])
def test_every_preset_splits_its_weights_four_ways_under_the_rollout_rules(tensor_mesh, name):
  """Checked on the abstract model (nothing allocated): the rules shard every large
  parameter of the real architectures, embeddings included."""
  config = sj.PRESETS[name]
  abstract = nnx.eval_shape(lambda: sj.Transformer(config, rngs=nnx.Rngs(0)))
  state = nnx.state(abstract)
  shardings = named_shardings(state, tensor_mesh, rollout_rules())
  leaves = jax.tree.leaves(state)
  whole = sum(math.prod(leaf.shape) for leaf in leaves)
  per_device = sum(math.prod(sharding.shard_shape(leaf.shape)) for leaf, sharding
                   in zip(leaves, jax.tree.leaves(shardings), strict=True))
  assert whole == config.num_params()
  assert per_device == pytest.approx(whole / 4, rel=0.01)
