"""The base of drafters that keep their own KV cache in the shared page pool
(DraftModel, MTP, EAGLE-3): the cache bookkeeping they share.

Such a drafter's cache is kept in step with the target lazily. Its state is how many
positions of each slot its cache holds (``cache_lengths_N``). Each round's ``start``
first feeds the tokens emitted since the cache was last written (the accepted drafts,
then the last token, which the target has not cached either) and drafts the root from
the output at the last one; ``catch_up`` feeds the same tokens but the last. Deeper tree
levels write nothing to the pages: their keys and values stay in the round's scratch,
which each level's attention reads through the tree mask.

A subclass says how its network runs over fed tokens and over a tree level
(``decode_fed``, ``root_log_q``, ``decode_level``); the base decides what is fed, where,
and with which masks.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specrl_jax.kv.paged import LayerOffset
from specrl_jax.speculative.drafters.base import Drafter, RoundInputs, TreeLevel

Array = jax.Array


def tokens_to_feed(inputs: RoundInputs, cached_N: Array, count_N: Array, width: int):
  """count_N[n] tokens of slot n's history from position cached_N[n] on, padded to
  ``width``. Returns (tokens_NxT, positions_NxT, valid_NxT); invalid entries hold 0."""
  index_T = jnp.arange(width, dtype=jnp.int32)
  positions_NxT = cached_N[:, None] + index_T[None, :]
  valid_NxT = index_T[None, :] < count_N[:, None]
  context = inputs.history_NxC.shape[1]
  tokens_NxT = jnp.take_along_axis(inputs.history_NxC,
                                   jnp.clip(positions_NxT, 0, context - 1), axis=1)
  return jnp.where(valid_NxT, tokens_NxT, 0), positions_NxT, valid_NxT


def unseen_tokens(inputs: RoundInputs, cached_N: Array) -> Array:
  """Per active slot, the tokens before the last one that a drafter whose cache holds
  cached_N[n] positions has not fed (what ``Drafter.catch_up`` feeds)."""
  return jnp.where(inputs.active_N, jnp.maximum(inputs.cache_lengths_N - cached_N, 0), 0)


@flax.struct.dataclass
class LevelScratch:
  """What ``extend`` carries from one tree level to the next: the uncommitted keys and
  values of the levels drafted so far (one [N, E, heads, dim] array per KV layer; empty
  before the first level) and the drafter's outputs at the latest level's nodes, which
  drafters that feed their own output to the children read (MTP, EAGLE-3)."""
  keys: tuple[Array, ...]
  values: tuple[Array, ...]
  parents_NxIxD: Array


class CachedDrafter(Drafter):
  """A drafter with its own KV layers (see the module docstring). Subclasses implement
    decode_fed(params, tokens_NxT, positions_NxT, valid_NxT, kv) -> (outputs_NxTxD, kv)
    root_log_q(params, root_Nx1xD, sampling) -> log q [N, V]
    decode_level(params, tokens_NxW, positions_NxW, parents_NxIxD, kv, sampling)
      -> (log q [N, W, V], outputs_NxWxD, kv)
  and ``kv_layers`` and ``prefill``. ``kv`` is the drafter's ``LayerOffset`` view of the
  page pool, already set up for the call (what to write, what to attend to).
  """

  # Its cache is all it keeps between rounds, and the history holds every token.
  catches_up = True

  def decode_fed(self, params, tokens_NxT: Array, positions_NxT: Array, valid_NxT: Array,
                 kv: LayerOffset) -> tuple[Array, LayerOffset]:
    raise NotImplementedError

  def root_log_q(self, params, root_Nx1xD: Array, sampling) -> Array:
    raise NotImplementedError

  def decode_level(self, params, tokens_NxW: Array, positions_NxW: Array,
                   parents_NxIxD: Array, kv: LayerOffset, sampling
                   ) -> tuple[Array, Array, LayerOffset]:
    raise NotImplementedError

  def init_state(self, num_slots: int):
    return {"cache_lengths_N": jnp.zeros((num_slots,), jnp.int32)}

  def on_admit(self, params, state, admit_N, prompt_lengths_N):
    return {"cache_lengths_N": jnp.where(admit_N, prompt_lengths_N, state["cache_lengths_N"])}

  def compact_state(self, state, slots_W):
    # The cache lives in the slot's pages, which compaction keeps with the slot.
    return {"cache_lengths_N": state["cache_lengths_N"][slots_W]}

  def unseen_tokens(self, state, inputs):
    return unseen_tokens(inputs, state["cache_lengths_N"])

  def feed(self, params, kv: LayerOffset, inputs: RoundInputs, cached_N: Array,
           count_N: Array, width: int) -> tuple[Array, LayerOffset]:
    """Writes the KV of count_N[n] history tokens from position cached_N[n] on (causal
    among themselves, after the cached prefix). Returns (outputs [N, width, D], kv)."""
    tokens_NxT, positions_NxT, valid_NxT = tokens_to_feed(inputs, cached_N, count_N, width)
    index_T = jnp.arange(width, dtype=jnp.int32)
    causal_TxT = index_T[:, None] >= index_T[None, :]
    step_kv = kv.replace(inner=kv.inner.replace(
        prefix_lengths_B=cached_N,
        new_mask_BxTxT=causal_TxT[None] & valid_NxT[:, None, :],
        write_positions_BxT=jnp.where(valid_NxT, positions_NxT, -1)))
    return self.decode_fed(params, tokens_NxT, positions_NxT, valid_NxT, step_kv)

  def start(self, params, state, kv: LayerOffset, inputs, sampling, max_pending):
    cached_N = state["cache_lengths_N"]
    pending_N = unseen_tokens(inputs, cached_N) + inputs.active_N  # and the last token
    outputs_NxTxD, kv = self.feed(params, kv, inputs, cached_N, pending_N, max_pending)
    root_Nx1xD = jnp.take_along_axis(outputs_NxTxD,
                                     jnp.maximum(pending_N - 1, 0)[:, None, None], axis=1)
    log_q_NxV = self.root_log_q(params, root_Nx1xD, sampling)
    state = {"cache_lengths_N": jnp.where(inputs.active_N, inputs.cache_lengths_N + 1, cached_N)}
    return log_q_NxV, state, kv, LevelScratch(keys=(), values=(), parents_NxIxD=root_Nx1xD)

  def catch_up(self, params, state, kv: LayerOffset, inputs, max_tokens):
    cached_N = state["cache_lengths_N"]
    count_N = jnp.minimum(unseen_tokens(inputs, cached_N), max_tokens)
    _, kv = self.feed(params, kv, inputs, cached_N, count_N, max_tokens)
    return {"cache_lengths_N": cached_N + count_N}, kv

  def extend(self, params, state, kv: LayerOffset, scratch: LevelScratch, inputs,
             level: TreeLevel):
    tokens_NxW, mask_WxJ = level.tokens_NxW, level.mask_WxJ
    num_slots, width = tokens_NxW.shape
    # The level sits after the root (fed by ``start`` at inputs.cache_lengths_N) and
    # attends to its ancestors among the earlier levels' scratch keys; it writes nothing.
    positions_NxW = jnp.broadcast_to((inputs.cache_lengths_N + level.depth)[:, None],
                                     (num_slots, width))
    level_kv = kv.replace(inner=kv.inner.replace(
        prefix_lengths_B=inputs.cache_lengths_N + 1,
        new_mask_BxTxT=jnp.broadcast_to(jnp.asarray(mask_WxJ), (num_slots,) + mask_WxJ.shape),
        write_positions_BxT=jnp.full((num_slots, width), -1, jnp.int32),
        stash=True, new_k=(), new_v=(), scratch_k=scratch.keys, scratch_v=scratch.values))
    log_q_NxWxV, outputs_NxWxD, level_kv = self.decode_level(
        params, tokens_NxW, positions_NxW, scratch.parents_NxIxD, level_kv, level.sampling)
    new_k, new_v = level_kv.inner.new_k, level_kv.inner.new_v
    if scratch.keys:
      new_k = tuple(jnp.concatenate([old, new], axis=1) for old, new in zip(scratch.keys, new_k))
      new_v = tuple(jnp.concatenate([old, new], axis=1)
                    for old, new in zip(scratch.values, new_v))
    return log_q_NxWxV, LevelScratch(keys=new_k, values=new_v, parents_NxIxD=outputs_NxWxD)
