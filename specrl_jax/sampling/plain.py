"""The plain decoding round: one target forward, one sampled token per active slot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from specrl_jax.config import SamplingParams
from specrl_jax.models.transformer import ForwardOutput, Transformer
from specrl_jax.sampling.engine import DecodeState, emit, reserve_pages
from specrl_jax.sampling.warp import sample_tokens, warped_log_probs

# (state, the target's forward output) -> (state, KV pages to keep): sees the round's
# forward before sampling, e.g. to keep an idle drafter in step.
Observer = Callable[[DecodeState, ForwardOutput], tuple[DecodeState, Any]]


def plain_round(model: Transformer, state: DecodeState, sampling: SamplingParams, *,
                hidden_layers: tuple[int, ...] = (), observe: Observer | None = None
                ) -> DecodeState:
  """hidden_layers: the target layers the forward also returns (for ``observe``)."""
  active_N = state.active_N
  positions_N = state.cache_lengths_N
  state = reserve_pages(state, jnp.where(active_N, positions_N + 1, 0), max_new_pages=1)
  num_slots = state.num_slots
  kv = state.kv.replace(
      prefix_lengths_B=positions_N,
      new_mask_BxTxT=jnp.ones((num_slots, 1, 1), bool),
      write_positions_BxT=jnp.where(active_N, positions_N, -1)[:, None])
  out = model.forward(state.last_token_N[:, None], positions_BxT=positions_N[:, None], kv=kv,
                      hidden_layers=hidden_layers)
  pages = out.kv
  if observe is not None:
    state, pages = observe(state, out)
  log_probs_NxV = warped_log_probs(out.logits[:, 0], sampling)
  rng, key = jax.random.split(state.rng)
  token_N = sample_tokens(key, log_probs_NxV, sampling)
  token_log_prob_N = jnp.take_along_axis(log_probs_NxV, token_N[:, None], axis=1)
  counters = dict(state.counters, target_calls=state.counters["target_calls"] + 1)
  state = state.replace(kv=state.kv.replace(k_pages=pages.k_pages, v_pages=pages.v_pages),
                        rng=rng, counters=counters,
                        cache_lengths_N=positions_N + active_N.astype(jnp.int32))
  state, _ = emit(state, token_N[:, None], token_log_prob_N, active_N.astype(jnp.int32),
                  sampling)
  return state
