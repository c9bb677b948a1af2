"""EAGLE-3 as a drafter.

The target's hidden states from a low, a middle and a high layer are concatenated and
projected 3H -> H (no bias). One decoder layer then attends over its own KV with the
2H-wide input concat(norm(embed(x_j)), norm(feature_{j-1})), keeps the feature as its
residual stream, and a final norm and an LM head over a reduced draft vocabulary predict
x_{j+1}. ``draft_to_target[i]`` is the target id of draft token i; target tokens outside
the table are never proposed (verification stays exact: q is simply 0 there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specrl_jax.config import ConfigError, ModelConfig, check
from specrl_jax.models.attention import KVBackend
from specrl_jax.models.transformer import MLP, Attention, RMSNorm, Transformer, rope_tables
from specrl_jax.speculative.drafters.hidden_state import (
    ATTENTION_LAYER, HiddenStateDrafter, SharedTable, TargetTables, check_weights,
    normal_param, split_weights)

Array = jax.Array


def default_target_layers(num_layers: int) -> tuple[int, int, int]:
  """EAGLE-3's low / middle / high layers as serving engines pick them: the inputs of
  layers 2, L // 2 and L - 3, i.e. the outputs of layers 1, L // 2 - 1 and L - 4.
  Targets too shallow for three distinct such layers (under 7) use the first, middle
  and last layer."""
  family = (1, num_layers // 2 - 1, num_layers - 4)
  if family[0] < family[1] < family[2]:
    return family
  return (0, num_layers // 2 if num_layers > 2 else num_layers - 1, num_layers - 1)


def check_draft_to_target(table, vocab_size: int, draft_vocab_size: int | None = None
                          ) -> np.ndarray:
  """The draft-to-target id table as int32, or ConfigError saying what is wrong."""
  array = np.asarray(table)
  check(array.ndim == 1 and array.size > 0 and np.issubdtype(array.dtype, np.integer),
        "Eagle3", "draft_to_target", f"array of shape {array.shape} dtype {array.dtype}",
        "a non-empty 1-D integer array of target token ids")
  if draft_vocab_size is not None:
    check(array.size == draft_vocab_size, "Eagle3", "draft_to_target",
          f"a table of {array.size} ids", f"{draft_vocab_size} ids (draft_vocab_size)")
  bad = array[(array < 0) | (array >= vocab_size)]
  check(bad.size == 0, "Eagle3", "draft_to_target",
        f"a table holding id {bad[0] if bad.size else None}",
        f"target ids in [0, {vocab_size}) (the target's vocabulary)")
  values, counts = np.unique(array, return_counts=True)
  check(bool(np.all(counts == 1)), "Eagle3", "draft_to_target",
        f"a table repeating id {values[counts > 1][0] if np.any(counts > 1) else None}",
        "distinct target ids (each draft token stands for one target token)")
  return array.astype(np.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config:
  """Shape of an EAGLE-3 head. hidden_size and vocab_size are the target's."""

  hidden_size: int
  intermediate_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  draft_vocab_size: int
  target_layers: tuple[int, int, int]
  rope_theta: float = 1e6
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 32768
  param_dtype: str = "float32"
  dtype: str = "float32"

  def __post_init__(self):
    owner = "Eagle3Config"
    check(isinstance(self.target_layers, tuple) and len(self.target_layers) == 3
          and all(isinstance(i, int) and i >= 0 for i in self.target_layers),
          owner, "target_layers", self.target_layers,
          "three target layer indices >= 0 (low, middle, high)")
    check(isinstance(self.draft_vocab_size, int) and 0 < self.draft_vocab_size
          <= self.vocab_size, owner, "draft_vocab_size", self.draft_vocab_size,
          f"an integer in [1, vocab_size={self.vocab_size}]")
    self.layer_config  # validates the remaining fields, naming them

  @property
  def layer_config(self) -> ModelConfig:
    """The one decoder layer (Llama-style: no qk-norm, no biases)."""
    return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                       intermediate_size=self.intermediate_size, num_layers=1,
                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       head_dim=self.head_dim, rope_theta=self.rope_theta,
                       rms_norm_eps=self.rms_norm_eps, qk_norm=False,
                       max_position_embeddings=self.max_position_embeddings,
                       param_dtype=self.param_dtype, dtype=self.dtype)

  @property
  def hidden_layers(self) -> tuple[int, ...]:
    """The distinct target layers to read, in the order the target returns them."""
    return tuple(sorted(set(self.target_layers)))


