"""One speculative decoding round: draft a tree, verify it in one target forward,
commit the accepted path's KV and emit its tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specrl_jax.config import SamplingParams
from specrl_jax.kv.paged import LayerOffset, page_size_of
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.engine import DecodeState, emit, reserve_pages
from specrl_jax.sampling.warp import warped_log_probs
from specrl_jax.speculative.drafters.base import Drafter, RoundInputs
from specrl_jax.speculative.drafting import draft_tree
from specrl_jax.speculative.topology import TreeTopology
from specrl_jax.speculative.verify import verify


def speculative_round(model: Transformer, drafter: Drafter, drafter_params, state: DecodeState,
                      sampling: SamplingParams, topology: TreeTopology,
                      draft_mode: str, max_pending: int | None = None) -> DecodeState:
  """One round for the active slots. ``max_pending``: see ``draft_tree`` (an adaptive
  engine that switches draft lengths passes its longest one's)."""
  active_N = state.active_N
  cached_N = state.cache_lengths_N
  depth = topology.depth
  page_size = page_size_of(state.kv.k_pages[0])
  state = reserve_pages(state, jnp.where(active_N, cached_N + 1 + depth, 0),
                        max_new_pages=-(-(depth + 1) // page_size) + 1)
  inputs = RoundInputs.of(state)
  rng, draft_key, verify_key = jax.random.split(state.rng, 3)
  drafter_kv = LayerOffset(inner=state.kv, offset=model.config.num_layers)
  tree, drafter_state, drafter_kv = draft_tree(draft_key, drafter, drafter_params,
                                               state.drafter, drafter_kv, inputs, sampling,
                                               topology, draft_mode, max_pending)
  kv = state.kv.replace(k_pages=drafter_kv.inner.k_pages, v_pages=drafter_kv.inner.v_pages)

  num_slots = state.num_slots
  tokens_NxY = jnp.concatenate([state.last_token_N[:, None], tree.tokens_NxJ], axis=1)
  positions_NxY = cached_N[:, None] + jnp.asarray(topology.node_depth)[None, :]
  mask = jnp.asarray(topology.ancestor_mask)
  verify_kv = kv.replace(prefix_lengths_B=cached_N,
                         new_mask_BxTxT=jnp.broadcast_to(mask, (num_slots,) + mask.shape),
                         write_positions_BxT=jnp.full(tokens_NxY.shape, -1, jnp.int32),
                         stash=True, new_k=(), new_v=())
  out = model.forward(tokens_NxY, positions_BxT=positions_NxY, kv=verify_kv,
                      hidden_layers=drafter.hidden_layers)
  target_log_probs = warped_log_probs(out.logits, sampling)
  verdict = verify(verify_key, target_log_probs, tree.tokens_NxJ,
                   tree.valid_NxJ & active_N[:, None], tree.log_q_NxIxV, topology, draft_mode)

  # The root and the accepted path enter the cache at consecutive positions.
  committed = out.kv.commit(*verdict.accepted_positions(cached_N, active_N))
  drafter_kv = LayerOffset(inner=committed.replace(stash=False), offset=model.config.num_layers)
  drafter_state, drafter_kv = drafter.finish(drafter_params, drafter_state, drafter_kv, inputs,
                                             verdict, out)

  accepted_N = jnp.where(active_N, verdict.num_accepted_N, 0)
  counters = dict(state.counters)
  counters["target_calls"] = counters["target_calls"] + 1
  if depth > 0:  # acceptance statistics describe rounds that drafted something
    counters["draft_rounds"] = counters["draft_rounds"] + jnp.sum(active_N, dtype=jnp.int32)
  accepted_Z = jnp.sum((verdict.path_NxZ >= 0) & active_N[:, None], axis=0, dtype=jnp.int32)
  # The counter is as long as the longest draft the engine may use.
  longest = counters["accepted_per_position"].shape[0]
  counters["accepted_per_position"] = counters["accepted_per_position"] + jnp.pad(
      accepted_Z, (0, longest - depth))
  # Rounds of different lengths (adaptive) draft different positions.
  counters["drafted_per_position"] = counters["drafted_per_position"] + jnp.where(
      jnp.arange(longest) < depth, jnp.sum(active_N, dtype=jnp.int32), 0)
  state = state.replace(
      kv=state.kv.replace(k_pages=drafter_kv.inner.k_pages, v_pages=drafter_kv.inner.v_pages),
      drafter=drafter_state, rng=rng, counters=counters,
      cache_lengths_N=cached_N + jnp.where(active_N, 1 + accepted_N, 0))
  state, _ = emit(state, verdict.tokens_NxE, verdict.log_probs_NxE,
                  jnp.where(active_N, accepted_N + 1, 0), sampling)
  return state
