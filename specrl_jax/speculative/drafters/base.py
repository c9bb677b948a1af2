"""The drafter interface: what any proposal mechanism implements to plug into
``sj.generate``. A drafter proposes the tree level by level:

  start(...)  -> q at the root (the next token after the last emitted one)
  extend(...) -> q at each node of the next tree level, given those nodes' tokens

and the engine turns each q into children (sampled without replacement, or the top
tokens), verifies the tree against the target and emits the accepted path. Drafters are
hashable static objects; their array state lives in ``params()`` and the per-slot
``state`` pytree the engine carries through the decode loop.

Drafters that keep their own KV cache in the page pool (DraftModel, MTP, EAGLE-3) derive
from ``cached.CachedDrafter``, which owns the cache bookkeeping (what is fed when, the
feeding masks, the tree levels' scratch) and leaves them only their network.
"""

from __future__ import annotations

import abc
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class TreeLevel:
  """The W nodes of one tree level that ``Drafter.extend`` scores. Built inside the
  compiled round (never passed through a jit boundary), so it is a plain container.

  depth: the level, 1 for the root's children; tokens_NxW: its nodes' tokens;
  paths_NxWxZ: the tokens from depth 1 down to each node (the first ``depth`` of Z);
  mask_WxJ: which drafted nodes of the earlier levels each node attends to (its
  ancestors; J counts the nodes up to this level's); sampling: the round's warp.
  """
  depth: int
  tokens_NxW: Array
  paths_NxWxZ: Array
  mask_WxJ: Any  # a numpy constant of the tree's topology, or an array
  sampling: SamplingParams


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
  def extend(self, params, state, kv, scratch, inputs: RoundInputs, level: TreeLevel
             ) -> tuple[Array, Any]:
    """log q [N, W, V] after each of the W nodes of ``level`` (their tokens and the
    token paths from depth 1 down to them are given), and the updated scratch."""

  def finish(self, params, state, kv, inputs: RoundInputs, verdict, target_output
             ) -> tuple[Any, Any]:
    """Sees the verification outcome (e.g. to read the target's hidden states; the
    root and the accepted nodes entered the cache at ``verdict.accepted_positions``)."""
    return state, kv

  def record(self, params, state, kv, inputs: RoundInputs, target_output) -> tuple[Any, Any]:
    """A plain round fed each active slot's last token to the target (at position
    inputs.cache_lengths_N): keep what cannot be recomputed later (e.g. the target's
    hidden state there). Only for drafters that ``catches_up``."""
    return state, kv

  def unseen_tokens(self, state, inputs: RoundInputs) -> Array:
    """Tokens per slot that ``catch_up`` still has to feed (0 for inactive slots)."""
    return jnp.zeros_like(inputs.cache_lengths_N)

  def catch_up(self, params, state, kv, inputs: RoundInputs, max_tokens: int
               ) -> tuple[Any, Any]:
    """Feeds up to ``max_tokens`` of each slot's unseen tokens (all emitted tokens but
    the last, which the next ``start`` feeds)."""
    return state, kv

  def compact_state(self, state, slots_W: Array) -> Any:
    """The state a narrower decode program keeps of the slots ``slots_W`` (slot
    compaction, ``sampling.compaction``). A drafter that keeps per-slot state says how."""
    if jax.tree.leaves(state):
      raise NotImplementedError(
          f"{type(self).__name__} keeps per-slot state but does not implement "
          "compact_state: decode with EngineConfig(compaction=False), or implement it.")
    return state

  def stats(self, state) -> dict[str, float]:
    """Drafter-specific statistics from the final drafter state (host arrays), reported
    by ``generate`` under ``stats["drafter"]`` (e.g. proposals and acceptance per source)."""
    return {}
