"""Slot compaction: a long-tailed rollout continues its last live sequences in
narrower compiled programs.

A batch of N slots runs until its slowest response ends, and with long-tailed response
lengths most of its rounds have few live sequences: each round still costs an N-wide
forward. With compaction the decode loop runs in *stages* of power-of-two widths
(N, then the powers of two below it down to a minimum): a stage decodes until the live
sequences, counting the requests still waiting for a slot, fit the next width; then the
occupied slots' rows (page-table rows, per-slot state, the round hook's per-slot state)
are gathered into a state of that width. Pages are never copied: the page pool and the
KV pages stay as they are, only the tables pointing into them move. Waiting requests
are counted as live, so while they wait the batch stays wide enough to admit them all.

A request's tokens depend on its slot only through the random draws (indexed by slot
first), so greedy outputs are identical with and without compaction and sampled ones
have the same distribution.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from specrl_jax.sampling.engine import DecodeState
from specrl_jax.sampling.hooks import RoundHook

Array = jax.Array


def stage_widths(num_slots: int, min_width: int) -> tuple[int, ...]:
  """The widths a rollout of ``num_slots`` slots decodes in, widest first: num_slots,
  then every power of two below it down to ``min_width`` (0: no compaction)."""
  if not min_width:
    return (num_slots,)
  widths = [num_slots]
  width = 1 << (num_slots - 1).bit_length() >> 1  # the largest power of two < num_slots
  while width >= min_width and width >= 1:
    widths.append(width)
    width //= 2
  return tuple(widths)


def compact(state: DecodeState, width: int, hook: RoundHook | None = None) -> DecodeState:
  """The state narrowed to ``width`` slots: the occupied slots first (in slot order),
  then free ones. Call it on a state whose finished slots were released and whose
  occupied slots fit ``width``; free slots hold no pages, so none is lost. hook: the
  round hook, whose ``compact_state(hook_state, slots_W)`` narrows its own state."""
  occupied_N = state.slot_request_N >= 0
  slots_W = jnp.argsort(~occupied_N, stable=True)[:width]
  take = lambda x: x[slots_W]
  kv = state.kv.replace(page_table_BxM=take(state.kv.page_table_BxM),
                        prefix_lengths_B=take(state.kv.prefix_lengths_B),
                        new_mask_BxTxT=take(state.kv.new_mask_BxTxT),
                        write_positions_BxT=take(state.kv.write_positions_BxT))
  drafter = state.drafter if hook is None else hook.compact_state(state.drafter, slots_W)
  return state.replace(
      kv=kv, num_pages_N=take(state.num_pages_N), cache_lengths_N=take(state.cache_lengths_N),
      last_token_N=take(state.last_token_N), slot_request_N=take(state.slot_request_N),
      generated_N=take(state.generated_N), finished_N=take(state.finished_N),
      history_request_N=take(state.history_request_N),
      drafter=drafter)


def gather_slots(tree: Any, slots_W: Array) -> Any:
  """Every leaf of a per-slot pytree (leading axis = slots) at ``slots_W``."""
  return jax.tree.map(lambda x: x[slots_W], tree)


def compaction_stats(counters: dict, widths: tuple[int, ...],
                     seconds_by_width: list[float] | None = None) -> dict[str, Any]:
  """What a rollout reports of its widths: rounds (target forwards) and tokens emitted
  per compiled width, and, when stages were timed, seconds per width and
  the share of decode time spent below the full width (the tail's share)."""
  rounds = [int(r) for r in counters["rounds_by_width"]]
  stats: dict[str, Any] = {
      "widths": list(widths), "rounds_by_width": rounds,
      "tokens_by_width": [int(t) for t in counters["tokens_by_width"]],
      "tail_round_share": sum(rounds[1:]) / sum(rounds) if sum(rounds) else 0.0}
  if seconds_by_width is not None:
    total = sum(seconds_by_width)
    stats["seconds_by_width"] = list(seconds_by_width)
    stats["tail_time_share"] = sum(seconds_by_width[1:]) / total if total > 0 else 0.0
  return stats
