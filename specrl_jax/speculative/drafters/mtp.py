"""Multi-token prediction (DeepSeek-V3 style) as a drafter.

One MTP module: h' = Block(W [RMSNorm(embed(x_j)); RMSNorm(h_{j-1})]), then a final norm
and the target's output head predict x_{j+1}. The embedding and the output head are the
target's (copied, never trained). A chain drafts by applying the module recurrently on
its own output h'; training-time test (``training.unrolled_loss``) trains exactly that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specrl_jax.config import ModelConfig
from specrl_jax.models.transformer import Block, RMSNorm, Transformer, rope_tables
from specrl_jax.speculative.drafters.hidden_state import (
    ATTENTION_LAYER, HiddenStateDrafter, SharedTable, TargetTables, check_weights,
    normal_param, split_weights)

Array = jax.Array


class MTPHead(nnx.Module):
  """The MTP module's weights and math; ``config`` is the target's (the block mirrors
  one target layer)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, pd = config, jnp.dtype(config.param_dtype)
    self.config = config
    self.embed = SharedTable(jnp.zeros((c.vocab_size, c.hidden_size), pd))
    self.lm_head = SharedTable(jnp.zeros((c.hidden_size, c.vocab_size), pd))
    self.embed_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pd)
    self.hidden_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pd)
    # DeepSeek-V3's eh_proj: [embedding; hidden] (2H) -> H.
    self.input_proj = normal_param(rngs, (2 * c.hidden_size, c.hidden_size), pd)
    self.block = Block(c, rngs=rngs)
    self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pd)

  def fusion_inputs(self, hidden_BxTxD: Array, layer_hidden: tuple[Array, ...]) -> Array:
    del layer_hidden
    return hidden_BxTxD

  def fuse(self, inputs_BxTxD: Array) -> Array:
    return inputs_BxTxD

  def features(self, hidden_BxTxD: Array, layer_hidden: tuple[Array, ...]) -> Array:
    return hidden_BxTxD

  def decode(self, tokens_BxT: Array, features_BxTxD: Array, positions_BxT: Array, kv):
    dt = jnp.dtype(self.config.dtype)
    embeds_BxTxD = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(dt)
    x_BxTx2D = jnp.concatenate([self.embed_norm(embeds_BxTxD),
                                self.hidden_norm(features_BxTxD.astype(dt))], axis=-1)
    x_BxTxD = x_BxTx2D @ self.input_proj[...].astype(dt)
    cos_BxTxF, sin_BxTxF = rope_tables(self.config, positions_BxT)
    return self.block(x_BxTxD, cos_BxTxF, sin_BxTxF, ATTENTION_LAYER, kv)

  def logits(self, outputs_BxTxD: Array) -> Array:
    h = self.final_norm(outputs_BxTxD)
    return jnp.einsum("btd,dv->btv", h, self.lm_head[...].astype(h.dtype),
                      preferred_element_type=jnp.float32)


class MTP(HiddenStateDrafter):
  """``sj.drafters.MTP(target)``: an MTP head on ``target``'s last hidden state.

  seed: initialisation of the trainable weights (the tables are the target's).
  weights: {"trainable", "shared"} states to use instead (e.g. after training); they
    must fit the target's shapes.
  """

  def __init__(self, target: Transformer, *, seed: int = 0, weights=None):
    if not isinstance(target, Transformer):
      raise TypeError(f"MTP needs the target sj.Transformer, got {type(target).__name__}.")
    config = target.config
    self.config = config
    self.layer_config = config
    self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
    self.fusion_input_size = config.hidden_size
    self.hidden_layers = ()
    head = MTPHead(config, rngs=nnx.Rngs(seed))
    tables = TargetTables.of(target)
    head.embed[...] = tables.embed_VxD
    head.lm_head[...] = tables.lm_head_DxV
    # The shared head was trained after the target's final norm: start from its scale.
    head.final_norm.scale[...] = tables.final_norm_D
    graphdef, fresh = split_weights(head)
    if weights is not None:
      check_weights("MTP", fresh, weights)
    super().__init__(graphdef, fresh if weights is None else weights, draft_to_target=None)
