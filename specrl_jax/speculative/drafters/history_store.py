"""The history drafter's sizes, prompt keys and host-side store of earlier rollouts.

``HistoryStore`` keeps each prompt's last rollouts in arrays of a fixed size
(``HistoryConfig.bank_bytes``) on the host; the drafter (``history.py``) hands them to
the compiled program as params, so one program serves every epoch. A prompt's key is
computed the same way here (``prompt_key``) and inside jit (``prompt_keys``), so the
engine needs no request-to-prompt table.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import check, check_positive_int

Array = jax.Array

# Polynomial hash of a prompt modulo 2**32: sum_i (token_i + 1) * BASE**i + length * MIX.
_KEY_BASE = 0x01000193
_KEY_LENGTH_MIX = 0x9E3779B1


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistoryConfig:
  """Sizes of the history drafter; together they bound its memory.

  max_prompts: P, prompts whose earlier rollouts the store keeps (least recently
    updated prompt evicted first).
  rollouts_per_prompt: G, earlier rollouts kept per prompt (oldest evicted first).
  rollout_tokens: L, tokens kept per rollout: the prompt's last ``max_match`` tokens,
    then the response (cut to fit; the last position always stays empty).
  max_match: longest suffix (in tokens) matched; longer matches pool with it.
  min_match: shorter matches propose nothing, or defer to the fallback drafter; None:
    1 alone, max_match // 2 with a fallback (a short match of a few tokens is a worse
    guess than a trained drafter's).
  siblings: sibling rollouts of the same prompt searched per sequence, from the slots
    and, separately, from the in-loop table of finished rollouts.
  finished_rollouts: F, size of that in-loop table (oldest overwritten).
  """
  max_prompts: int = 256
  rollouts_per_prompt: int = 8
  rollout_tokens: int = 128
  max_match: int = 16
  min_match: int | None = None
  siblings: int = 4
  finished_rollouts: int = 64

  def __post_init__(self):
    owner = "HistoryConfig"
    for name in ("max_prompts", "rollouts_per_prompt", "max_match", "finished_rollouts"):
      value = getattr(self, name)
      check_positive_int(owner, name, value)
    check(isinstance(self.siblings, int) and self.siblings >= 0, owner, "siblings",
          self.siblings, "an integer >= 0 (0 searches no siblings)")
    check(self.min_match is None or (isinstance(self.min_match, int)
                                     and 1 <= self.min_match <= self.max_match),
          owner, "min_match", self.min_match,
          f"None or an integer in [1, max_match={self.max_match}]")
    check(isinstance(self.rollout_tokens, int) and self.rollout_tokens >= self.max_match + 2,
          owner, "rollout_tokens", self.rollout_tokens,
          f"an integer >= max_match + 2 = {self.max_match + 2} (prompt tail, a response "
          "token and the empty end)")

  @property
  def bank_bytes(self) -> int:
    """Bytes of the store's arrays (and of the bank ``params()`` hands to the device)."""
    p, g, l = self.max_prompts, self.rollouts_per_prompt, self.rollout_tokens
    return p * g * l * 4 + p * 4 + p


def store_layout(config: HistoryConfig) -> tuple[int, int, int, int]:
  """The fields that shape stored rollouts (a store serves any drafter agreeing on them)."""
  return (config.max_prompts, config.rollouts_per_prompt, config.rollout_tokens,
          config.max_match)


# ----------------------------------------------------------------- prompt keys

@functools.lru_cache(maxsize=64)
def _key_powers(length: int) -> np.ndarray:
  """BASE**i mod 2**32 for i < length (read-only: the cache shares it)."""
  powers = np.empty(length, np.uint32)
  value = 1
  for i in range(length):
    powers[i] = value
    value = value * _KEY_BASE % 2**32
  powers.flags.writeable = False
  return powers


def prompt_key(prompt: Sequence[int]) -> int:
  """The 32-bit key of a prompt; ``prompt_keys`` computes the same inside jit."""
  tokens = np.asarray(prompt, np.int64).reshape(-1)
  terms = (tokens + 1).astype(np.uint32) * _key_powers(tokens.size)
  return (int(np.sum(terms, dtype=np.uint32)) + tokens.size * _KEY_LENGTH_MIX) % 2**32


def prompt_keys(history_NxC: Array, prompt_lengths_N: Array) -> Array:
  """uint32 [N]: ``prompt_key`` of the first prompt_lengths_N[n] tokens of each row."""
  context = history_NxC.shape[1]
  in_prompt_NxC = jnp.arange(context)[None, :] < prompt_lengths_N[:, None]
  terms_NxC = (history_NxC + 1).astype(jnp.uint32) * jnp.asarray(_key_powers(context))[None]
  terms_NxC = jnp.where(in_prompt_NxC, terms_NxC, jnp.uint32(0))
  return (jnp.sum(terms_NxC, axis=1, dtype=jnp.uint32)
          + prompt_lengths_N.astype(jnp.uint32) * jnp.uint32(_KEY_LENGTH_MIX))


