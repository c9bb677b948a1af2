"""A small external draft model with its own KV in the shared page pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specrl_jax.config import ConfigError, ModelConfig
from specrl_jax.kv.paged import LayerOffset
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.warp import proposal_log_probs
from specrl_jax.speculative.drafters.base import Drafter, tokens_to_feed, unseen_tokens

Array = jax.Array


class DraftModel(Drafter):
  """Drafts with any ``sj.Transformer`` sharing the target's vocabulary.

  Its KV is kept in step with the target lazily: each round first feeds the tokens
  emitted since its cache was last written (the accepted drafts and the bonus token),
  then drafts the tree level by level with uncommitted (scratch) KV for deeper levels.
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

  def init_state(self, num_slots: int):
    return {"cache_lengths_N": jnp.zeros((num_slots,), jnp.int32)}

  def _model(self, params) -> Transformer:
    return nnx.merge(self.graphdef, params)

  def prefill(self, params, state, kv, tokens_UxT, lengths_U, target_output):
    positions_UxT = jnp.broadcast_to(jnp.arange(tokens_UxT.shape[1], dtype=jnp.int32),
                                     tokens_UxT.shape)
    out = self._model(params).forward(tokens_UxT, positions_BxT=positions_UxT, kv=kv,
                                      compute_logits=False)
    return state, out.kv

  def on_admit(self, params, state, admit_N, prompt_lengths_N):
    lengths = jnp.where(admit_N, prompt_lengths_N, state["cache_lengths_N"])
    return {"cache_lengths_N": lengths}

  def _feed(self, params, kv: LayerOffset, inputs, cached_N, count_N, width: int):
    """Writes the KV of count_N[n] history tokens from position cached_N[n] on; returns
    the forward's output (hidden states, no logits)."""
    tokens_NxP, positions_NxP, valid_NxP = tokens_to_feed(inputs, cached_N, count_N, width)
    index_P = jnp.arange(width, dtype=jnp.int32)
    causal_PxP = index_P[:, None] >= index_P[None, :]
    step_kv = kv.replace(inner=kv.inner.replace(
        prefix_lengths_B=cached_N,
        new_mask_BxTxT=causal_PxP[None] & valid_NxP[:, None, :],
        write_positions_BxT=jnp.where(valid_NxP, positions_NxP, -1)))
    return self._model(params).forward(tokens_NxP, positions_BxT=positions_NxP, kv=step_kv,
                                       compute_logits=False)

  def start(self, params, state, kv: LayerOffset, inputs, sampling, max_pending):
    cached_N = state["cache_lengths_N"]
    pending_N = unseen_tokens(inputs, cached_N) + inputs.active_N  # and the last token
    out = self._feed(params, kv, inputs, cached_N, pending_N, max_pending)
    last_NxD = jnp.take_along_axis(out.hidden, jnp.maximum(pending_N - 1, 0)[:, None, None],
                                   axis=1)
    log_q_NxV = proposal_log_probs(self._model(params).unembed(last_NxD)[:, 0], sampling)
    state = {"cache_lengths_N": jnp.where(inputs.active_N, inputs.cache_lengths_N + 1, cached_N)}
    return log_q_NxV, state, out.kv, ()

  catches_up = True  # its cache is all it keeps, and history holds every token

  def unseen_tokens(self, state, inputs):
    return unseen_tokens(inputs, state["cache_lengths_N"])

  def catch_up(self, params, state, kv: LayerOffset, inputs, max_tokens):
    cached_N = state["cache_lengths_N"]
    count_N = jnp.minimum(unseen_tokens(inputs, cached_N), max_tokens)
    out = self._feed(params, kv, inputs, cached_N, count_N, max_tokens)
    return {"cache_lengths_N": cached_N + count_N}, out.kv

  def extend(self, params, state, kv: LayerOffset, scratch, inputs, sampling, depth,
             tokens_NxW, paths_NxWxD, mask_WxE):
    num_slots, width = tokens_NxW.shape
    positions_NxW = jnp.broadcast_to((inputs.cache_lengths_N + depth)[:, None],
                                     (num_slots, width))
    scratch_k, scratch_v = scratch if scratch else ((), ())
    level_kv = kv.replace(inner=kv.inner.replace(
        prefix_lengths_B=inputs.cache_lengths_N + 1,
        new_mask_BxTxT=jnp.broadcast_to(jnp.asarray(mask_WxE), (num_slots,) + mask_WxE.shape),
        write_positions_BxT=jnp.full((num_slots, width), -1, jnp.int32),
        stash=True, new_k=(), new_v=(), scratch_k=scratch_k, scratch_v=scratch_v))
    out = self._model(params).forward(tokens_NxW, positions_BxT=positions_NxW, kv=level_kv)
    new_k, new_v = out.kv.inner.new_k, out.kv.inner.new_v
    if scratch_k:
      new_k = tuple(jnp.concatenate([old, new], axis=1) for old, new in zip(scratch_k, new_k))
      new_v = tuple(jnp.concatenate([old, new], axis=1) for old, new in zip(scratch_v, new_v))
    return proposal_log_probs(out.logits, sampling), (new_k, new_v)