class Eagle3Layer(nnx.Module):
  """EAGLE-3's decoder layer: attention over concat(norm(embedding), norm(feature)),
  the feature as residual, then a SwiGLU MLP. Attention math is the target's."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, pd = config, jnp.dtype(config.param_dtype)
    self.embed_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pd)
    self.hidden_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pd)
    # q/k/v read the 2H-wide input; the output projection returns to width H.
    self.attn = Attention(c.replace(hidden_size=2 * c.hidden_size), rngs=rngs)
    self.attn.o_proj = normal_param(rngs, (c.num_heads, c.head_dim, c.hidden_size), pd)
    self.post_attention_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pd)
    self.mlp = MLP(c, rngs=rngs)

  def __call__(self, embeds_BxTxD: Array, features_BxTxD: Array, cos_BxTxF: Array,
               sin_BxTxF: Array, layer: int, kv: KVBackend) -> tuple[Array, KVBackend]:
    x_BxTx2D = jnp.concatenate([self.embed_norm(embeds_BxTxD),
                                self.hidden_norm(features_BxTxD)], axis=-1)
    attn_out, kv = self.attn(x_BxTx2D, cos_BxTxF, sin_BxTxF, layer, kv)
    h_BxTxD = features_BxTxD + attn_out
    return h_BxTxD + self.mlp(self.post_attention_norm(h_BxTxD)), kv


class Eagle3Head(nnx.Module):
  """Fusion projection, the decoder layer, final norm and the draft-vocabulary head."""

  def __init__(self, config: Eagle3Config, *, rngs: nnx.Rngs):
    c, pd = config, jnp.dtype(config.param_dtype)
    self.config = config
    self.embed = SharedTable(jnp.zeros((c.vocab_size, c.hidden_size), pd))
    self.fc = normal_param(rngs, (3 * c.hidden_size, c.hidden_size), pd)
    self.layer = Eagle3Layer(c.layer_config, rngs=rngs)
    self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pd)
    self.lm_head = normal_param(rngs, (c.hidden_size, c.draft_vocab_size), pd)

  def fusion_inputs(self, hidden_BxTxD: Array, layer_hidden: tuple[Array, ...]) -> Array:
    """The low, middle and high layers' hidden states side by side [B, T, 3D]."""
    del hidden_BxTxD
    order = self.config.hidden_layers
    return jnp.concatenate([layer_hidden[order.index(i)] for i in self.config.target_layers],
                           axis=-1)

  def fuse(self, inputs_BxTx3D: Array) -> Array:
    dt = jnp.dtype(self.config.dtype)
    return inputs_BxTx3D.astype(dt) @ self.fc[...].astype(dt)

  def features(self, hidden_BxTxD: Array, layer_hidden: tuple[Array, ...]) -> Array:
    return self.fuse(self.fusion_inputs(hidden_BxTxD, layer_hidden))

  def decode(self, tokens_BxT: Array, features_BxTxD: Array, positions_BxT: Array, kv):
    dt = jnp.dtype(self.config.dtype)
    embeds_BxTxD = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(dt)
    cos_BxTxF, sin_BxTxF = rope_tables(self.config.layer_config, positions_BxT)
    return self.layer(embeds_BxTxD, features_BxTxD.astype(dt), cos_BxTxF, sin_BxTxF,
                      ATTENTION_LAYER, kv)

  def logits(self, outputs_BxTxD: Array) -> Array:
    h = self.final_norm(outputs_BxTxD)
    return jnp.einsum("btd,dv->btv", h, self.lm_head[...].astype(h.dtype),
                      preferred_element_type=jnp.float32)


