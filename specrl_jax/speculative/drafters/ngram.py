"""Training-free n-gram drafter: continue the latest n-gram as it continued before."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specrl_jax.config import ConfigError
from specrl_jax.speculative.drafters.base import Drafter

Array = jax.Array


def continuation_log_probs(history_NxC: Array, lengths_N: Array, context_NxWxL: Array,
                           vocab_size: int, max_n: int, min_n: int) -> Array:
  """log q [N, W, V] over the token that followed earlier occurrences of the context's
  last n tokens in the history, for the largest n in [min_n, max_n] that occurs.

  Occurrences are weighted by recency (1 + position / C) so the most recent
  continuation wins ties, as in serving engines' prompt-lookup drafting. Rows with no
  occurrence get -inf everywhere (nothing to propose).
  """
  num_slots, context = history_NxC.shape
  width = context_NxWxL.shape[1]
  log_q = jnp.full((num_slots, width, vocab_size), -jnp.inf)
  found_NxW = jnp.zeros((num_slots, width), bool)
  slot_NxWxC = jnp.broadcast_to(jnp.arange(num_slots)[:, None, None], (num_slots, width, context))
  node_NxWxC = jnp.broadcast_to(jnp.arange(width)[None, :, None], (num_slots, width, context))
  for n in range(max_n, min_n - 1, -1):
    starts = context - n
    windows_NxSxn = jnp.stack([history_NxC[:, i:i + starts] for i in range(n)], axis=-1)
    suffix_NxWxn = context_NxWxL[:, :, -n:]
    match_NxWxS = jnp.all(windows_NxSxn[:, None] == suffix_NxWxn[:, :, None], axis=-1)
    match_NxWxS &= jnp.all(suffix_NxWxn >= 0, axis=-1)[..., None]
    start_S = jnp.arange(starts)
    # The continuation must itself be in the history.
    match_NxWxS &= (start_S[None, None, :] + n) < lengths_N[:, None, None]
    weight_NxWxS = match_NxWxS * (1.0 + start_S / context)
    next_NxS = history_NxC[:, n:n + starts]
    counts = jnp.zeros((num_slots, width, vocab_size)).at[
        slot_NxWxC[..., :starts], node_NxWxC[..., :starts],
        jnp.broadcast_to(jnp.maximum(next_NxS, 0)[:, None], match_NxWxS.shape)].add(weight_NxWxS)
    total = jnp.sum(counts, axis=-1, keepdims=True)
    level_log_q = jnp.where(counts > 0, jnp.log(counts / jnp.where(total > 0, total, 1.0)),
                            -jnp.inf)
    use_NxW = ~found_NxW & (total[..., 0] > 0)
    log_q = jnp.where(use_NxW[..., None], level_log_q, log_q)
    found_NxW |= use_NxW
  return log_q


class NGram(Drafter):
  """Prompt/history lookup drafting (as in vLLM's n-gram speculator).

  The last n tokens (n from ``n`` down to ``min_n``) are looked up in the prompt and
  the tokens generated so far; q is the recency-weighted distribution of what followed
  them. Tree children are the most likely distinct continuations; drafts deeper in the
  tree extend the context with the drafted path. Positions without any match propose
  nothing, so that slot decodes one token that round.
  """

  stateless = True  # matches against the token history only

  def __init__(self, n: int = 3, min_n: int = 1, vocab_size: int | None = None):
    if not isinstance(n, int) or n < 1:
      raise ConfigError(f"NGram.n={n!r} is invalid: expected a positive integer.")
    if not isinstance(min_n, int) or not 1 <= min_n <= n:
      raise ConfigError(f"NGram.min_n={min_n!r} is invalid: expected an integer in [1, n={n}].")
    self.n, self.min_n = n, min_n
    self.vocab_size = vocab_size

  def __hash__(self):
    return hash((NGram, self.n, self.min_n, self.vocab_size))

  def __eq__(self, other):
    return isinstance(other, NGram) and (other.n, other.min_n, other.vocab_size) == (
        self.n, self.min_n, self.vocab_size)

  def check_target(self, target_config) -> None:
    if self.vocab_size is not None and self.vocab_size != target_config.vocab_size:
      raise ConfigError(f"NGram vocab_size={self.vocab_size} does not match the target's "
                        f"vocab_size={target_config.vocab_size}.")

  def bind(self, target_config) -> "NGram":
    self.check_target(target_config)
    return NGram(self.n, self.min_n, target_config.vocab_size)

  def _history(self, inputs):
    """History with the last token in place (it is emitted, so already there)."""
    return inputs.history_NxC, inputs.cache_lengths_N + 1

  def _tail(self, inputs) -> Array:
    """The last n tokens of each slot's history [N, n] (-1 where the history is shorter)."""
    history, lengths = self._history(inputs)
    offsets = lengths[:, None] - self.n + jnp.arange(self.n)[None, :]
    tail = jnp.take_along_axis(history, jnp.clip(offsets, 0, history.shape[1] - 1), axis=1)
    return jnp.where(offsets >= 0, tail, -1)

  def start(self, params, state, kv, inputs, sampling, max_pending):
    history, lengths = self._history(inputs)
    log_q = continuation_log_probs(history, lengths, self._tail(inputs)[:, None],
                                   self.vocab_size, self.n, self.min_n)
    return log_q[:, 0], state, kv, ()

  def extend(self, params, state, kv, scratch, inputs, sampling, depth, tokens_NxW,
             paths_NxWxD, mask_WxE):
    history, lengths = self._history(inputs)
    width = tokens_NxW.shape[1]
    tail_NxWxn = jnp.broadcast_to(self._tail(inputs)[:, None], (tokens_NxW.shape[0], width, self.n))
    context = jnp.concatenate([tail_NxWxn, paths_NxWxD[:, :, :depth]], axis=-1)
    return continuation_log_probs(history, lengths, context, self.vocab_size, self.n,
                                  self.min_n), scratch