def rollout_row(prompt: Sequence[int], response: Sequence[int], config: HistoryConfig
                ) -> np.ndarray:
  """int32 [L]: the prompt's last max_match tokens, then the response, -1 padded."""
  row = np.full(config.rollout_tokens, -1, np.int32)
  tokens = list(prompt[-config.max_match:]) + list(response)
  tokens = tokens[:config.rollout_tokens - 1]
  row[:len(tokens)] = tokens
  return row


def rollout_rows(history_NxC: Array, prompt_lengths_N: Array, config: HistoryConfig) -> Array:
  """int32 [N, L]: ``rollout_row`` of each slot row, inside jit."""
  context = history_NxC.shape[1]
  first_N = jnp.maximum(prompt_lengths_N - config.max_match, 0)
  columns_NxL = first_N[:, None] + jnp.arange(config.rollout_tokens)[None, :]
  rows_NxL = jnp.take_along_axis(history_NxC, jnp.minimum(columns_NxL, context - 1), axis=1)
  keep_NxL = (columns_NxL < context) & (jnp.arange(config.rollout_tokens) <
                                        config.rollout_tokens - 1)[None, :]
  return jnp.where(keep_NxL, rows_NxL, -1)


# ----------------------------------------------------------------- the host-side store

class HistoryStore:
  """Earlier rollouts by prompt, in arrays of a fixed size (``config.bank_bytes``).

  Each of the P rows holds one prompt's last G rollouts, oldest first; a new rollout
  pushes out the row's oldest, and a new prompt takes a free row or the row updated
  longest ago.
  """

  def __init__(self, config: HistoryConfig):
    self.config = config
    p, g, l = config.max_prompts, config.rollouts_per_prompt, config.rollout_tokens
    self.tokens_PxGxL = np.full((p, g, l), -1, np.int32)
    self.keys_P = np.zeros((p,), np.uint32)
    self.valid_P = np.zeros((p,), bool)
    self.counts_P = np.zeros((p,), np.int64)
    self.updated_P = np.zeros((p,), np.int64)
    self._row_of: dict[int, int] = {}
    self._clock = 0
    self._device = None

  def __len__(self) -> int:
    """Prompts held."""
    return len(self._row_of)

  @property
  def nbytes(self) -> int:
    """Bytes of the bank arrays (``config.bank_bytes``, whatever has been added)."""
    return self.tokens_PxGxL.nbytes + self.keys_P.nbytes + self.valid_P.nbytes

  def _row_for(self, key: int) -> int:
    row = self._row_of.get(key)
    if row is not None:
      return row
    free = np.flatnonzero(~self.valid_P)
    row = int(free[0]) if free.size else int(np.argmin(self.updated_P))
    if self.valid_P[row]:
      del self._row_of[int(self.keys_P[row])]
    self.tokens_PxGxL[row] = -1
    self.keys_P[row], self.valid_P[row], self.counts_P[row] = key, True, 0
    self._row_of[key] = row
    return row

  def add(self, prompt: Sequence[int], response: Sequence[int]) -> None:
    """Records one rollout (the response's tokens, its stop token included)."""
    row = self._row_for(prompt_key(prompt))
    self.tokens_PxGxL[row, :-1] = self.tokens_PxGxL[row, 1:]
    self.tokens_PxGxL[row, -1] = rollout_row(prompt, response, self.config)
    self.counts_P[row] = min(self.counts_P[row] + 1, self.config.rollouts_per_prompt)
    self._clock += 1
    self.updated_P[row] = self._clock
    self._device = None

  def holds(self, prompt: Sequence[int]) -> bool:
    return prompt_key(prompt) in self._row_of

  def responses(self, prompt: Sequence[int]) -> list[list[int]]:
    """The stored (possibly cut) responses to ``prompt``, oldest first."""
    row = self._row_of.get(prompt_key(prompt))
    if row is None:
      return []
    tail = min(len(prompt), self.config.max_match)
    kept = self.tokens_PxGxL[row, self.config.rollouts_per_prompt - self.counts_P[row]:]
    return [[int(t) for t in r[tail:] if t >= 0] for r in kept]

  def clear(self) -> None:
    self.__init__(self.config)

  def device_arrays(self) -> dict[str, Array]:
    """The bank as device arrays (cached until the next ``add``)."""
    if self._device is None:
      self._device = {"tokens_PxGxL": jnp.asarray(self.tokens_PxGxL),
                      "keys_P": jnp.asarray(self.keys_P), "valid_P": jnp.asarray(self.valid_P)}
    return self._device
