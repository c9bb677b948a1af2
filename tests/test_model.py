"""The decoder: config validation, shapes, layer taps, dtypes, causality, padding."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specrl_jax.config import ConfigError, ModelConfig
from specrl_jax.models.attention import CausalNoCache
from specrl_jax.models.transformer import Transformer, rope_tables

VOCAB = 97


def tiny_config(**changes) -> ModelConfig:
  fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16)
  return ModelConfig(**{**fields, **changes})


def random_tokens(seed: int, batch: int, length: int) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, VOCAB, jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "hidden_layers"))
def _jitted_forward(graphdef, state, tokens_BxT, positions_BxT, valid_BxT, hidden_layers):
  out = nnx.merge(graphdef, state).forward(
      tokens_BxT, positions_BxT=positions_BxT, kv=CausalNoCache(valid_BxT),
      hidden_layers=hidden_layers)
  return out.logits, out.hidden, out.layer_hidden


def forward(model, tokens_BxT, *, positions_BxT=None, valid_BxT=None, hidden_layers=()):
  """model.forward compiled once per shape (eager op-by-op dispatch is slow on CPU);
  returns (logits, hidden, layer_hidden)."""
  graphdef, state = nnx.split(model)
  return _jitted_forward(graphdef, state, tokens_BxT, positions_BxT, valid_BxT,
                         tuple(hidden_layers))


@pytest.fixture(scope="module")
def model() -> Transformer:
  return Transformer(tiny_config(attention_bias=True), rngs=nnx.Rngs(0))


# --- Configuration --------------------------------------------------------------

@pytest.mark.parametrize("changes,fragments", [
    (dict(vocab_size=0), ["vocab_size=0", "positive integer"]),
    (dict(num_layers=2.0), ["num_layers=2.0", "positive integer"]),
    (dict(num_kv_heads=3), ["num_kv_heads=3", "divisor of num_heads=4"]),
    (dict(head_dim=15), ["head_dim=15", "even"]),
    (dict(rope_theta=0.0), ["rope_theta=0.0", "> 0"]),
    (dict(rms_norm_eps=1.5), ["rms_norm_eps=1.5", "(0, 1)"]),
    (dict(param_dtype="float16"), ["param_dtype='float16'", "'float32', 'bfloat16'"]),
    (dict(dtype="int8"), ["dtype='int8'", "'float32', 'bfloat16'"]),
    (dict(max_position_embeddings=-1), ["max_position_embeddings=-1", "positive integer"]),
    (dict(rope_llama3_scaling=(0.5, 1.0, 4.0, 8192)), ["rope_llama3_scaling", "factor>=1"]),
])
def test_config_errors_name_the_field_the_value_and_the_allowed_range(changes, fragments):
  with pytest.raises(ConfigError) as error:
    tiny_config(**changes)
  for fragment in fragments:
    assert fragment in str(error.value)


@pytest.mark.parametrize("changes", [
    dict(), dict(tie_embeddings=True), dict(attention_bias=True, qk_norm=False),
    dict(qk_norm=False, num_kv_heads=4),
])
def test_num_params_counts_every_parameter_once(changes):
  config = tiny_config(**changes)
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert sum(leaf.size for leaf in leaves) == config.num_params()


# --- Forward --------------------------------------------------------------------

def test_forward_shapes_and_dtypes(model):
  out = model.forward(random_tokens(0, 3, 5), hidden_layers=(1, 0))
  chex.assert_shape(out.logits, (3, 5, VOCAB))
  chex.assert_type(out.logits, jnp.float32)
  chex.assert_shape(out.hidden, (3, 5, 32))
  chex.assert_shape(out.layer_hidden, [(3, 5, 32), (3, 5, 32)])
  chex.assert_trees_all_equal(model(random_tokens(0, 3, 5)), out.logits)
  assert model.forward(random_tokens(0, 3, 5), compute_logits=False).logits is None


def test_hidden_layers_are_the_requested_layer_outputs_in_request_order(model):
  tokens = random_tokens(1, 2, 6)
  logits, hidden, layer_hidden = forward(model, tokens, hidden_layers=(1, 0))
  # The same computation spelled out block by block.
  positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
  cos, sin = rope_tables(model.config, positions)
  x = model.embed_tokens(tokens)
  per_layer = []
  for layer, block in enumerate(model.layers):
    x, _ = block(x, cos, sin, layer, CausalNoCache())
    per_layer.append(x)
  chex.assert_trees_all_close(layer_hidden, (per_layer[1], per_layer[0]), atol=1e-6)
  chex.assert_trees_all_close(hidden, per_layer[-1], atol=1e-6)
  chex.assert_trees_all_close(logits, model.unembed(per_layer[-1]), atol=1e-6)
  assert not np.allclose(per_layer[0], per_layer[1])


@pytest.mark.parametrize("bad", [2, -1])
def test_hidden_layers_out_of_range_is_an_error_naming_the_index_and_range(model, bad):
  with pytest.raises(ConfigError, match=rf"hidden_layers contains {bad}.*\[0, 1\]"):
    model.forward(random_tokens(0, 1, 3), hidden_layers=(0, bad))


def test_tied_embeddings_reuse_the_embedding_as_lm_head():
  model = Transformer(tiny_config(tie_embeddings=True), rngs=nnx.Rngs(0))
  assert not hasattr(model, "lm_head")
  logits, hidden, _ = forward(model, random_tokens(2, 1, 4))
  expected = model.final_norm(hidden) @ model.embed[...].T
  chex.assert_trees_all_close(logits, expected, atol=1e-6)


def test_bfloat16_params_and_compute_run_close_to_float32():
  tokens = random_tokens(3, 2, 12)
  f32 = Transformer(tiny_config(), rngs=nnx.Rngs(0))
  bf16 = Transformer(tiny_config(param_dtype="bfloat16", dtype="bfloat16"), rngs=nnx.Rngs(0))
  assert bf16.embed[...].dtype == jnp.bfloat16
  # bf16 weights are drawn in bf16 (not rounded from the float32 draw): compare the same
  # weights, rounded, to isolate the compute.
  nnx.update(bf16, jax.tree.map(lambda w: w.astype(jnp.bfloat16), nnx.state(f32)))
  logits, hidden, _ = forward(bf16, tokens)
  assert hidden.dtype == jnp.bfloat16
  assert logits.dtype == jnp.float32
  reference, _, _ = forward(f32, tokens)
  # bf16 keeps ~3 significant digits (measured: ~1% of the logit scale here).
  scale = float(jnp.abs(reference).max())
  assert float(jnp.abs(logits - reference).max()) < 0.03 * scale
  assert not np.array_equal(logits, reference)  # it really computed in bf16


def test_float32_params_with_bfloat16_compute():
  tokens = random_tokens(3, 2, 12)
  f32 = Transformer(tiny_config(), rngs=nnx.Rngs(0))
  mixed = Transformer(tiny_config(dtype="bfloat16"), rngs=nnx.Rngs(0))
  assert mixed.embed[...].dtype == jnp.float32
  logits, hidden, _ = forward(mixed, tokens)
  assert hidden.dtype == jnp.bfloat16
  reference, _, _ = forward(f32, tokens)
  scale = float(jnp.abs(reference).max())
  assert float(jnp.abs(logits - reference).max()) < 0.03 * scale
  assert not np.array_equal(logits, reference)


# --- Masking --------------------------------------------------------------------

def test_changing_a_later_token_leaves_earlier_logits_unchanged(model):
  tokens = random_tokens(4, 2, 9)
  changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % VOCAB)
  (before, _, _), (after, _, _) = forward(model, tokens), forward(model, changed)
  chex.assert_trees_all_close(before[:, :5], after[:, :5], atol=1e-6)
  assert np.abs(before[:, 5:] - after[:, 5:]).min(axis=-1).max() > 0


def test_padding_mask_hides_left_padding_and_right_padding_changes_nothing(model):
  prompt = random_tokens(5, 1, 5)
  alone, _, _ = forward(model, prompt)
  # Right padding: causality alone keeps real positions exact.
  right = jnp.concatenate([prompt, jnp.zeros((1, 3), jnp.int32)], axis=1)
  right_logits, _, _ = forward(model, right, valid_BxT=jnp.arange(8)[None] < 5)
  chex.assert_trees_all_close(right_logits[:, :5], alone, atol=1e-5)
  # Left padding: the mask must hide pads from every real query; positions restart.
  positions = jnp.maximum(jnp.arange(8) - 3, 0)[None]
  for pad_token in (0, 7):
    left = jnp.concatenate([jnp.full((1, 3), pad_token, jnp.int32), prompt], axis=1)
    left_logits, _, _ = forward(model, left, positions_BxT=positions,
                                valid_BxT=jnp.arange(8)[None] >= 3)
    chex.assert_trees_all_close(left_logits[:, 3:], alone, atol=1e-5)
    assert np.all(np.isfinite(left_logits))  # fully masked pad queries stay finite


def test_without_the_padding_mask_left_pads_leak_into_real_positions(model):
  prompt = random_tokens(5, 1, 5)
  left = jnp.concatenate([jnp.full((1, 3), 7, jnp.int32), prompt], axis=1)
  positions = jnp.maximum(jnp.arange(8) - 3, 0)[None]
  unmasked, _, _ = forward(model, left, positions_BxT=positions)
  alone, _, _ = forward(model, prompt)
  assert not np.allclose(unmasked[:, 3:], alone, atol=1e-5)
