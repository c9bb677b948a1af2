"""Suffix matching against token sources: the one matcher of the training-free drafters.

``NGram`` matches a sequence against its own prompt and output, ``History`` against
earlier rollouts of the same prompt, its siblings and itself; both propose the
recency-weighted distribution of what followed the longest matching suffix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def suffix_runs(sources_NxC: Array, context_NxWxL: Array, max_n: int) -> Array:
  """int32 [N, W, C]: how many of each context's last tokens (at most max_n) match the
  sources ending at each position. Sources may hold several sequences separated by -1:
  a run never crosses one."""
  num_slots, length = sources_NxC.shape
  width = context_NxWxL.shape[1]
  alive_NxWxC = jnp.ones((num_slots, width, length), bool)
  run_NxWxC = jnp.zeros((num_slots, width, length), jnp.int32)
  for back in range(min(max_n, context_NxWxL.shape[2])):
    earlier_NxC = jnp.pad(sources_NxC, ((0, 0), (back, 0)), constant_values=-1)[:, :length]
    token_NxW = context_NxWxL[:, :, -1 - back]
    alive_NxWxC &= ((earlier_NxC[:, None, :] == token_NxW[..., None])
                    & (token_NxW >= 0)[..., None])
    run_NxWxC += alive_NxWxC
  return run_NxWxC


def extend_runs(sources_NxC: Array, parent_runs_NxPxC: Array, tokens_NxW: Array,
                max_n: int) -> Array:
  """``suffix_runs`` of the W children of P parents (each parent's children contiguous)
  whose contexts append ``tokens_NxW``: a run ending at s continues the parent's run
  ending at s - 1 when s holds the child's token. O(C) per child instead of O(C * max_n)."""
  width = tokens_NxW.shape[1]
  parents_NxWxC = jnp.repeat(parent_runs_NxPxC, width // parent_runs_NxPxC.shape[1], axis=1)
  earlier_NxWxC = jnp.pad(parents_NxWxC, ((0, 0), (0, 0), (1, 0)))[:, :, :-1]
  same_NxWxC = ((sources_NxC[:, None, :] == tokens_NxW[..., None])
                & (tokens_NxW >= 0)[..., None])
  return jnp.where(same_NxWxC, jnp.minimum(earlier_NxWxC + 1, max_n), 0)


def continuations_log_probs(sources_NxC: Array, run_NxWxC: Array, vocab_size: int,
                            min_n: int) -> Array:
  """log q [N, W, V] over the tokens that followed the longest runs (at least min_n),
  recency-weighted; rows with no such run get -inf everywhere."""
  num_slots, width, length = run_NxWxC.shape
  next_NxC = jnp.concatenate([sources_NxC[:, 1:], jnp.full((num_slots, 1), -1, jnp.int32)],
                             axis=1)
  has_next_NxC = (next_NxC >= 0) & (next_NxC < vocab_size)
  run_NxWxC = jnp.where(has_next_NxC[:, None], run_NxWxC, 0)
  best_NxW = jnp.max(run_NxWxC, axis=-1)
  use_NxWxC = (run_NxWxC == best_NxW[..., None]) & (best_NxW >= min_n)[..., None]
  # Weighted by where the matched window starts, exactly as the n-gram drafter does.
  start_NxWxC = jnp.arange(length)[None, None, :] + 1 - best_NxW[..., None]
  weight_NxWxC = use_NxWxC * (1.0 + start_NxWxC / length)
  slot_NxWxC = jnp.broadcast_to(jnp.arange(num_slots)[:, None, None], use_NxWxC.shape)
  node_NxWxC = jnp.broadcast_to(jnp.arange(width)[None, :, None], use_NxWxC.shape)
  token_NxWxC = jnp.broadcast_to(jnp.where(has_next_NxC, next_NxC, 0)[:, None], use_NxWxC.shape)
  counts_NxWxV = jnp.zeros((num_slots, width, vocab_size)).at[
      slot_NxWxC, node_NxWxC, token_NxWxC].add(weight_NxWxC)
  total_NxWx1 = jnp.sum(counts_NxWxV, axis=-1, keepdims=True)
  return jnp.where(counts_NxWxV > 0,
                   jnp.log(counts_NxWxV / jnp.where(total_NxWx1 > 0, total_NxWx1, 1.0)),
                   -jnp.inf)


def longest_match_log_probs(sources_NxC: Array, context_NxWxL: Array, vocab_size: int,
                            max_n: int, min_n: int) -> Array:
  """log q [N, W, V] over the tokens that followed the longest suffix of each context
  (up to max_n tokens, at least min_n) found in the slot's sources.

  That is: the recency-weighted continuations of the largest n in [min_n, max_n] whose
  last-n-token window occurs, found in one pass over n (the run of matching tokens
  ending at each source position grows while the tokens keep matching), so the cost is
  O(C * max_n) rather than O(C * max_n^2) and long matches are affordable. Sources
  may hold several sequences separated by -1; nothing is proposed from a position
  whose next entry is not a token.
  """
  return continuations_log_probs(sources_NxC, suffix_runs(sources_NxC, context_NxWxL, max_n),
                                 vocab_size, min_n)
