"""Bringing an idle drafter back in step before it drafts again.

The adaptive engine's plain rounds (k = 0) skip a drafter that ``catches_up``: its
cache then misses the tokens they emitted. Before the next drafting round, those are
fed in chunks, all slots at once, until no slot is behind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specrl_jax.kv.paged import LayerOffset
from specrl_jax.sampling.engine import DecodeState
from specrl_jax.speculative.drafters.base import Drafter, RoundInputs

# Tokens per slot fed per step: a few steps cover a long plain stretch, and a step is
# still one small forward of the drafter.
CHUNK = 16


def catch_up_drafter(drafter: Drafter, drafter_params, state: DecodeState, num_layers: int,
                     chunk: int = CHUNK, *, max_pending: int = 1) -> DecodeState:
  """Feeds the drafter until every slot has at most ``max_pending`` tokens to feed,
  counting the last one, which the next round's ``start`` feeds (1: all but the last;
  the in-loop controller leaves as many as its longest chain's ``start`` takes, so
  after drafting rounds nothing is fed here). num_layers: the target's (the drafter's
  pages follow them)."""

  def behind(s: DecodeState):
    inputs = RoundInputs.of(s)
    return jnp.any(drafter.unseen_tokens(s.drafter, inputs) + inputs.active_N > max_pending)

  def step(s: DecodeState) -> DecodeState:
    view = LayerOffset(inner=s.kv, offset=num_layers)
    drafter_state, view = drafter.catch_up(drafter_params, s.drafter, view,
                                           RoundInputs.of(s), chunk)
    return s.replace(drafter=drafter_state,
                     kv=s.kv.replace(k_pages=view.inner.k_pages, v_pages=view.inner.v_pages))

  return jax.lax.while_loop(behind, step, state)
