"""The drafter interface: what any proposal mechanism implements to plug into
``sj.generate``. A drafter proposes the tree level by level:

  start(...)  -> q at the root (the next token after the last emitted one)
  extend(...) -> q at each node of the next tree level, given those nodes' tokens

and the engine turns each q into children (sampled without replacement, or the top
tokens), verifies the tree against the target and emits the accepted path. Drafters are
hashable static objects; their array state lives in ``params()`` and the per-slot
``state`` pytree the engine carries through the decode loop.
"""

from __future__ import annotations

import abc
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specrl_jax.config import SamplingParams

Array = jax.Array


@flax.struct.dataclass
class RoundInputs:
  """What a drafter may read at the start of a round (N slots, history of C tokens).

  last_token_N sits at position cache_lengths_N[n]; it is emitted but not yet in any
  cache. history_NxC holds prompt + emitted tokens (-1 beyond); its first
  prompt_lengths_N[n] tokens are the prompt. slot_request_N is the request each slot
  serves (-1 when free); requests of the same prompt are siblings of a GRPO group.
  """
  last_token_N: Array
  cache_lengths_N: Array
  history_NxC: Array
  active_N: Array
  prompt_lengths_N: Array
  slot_request_N: Array


  @classmethod
  def of(cls, state) -> "RoundInputs":
    """What the decode state (``sampling.engine.DecodeState``) shows a drafter."""
    return cls(last_token_N=state.last_token_N, cache_lengths_N=state.cache_lengths_N,
               history_NxC=state.history_NxC, active_N=state.active_N,
               prompt_lengths_N=state.prompt_lengths_N, slot_request_N=state.slot_request_N)


def tokens_to_feed(inputs: RoundInputs, cached_N: Array, count_N: Array, width: int):
  """count_N[n] tokens of slot n's history from position cached_N[n] on, padded to
  ``width``. Returns (tokens_NxP, positions_NxP, valid_NxP); invalid entries hold 0."""
  index_P = jnp.arange(width, dtype=jnp.int32)
  positions_NxP = cached_N[:, None] + index_P[None, :]
  valid_NxP = index_P[None, :] < count_N[:, None]
  context = inputs.history_NxC.shape[1]
  tokens_NxP = jnp.take_along_axis(inputs.history_NxC,
                                   jnp.clip(positions_NxP, 0, context - 1), axis=1)
  return jnp.where(valid_NxP, tokens_NxP, 0), positions_NxP, valid_NxP


def unseen_tokens(inputs: RoundInputs, cached_N: Array) -> Array:
  """Per active slot, the tokens before the last one that a drafter whose cache holds
  cached_N[n] positions has not fed (what ``Drafter.catch_up`` feeds)."""
  return jnp.where(inputs.active_N, jnp.maximum(inputs.cache_lengths_N - cached_N, 0), 0)


class Drafter(abc.ABC):
  """Base class for drafters. Subclasses implement ``start`` and ``extend``."""

  # Target layers whose outputs the drafter reads from verification (EAGLE-3: low,
  # middle, high). Empty for drafters that do not read hidden states.
  hidden_layers: tuple[int, ...] = ()
  # True when the drafter keeps nothing between rounds (reads only the token history):
  # a round that drafts nothing is then a plain decoding step, with no drafter call.
  stateless: bool = False
  # True when the drafter can sit out plain rounds (the adaptive engine's k = 0): they
  # call ``record`` with the target's output, and before the drafter drafts again
  # ``catch_up`` feeds it the tokens it missed. False: plain rounds with this drafter
  # still run its start and finish on an empty draft.
  catches_up: bool = False

  def check_target(self, target_config) -> None:
    """Raises a clear error when this drafter cannot serve ``target_config``."""

  def bind(self, target_config) -> "Drafter":
    """The drafter ready to serve ``target_config`` (checked; may fill in its vocab)."""
    self.check_target(target_config)
    return self

  def kv_layers(self) -> tuple[tuple[int, int], ...]:
    """(num_kv_heads, head_dim) of each KV layer the drafter keeps in the page pool."""
    return ()

  def params(self) -> Any:
    """Array pytree passed into the compiled program (weights, tables)."""
    return ()

  def init_state(self, num_slots: int) -> Any:
    return ()

  def prefill(self, params, state, kv, tokens_UxT: Array, lengths_U: Array,
              target_output) -> tuple[Any, Any]:
    """Writes the drafter's KV for the prompts (kv: its layers of the prompt pages)."""
    return state, kv

  def on_admit(self, params, state, admit_N: Array, prompt_lengths_N: Array) -> Any:
    return state

  @abc.abstractmethod
  def start(self, params, state, kv, inputs: RoundInputs, sampling: SamplingParams,
            max_pending: int) -> tuple[Array, Any, Any, Any]:
    """Returns (log q [N, V] at the root, state, kv, scratch for ``extend``)."""

  @abc.abstractmethod
  def extend(self, params, state, kv, scratch, inputs: RoundInputs,
             sampling: SamplingParams, depth: int, tokens_NxW: Array, paths_NxWxD: Array,
             mask_WxE) -> tuple[Array, Any]:
    """log q [N, W, V] after each of the W nodes at ``depth`` (their tokens and the
    token paths from depth 1 down to them are given), and the updated scratch."""

  def finish(self, params, state, kv, inputs: RoundInputs, verdict, target_output
             ) -> tuple[Any, Any]:
    """Sees the verification outcome (e.g. to read the target's hidden states)."""
    return state, kv

  def record(self, params, state, kv, inputs: RoundInputs, target_output) -> tuple[Any, Any]:
    """A plain round fed each active slot's last token to the target (at position
    inputs.cache_lengths_N): keep what cannot be recomputed later (e.g. the target's
    hidden state there). Only for drafters that ``catches_up``."""
    return state, kv

  def unseen_tokens(self, state, inputs: RoundInputs) -> Array:
    """Tokens per slot that ``catch_up`` still has to feed."""
    return jnp.zeros_like(inputs.cache_lengths_N)

  def catch_up(self, params, state, kv, inputs: RoundInputs, max_tokens: int
               ) -> tuple[Any, Any]:
    """Feeds up to ``max_tokens`` of each slot's unseen tokens (all emitted tokens but
    the last, which the next ``start`` feeds)."""
    return state, kv

  def stats(self, state) -> dict[str, float]:
    """Drafter-specific statistics from the final drafter state (host arrays), reported
    by ``generate`` under ``stats["drafter"]`` (e.g. proposals and acceptance per source)."""
    return {}
