"""The round hook: what the decode engine asks of whatever replaces its plain rounds.

``sampling.rollout``'s programs take ``rounds: RoundHook | None`` as a static argument
(None: plain decoding); ``speculative.rollout.Speculation`` is the hook for a drafter.
The engine owns the decode state, the page pool and the loop; a hook adds KV layers
after the target's, its own per-slot state (``DecodeState.drafter``) and counters, and
the round function. Being static, a hook must be hashable and compare by value (a
frozen dataclass): two equal hooks share compiled programs.
"""

from __future__ import annotations

from typing import Protocol

from jax import Array

from specrl_jax.config import SamplingParams
from specrl_jax.kv.paged import PagedKV
from specrl_jax.models.transformer import ForwardOutput, Transformer
from specrl_jax.sampling.decode_loop import RoundFn, RoundMenu
from specrl_jax.sampling.engine import AdmitHook, DecodeState

# The hook's traced pytrees: its weights (``params()``, passed to the programs as
# ``hook_params``) and its per-slot state (leading axis = slots, for compaction).
HookParams = object
HookState = object


class RoundHook(Protocol):
  """The decode engine's round hook (see the module docstring)."""

  @property
  def hidden_layers(self) -> tuple[int, ...]:
    """The target layers whose hidden states the target's forwards return to it."""

  def params(self) -> HookParams:
    """Its weights, the default ``hook_params`` of a program."""

  def kv_layers(self) -> tuple[tuple[int, int], ...]:
    """(kv heads, head dim) of each KV layer it pages after the target's layers."""

  def init_state(self, num_slots: int, counters: dict[str, Array]
                 ) -> tuple[HookState, dict[str, Array]]:
    """Its state for ``num_slots`` slots, and ``counters`` with its own added."""

  def prefill(self, hook_params: HookParams, state: DecodeState, prefill_kv: PagedKV,
              num_layers: int, tokens_UxT: Array, lengths_U: Array,
              target_output: ForwardOutput) -> tuple[DecodeState, PagedKV]:
    """Writes its own pages (layers ``num_layers`` on) and state from the prompts'
    prefill, whose target forward is ``target_output``."""

  def loop(self, model: Transformer, hook_params: HookParams, state: DecodeState,
           sampling: SamplingParams
           ) -> tuple[DecodeState, RoundFn | RoundMenu, AdmitHook | None]:
    """(state brought in step, the round function, the admission hook) of a decode
    loop; the round function emits at least one token per active slot. A hook that
    picks among kinds of round per round returns a ``RoundMenu`` (``decode_loop``)."""

  def compact_state(self, hook_state: HookState, slots_W: Array) -> HookState:
    """Its state of the slots ``slots_W`` that a narrower program keeps."""

  def stats(self, final: DecodeState, *, placement: str | None = None,
            shards: int | None = None) -> dict[str, object]:
    """What the output reports of it; ``final`` stacks ``shards`` batch shards when
    given; placement: how its weights were placed on a mesh."""
