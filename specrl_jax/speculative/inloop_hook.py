"""The in-loop controller's round hook (``sampling.hooks``): the decode loop runs the
shape ``speculative.inloop.choose`` picks per round, from one decode state built for the
longest chain, as a ``sampling.decode_loop.RoundMenu`` (plain decoding as a ``Streak``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import SamplingParams
from specrl_jax.kv.paged import page_size_of
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.decode_loop import RoundMenu, Streak
from specrl_jax.sampling.engine import DecodeState
from specrl_jax.sampling.plain import plain_round
from specrl_jax.speculative.catch_up import catch_up_drafter
from specrl_jax.speculative.concurrency import Shape
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.inloop import (InLoopConfig, InLoopState, choose, observe,
                                           plain_streak, settle_plain)
from specrl_jax.speculative.round import speculative_round
from specrl_jax.speculative.rollout import Speculation, idle_round
from specrl_jax.speculative.topology import TreeTopology

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class InLoopSpeculation:
  """The engine's round hook that picks the shape per round (``sampling.rollout``).

  Its traced params are ``(drafter params, InLoopState)``; the controller state rides
  in the decode state beside the drafter's (``DecodeState.drafter = (drafter state,
  InLoopState)``), so it survives the stages of slot compaction. widths: the stage
  widths of the layout (the width index of a round is its program's slot count).
  """
  drafter: Drafter
  config: InLoopConfig
  draft_mode: str
  widths: tuple[int, ...]

  @property
  def longest(self) -> Speculation:
    return Speculation(drafter=self.drafter, topology=TreeTopology((1,) * self.config.k_max),
                       draft_mode=self.draft_mode, max_pending=self.config.k_max + 1)

  @property
  def hidden_layers(self) -> tuple[int, ...]:
    return self.drafter.hidden_layers

  def params(self) -> Any:
    # No default: a controller without measured round costs would choose on made-up ones.
    raise ValueError("InLoopSpeculation has no default hook_params: pass "
                     "hook_params=(drafter params, InLoopState) with measured round costs.")

  def kv_layers(self) -> tuple:
    return self.drafter.kv_layers()

  def init_state(self, num_slots: int, counters: dict) -> tuple[Any, dict]:
    drafter_state, counters = self.longest.init_state(num_slots, counters)
    # A placeholder of the right shapes: ``prefill`` puts in the carried state.
    cost = np.ones((len(self.config.shapes), len(self.widths)), np.float32)
    return (drafter_state, InLoopState.initial(self.config, cost)), counters

  def prefill(self, params, state: DecodeState, prefill_kv, num_layers: int, tokens_UxT,
              lengths_U, target_output) -> tuple[DecodeState, Any]:
    drafter_params, controller = params
    inner, prefill_kv = self.longest.prefill(
        drafter_params, state.replace(drafter=state.drafter[0]), prefill_kv, num_layers,
        tokens_UxT, lengths_U, target_output)
    return state.replace(drafter=(inner.drafter, controller)), prefill_kv

  def compact_state(self, hook_state, slots_W):
    drafter_state, controller = hook_state
    return self.drafter.compact_state(drafter_state, slots_W), controller

  def loop(self, model: Transformer, params, state: DecodeState, sampling: SamplingParams):
    drafter_params = params[0]
    page_size = page_size_of(state.kv.k_pages[0])

    def on_admit(s, admit_N, prompt_N, prompts):
      drafter_state, controller = s.drafter
      lengths_N = prompts.lengths_U[prompt_N]
      if self.drafter.catches_up:  # its cache holds the prompt's full pages (``_menu``)
        lengths_N = lengths_N - lengths_N % page_size
      drafter_state = self.drafter.on_admit(drafter_params, drafter_state, admit_N, lengths_N)
      return s.replace(drafter=(drafter_state, controller))

    return state, self._menu(model, drafter_params, sampling, state.num_slots), on_admit

  def _menu(self, model: Transformer, drafter_params, sampling: SamplingParams,
            num_slots: int) -> RoundMenu:
    config, width = self.config, self.widths.index(num_slots)

    def round_of(index: int, shape: Shape):
      branch = self._branch(model, drafter_params, shape, sampling)

      def round_fn(s: DecodeState) -> DecodeState:
        drafter_state, controller = s.drafter
        # The loop runs this kind only while it is the one chosen: this commits the
        # choice (and the re-try schedule it advances).
        _, explores, controller = choose(config, controller, width)
        before = s.counters
        s = branch(s.replace(drafter=drafter_state))
        accepted_Z = s.counters["accepted_per_position"] - before["accepted_per_position"]
        drafting = s.counters["draft_rounds"] - before["draft_rounds"]
        controller = observe(config, controller, width, jnp.int32(index), explores, accepted_Z,
                             drafting)
        return s.replace(drafter=(s.drafter, controller))
      return round_fn

    plain = self._branch(model, drafter_params, 0, sampling)

    def plain_round_fn(s: DecodeState) -> DecodeState:  # its bookkeeping: the streak's
      drafter_state, controller = s.drafter
      s = plain(s.replace(drafter=drafter_state))
      return s.replace(drafter=(s.drafter, controller))

    # Plain decoding (shape 0) runs as a streak: asking the rule before each plain round
    # cost the tiny preset 15% of plain decoding's speed.
    streak = Streak(
        length=lambda s: plain_streak(config, s.drafter[1], width),
        settle=lambda s, rounds: s.replace(drafter=(s.drafter[0], settle_plain(
            config, s.drafter[1], width, rounds))))
    drafting = tuple(round_of(i, shape) for i, shape in enumerate(config.shapes) if i > 0)
    # A drafter that catches up before it drafts re-feeds the prompt's partly filled last
    # page then, so admission copies that page for the target's layers only: the copy of
    # the drafter's own layers cost the tiny preset's plain rounds about 1% (two gathers
    # and two scatters a round, for the rare round that admits).
    tail_layers = model.config.num_layers if self.drafter.catches_up else None
    return RoundMenu(rounds=(plain_round_fn,) + drafting,
                     choose=lambda s: choose(config, s.drafter[1], width)[0],
                     streaks=(streak,) + (None,) * len(drafting), tail_layers=tail_layers)

  def _branch(self, model: Transformer, drafter_params, shape: Shape,
              sampling: SamplingParams):
    """The round of one menu shape on a state whose ``drafter`` is the drafter's own."""
    drafter, pending = self.drafter, self.config.k_max + 1
    topology = TreeTopology(shape if isinstance(shape, tuple) else (1,) * shape)
    if topology.depth == 0 and drafter.stateless:
      return lambda s: plain_round(model, s, sampling)
    if topology.depth == 0 and drafter.catches_up:
      return lambda s: idle_round(model, drafter, drafter_params, s, sampling)

    def round_fn(s: DecodeState) -> DecodeState:
      if drafter.catches_up:
        s = catch_up_drafter(drafter, drafter_params, s, model.config.num_layers,
                             max_pending=pending)
      return speculative_round(model, drafter, drafter_params, s, sampling, topology,
                               self.draft_mode, pending)
    return round_fn

  def stats(self, final: DecodeState, *, placement: str | None = None,
            shards: int | None = None) -> dict[str, Any]:
    inner = final.replace(drafter=final.drafter[0])
    stats = self.longest.stats(inner, placement=placement, shards=shards)
    controller = final.drafter[1]
    if shards is None:
      stats["draft_schedule_by_width"] = schedule_by_width(self.config, self.widths,
                                                           controller.rounds_SxW)
      stats["controller"] = controller
    return stats


def schedule_by_width(config: InLoopConfig, widths: tuple[int, ...], rounds_SxW
                      ) -> dict[int, dict[str, int]]:
  """Rounds per width and shape label (host numbers), widest first."""
  rounds_SxW = np.asarray(rounds_SxW)
  return {int(w): {label: int(rounds_SxW[s, i]) for s, label in enumerate(config.labels)
                   if rounds_SxW[s, i]} for i, w in enumerate(widths)}
