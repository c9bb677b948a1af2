"""Suffix matching against token sources: the one matcher of the training-free drafters.

``NGram`` matches a sequence against its own prompt and output, ``History`` against
earlier rollouts of the same prompt, its siblings and itself; both propose the
recency-weighted distribution of what followed the longest matching suffix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def suffix_runs(sources_NxM: Array, context_NxWxL: Array, max_n: int) -> Array:
  """int32 [N, W, M]: how many of each context's last tokens (at most max_n) match the
  sources ending at each position. Sources may hold several sequences separated by -1:
  a run never crosses one."""
  num_slots, length = sources_NxM.shape
  width = context_NxWxL.shape[1]
  alive_NxWxM = jnp.ones((num_slots, width, length), bool)
  run_NxWxM = jnp.zeros((num_slots, width, length), jnp.int32)
  for back in range(min(max_n, context_NxWxL.shape[2])):
    earlier_NxM = jnp.pad(sources_NxM, ((0, 0), (back, 0)), constant_values=-1)[:, :length]
    token_NxW = context_NxWxL[:, :, -1 - back]
    alive_NxWxM &= ((earlier_NxM[:, None, :] == token_NxW[..., None])
                    & (token_NxW >= 0)[..., None])
    run_NxWxM += alive_NxWxM
  return run_NxWxM


def extend_runs(sources_NxM: Array, parent_runs_NxPxM: Array, tokens_NxW: Array,
                max_n: int) -> Array:
  """``suffix_runs`` of the W children of P parents (each parent's children contiguous)
  whose contexts append ``tokens_NxW``: a run ending at s continues the parent's run
  ending at s - 1 when s holds the child's token. O(M) per child instead of O(M * max_n)."""
  width = tokens_NxW.shape[1]
  parents_NxWxM = jnp.repeat(parent_runs_NxPxM, width // parent_runs_NxPxM.shape[1], axis=1)
  earlier_NxWxM = jnp.pad(parents_NxWxM, ((0, 0), (0, 0), (1, 0)))[:, :, :-1]
  same_NxWxM = ((sources_NxM[:, None, :] == tokens_NxW[..., None])
                & (tokens_NxW >= 0)[..., None])
  return jnp.where(same_NxWxM, jnp.minimum(earlier_NxWxM + 1, max_n), 0)


def continuations_log_probs(sources_NxM: Array, run_NxWxM: Array, vocab_size: int,
                            min_n: int) -> Array:
  """log q [N, W, V] over the tokens that followed the longest runs (at least min_n),
  recency-weighted; rows with no such run get -inf everywhere."""
  num_slots, width, length = run_NxWxM.shape
  next_NxM = jnp.concatenate([sources_NxM[:, 1:], jnp.full((num_slots, 1), -1, jnp.int32)],
                             axis=1)
  has_next_NxM = (next_NxM >= 0) & (next_NxM < vocab_size)
  run_NxWxM = jnp.where(has_next_NxM[:, None], run_NxWxM, 0)
  best_NxW = jnp.max(run_NxWxM, axis=-1)
  use_NxWxM = (run_NxWxM == best_NxW[..., None]) & (best_NxW >= min_n)[..., None]
  # Weighted by where the matched window starts, exactly as the n-gram drafter does.
  start_NxWxM = jnp.arange(length)[None, None, :] + 1 - best_NxW[..., None]
  weight_NxWxM = use_NxWxM * (1.0 + start_NxWxM / length)
  slot_NxWxM = jnp.broadcast_to(jnp.arange(num_slots)[:, None, None], use_NxWxM.shape)
  node_NxWxM = jnp.broadcast_to(jnp.arange(width)[None, :, None], use_NxWxM.shape)
  token_NxWxM = jnp.broadcast_to(jnp.where(has_next_NxM, next_NxM, 0)[:, None], use_NxWxM.shape)
  counts_NxWxV = jnp.zeros((num_slots, width, vocab_size)).at[
      slot_NxWxM, node_NxWxM, token_NxWxM].add(weight_NxWxM)
  total_NxWx1 = jnp.sum(counts_NxWxV, axis=-1, keepdims=True)
  return jnp.where(counts_NxWxV > 0,
                   jnp.log(counts_NxWxV / jnp.where(total_NxWx1 > 0, total_NxWx1, 1.0)),
                   -jnp.inf)


def longest_match_log_probs(sources_NxM: Array, context_NxWxL: Array, vocab_size: int,
                            max_n: int, min_n: int) -> Array:
  """log q [N, W, V] over the tokens that followed the longest suffix of each context
  (up to max_n tokens, at least min_n) found in the slot's sources.

  That is: the recency-weighted continuations of the largest n in [min_n, max_n] whose
  last-n-token window occurs, found in one pass over n (the run of matching tokens
  ending at each source position grows while the tokens keep matching), so the cost is
  O(M * max_n) rather than O(M * max_n^2) and long matches are affordable. Sources
  may hold several sequences separated by -1; nothing is proposed from a position
  whose next entry is not a token.
  """
  return continuations_log_probs(sources_NxM, suffix_runs(sources_NxM, context_NxWxL, max_n),
                                 vocab_size, min_n)
