"""Training-free n-gram drafter: continue the latest n-gram as it continued before."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specrl_jax.config import ConfigError, is_integer
from specrl_jax.speculative.drafters.base import Drafter, TreeLevel
from specrl_jax.speculative.drafters.matching import longest_match_log_probs

Array = jax.Array

# The matcher unrolls one comparison of the whole history per suffix position, so
# compile time grows with n (experiments/compile_bounds.py, docs/drafters.md); matches
# longer than a few tokens add nothing a 16-gram does not already find.
MAX_N = 16


class NGram(Drafter):
  """Prompt/history lookup drafting (as in vLLM's n-gram speculator).

  The last n tokens (n from ``n`` down to ``min_n``) are looked up in the prompt and
  the tokens generated so far; q is the recency-weighted distribution of what followed
  them. Tree children are the most likely distinct continuations; drafts deeper in the
  tree extend the context with the drafted path. Positions without any match propose
  nothing, so that slot decodes one token that round. n is at most MAX_N = 16 (what
  compiles in reasonable time).
  """

  stateless = True  # matches against the token history only

  def __init__(self, n: int = 3, min_n: int = 1, vocab_size: int | None = None):
    if not is_integer(n) or not 1 <= n <= MAX_N:
      raise ConfigError(f"NGram.n={n!r} is invalid: expected an integer in [1, {MAX_N}] "
                        "(the matcher is unrolled per suffix position: larger n takes "
                        "minutes to compile and matches nothing more useful).")
    if not is_integer(min_n) or not 1 <= min_n <= n:
      raise ConfigError(f"NGram.min_n={min_n!r} is invalid: expected an integer in [1, n={n}].")
    self.n, self.min_n = int(n), int(min_n)
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

  def _sources(self, inputs) -> Array:
    """The history with -1 past each slot's length: nothing is matched there."""
    history, lengths = self._history(inputs)
    return jnp.where(jnp.arange(history.shape[1])[None, :] < lengths[:, None], history, -1)

  def _tail(self, inputs) -> Array:
    """The last n tokens of each slot's history [N, n] (-1 where the history is shorter)."""
    history, lengths = self._history(inputs)
    offsets = lengths[:, None] - self.n + jnp.arange(self.n)[None, :]
    tail = jnp.take_along_axis(history, jnp.clip(offsets, 0, history.shape[1] - 1), axis=1)
    return jnp.where(offsets >= 0, tail, -1)

  def start(self, params, state, kv, inputs, sampling, max_pending):
    log_q = longest_match_log_probs(self._sources(inputs), self._tail(inputs)[:, None],
                                    self.vocab_size, self.n, self.min_n)
    return log_q[:, 0], state, kv, ()

  def extend(self, params, state, kv, scratch, inputs, level: TreeLevel):
    num_slots, width = level.tokens_NxW.shape
    tail_NxWxn = jnp.broadcast_to(self._tail(inputs)[:, None], (num_slots, width, self.n))
    context = jnp.concatenate([tail_NxWxn, level.paths_NxWxZ[:, :, :level.depth]], axis=-1)
    return longest_match_log_probs(self._sources(inputs), context, self.vocab_size, self.n,
                                   self.min_n), scratch
