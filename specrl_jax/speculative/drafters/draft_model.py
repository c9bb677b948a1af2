"""A small external draft model with its own KV in the shared page pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specrl_jax.config import ConfigError, ModelConfig
from specrl_jax.kv.paged import LayerOffset
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.warp import proposal_log_probs
from specrl_jax.speculative.drafters.cached import CachedDrafter

Array = jax.Array


class DraftModel(CachedDrafter):
  """Drafts with any ``sj.Transformer`` sharing the target's vocabulary.

  Its KV is kept in step with the target by ``CachedDrafter``: each round first feeds
  the tokens emitted since its cache was last written (the accepted drafts and the bonus
  token), then drafts the tree level by level with uncommitted (scratch) KV for deeper
  levels.
  """

  def __init__(self, model: Transformer):
    if not isinstance(model, Transformer):
      raise TypeError(f"DraftModel needs an sj.Transformer, got {type(model).__name__}.")
    self.config: ModelConfig = model.config
    self.graphdef, self._params = nnx.split(model)

  def __hash__(self):
    return hash((DraftModel, self.graphdef, self.config))

  def __eq__(self, other):
    return (isinstance(other, DraftModel) and other.graphdef == self.graphdef
            and other.config == self.config)

  def check_target(self, target_config: ModelConfig) -> None:
    if target_config.vocab_size != self.config.vocab_size:
      raise ConfigError(
          f"DraftModel vocab_size={self.config.vocab_size} does not match the target's "
          f"vocab_size={target_config.vocab_size}: a draft model must share the target's "
          "vocabulary.")

  def kv_layers(self):
    return ((self.config.num_kv_heads, self.config.head_dim),) * self.config.num_layers

  def params(self):
    return self._params

  def _model(self, params) -> Transformer:
    return nnx.merge(self.graphdef, params)

  def prefill(self, params, state, kv, tokens_UxT, lengths_U, target_output):
    positions_UxT = jnp.broadcast_to(jnp.arange(tokens_UxT.shape[1], dtype=jnp.int32),
                                     tokens_UxT.shape)
    out = self._model(params).forward(tokens_UxT, positions_BxT=positions_UxT, kv=kv,
                                      compute_logits=False)
    return state, out.kv

  def decode_fed(self, params, tokens_NxT, positions_NxT, valid_NxT, kv: LayerOffset):
    out = self._model(params).forward(tokens_NxT, positions_BxT=positions_NxT, kv=kv,
                                      compute_logits=False)
    return out.hidden, out.kv

  def root_log_q(self, params, root_Nx1xD, sampling):
    return proposal_log_probs(self._model(params).unembed(root_Nx1xD)[:, 0], sampling)

  def decode_level(self, params, tokens_NxW, positions_NxW, parents_NxIxD, kv: LayerOffset,
                   sampling):
    out = self._model(params).forward(tokens_NxW, positions_BxT=positions_NxW, kv=kv)
    return proposal_log_probs(out.logits, sampling), out.hidden, out.kv