class Eagle3(HiddenStateDrafter):
  """``sj.drafters.Eagle3(target, ...)``: an EAGLE-3 head for ``target``.

  draft_to_target: target ids of the draft vocabulary (``training.build_draft_vocab``
    makes one from token frequencies); default: the whole target vocabulary.
  target_layers: (low, middle, high) target layers to fuse; default
    ``default_target_layers(target.config.num_layers)``.
  intermediate_size, num_heads, num_kv_heads, head_dim: the decoder layer's shape
    (default: the target's).
  seed: initialisation of the trainable weights; weights: trained weights to use
    instead ({"trainable", "shared"}, shape-checked).
  """

  def __init__(self, target: Transformer, *, draft_to_target=None,
               target_layers: tuple[int, int, int] | None = None,
               intermediate_size: int | None = None, num_heads: int | None = None,
               num_kv_heads: int | None = None, head_dim: int | None = None,
               seed: int = 0, weights=None):
    if not isinstance(target, Transformer):
      raise TypeError(f"Eagle3 needs the target sj.Transformer, got {type(target).__name__}.")
    t = target.config
    if draft_to_target is None:
      draft_to_target = np.arange(t.vocab_size)
    table = check_draft_to_target(draft_to_target, t.vocab_size)
    layers = default_target_layers(t.num_layers) if target_layers is None else tuple(target_layers)
    config = Eagle3Config(
        hidden_size=t.hidden_size, intermediate_size=intermediate_size or t.intermediate_size,
        num_heads=num_heads or t.num_heads, num_kv_heads=num_kv_heads or t.num_kv_heads,
        head_dim=head_dim or t.head_dim, vocab_size=t.vocab_size,
        draft_vocab_size=int(table.size), target_layers=layers, rope_theta=t.rope_theta,
        rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
        param_dtype=t.param_dtype, dtype=t.dtype)
    self._setup(config, target, table, seed, weights)
    self.check_target(t)

  @classmethod
  def from_config(cls, config: Eagle3Config, target: Transformer, draft_to_target,
                  weights=None) -> "Eagle3":
    """An Eagle3 of a given shape (e.g. read from a checkpoint) for ``target``."""
    if config.hidden_size != target.config.hidden_size:
      raise ConfigError(
          f"the EAGLE-3 head has hidden_size={config.hidden_size} but the target has "
          f"hidden_size={target.config.hidden_size}: a head trained for another target "
          "cannot read this one's hidden states.")
    if config.vocab_size != target.config.vocab_size:
      raise ConfigError(
          f"the EAGLE-3 head has vocab_size={config.vocab_size} but the target has "
          f"vocab_size={target.config.vocab_size}: the draft vocabulary must map into the "
          "target's.")
    table = check_draft_to_target(draft_to_target, config.vocab_size, config.draft_vocab_size)
    drafter = object.__new__(cls)
    drafter._setup(config, target, table, 0, weights)
    drafter.check_target(target.config)
    return drafter

  def _setup(self, config: Eagle3Config, target: Transformer, table: np.ndarray, seed: int,
             weights) -> None:
    self.config = config
    self.layer_config = config.layer_config
    self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
    self.fusion_input_size = 3 * config.hidden_size
    self.hidden_layers = config.hidden_layers
    head = Eagle3Head(config, rngs=nnx.Rngs(seed))
    tables = TargetTables.of(target)
    head.embed[...] = tables.embed_VxD
    # Warm start: the target's own output head (restricted to the draft vocabulary)
    # after its final norm already maps hidden states to next-token logits.
    head.lm_head[...] = tables.lm_head_DxV[:, table].astype(head.lm_head[...].dtype)
    head.final_norm.scale[...] = tables.final_norm_D
    graphdef, fresh = split_weights(head)
    if weights is not None:
      check_weights("Eagle3", fresh, weights)
    HiddenStateDrafter.__init__(self, graphdef, fresh if weights is None else weights,
                                draft_to_target=table)
