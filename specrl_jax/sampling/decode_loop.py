"""The decode loop: release finished sequences, admit waiting requests, run a round,
until every request has finished; and its variant for a menu of round kinds.

A round hook that chooses among several kinds of round on one decode state (the
in-loop draft-shape controller) hands the loop a ``RoundMenu`` rather than one round
function that switches inside. A ``lax.switch`` per round whose branches write the KV
pages copies the whole page pool on every round (XLA gives a conditional's result a
buffer apart from its operand): on the 38M pair that cost a k = 3 round 12-14% over
the fixed k = 3 program. With a menu the loop switches once per run of rounds of one
kind, each run its own inner loop that updates the pages in place, so the pool is
copied only when the kind changes.

A kind whose rounds change nothing the rule reads but its own schedule (plain decoding
beside a drafter: no acceptance to count) can run as a ``Streak``: the rule says once how
many rounds of it follow and settles their bookkeeping after the run, instead of being
asked before every round. On the tiny preset the per-round asking cost 17 us of a 112 us
plain round (some 30 small ops, and XLA:CPU pays each op's dispatch).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import Array

from specrl_jax.config import SamplingParams
from specrl_jax.sampling.engine import (AdmitHook, DecodeState, Prompts, admit, count_requests,
                                        is_done, live_sequences, release_finished)

RoundFn = Callable[[DecodeState], DecodeState]


@dataclasses.dataclass(frozen=True)
class Streak:
  """A kind's rounds run back to back without asking ``RoundMenu.choose``.

  length(state) -> int32 >= 1: at the start of a run (the kind just chosen), how many
    rounds in a row the rule would choose it;
  settle(state, rounds) -> state: after the run, the rule's bookkeeping of the ``rounds``
    that ran (fewer than ``length`` when the decode ended or the stage narrowed), as if
    it had been asked before each of them. Its round function does none of it.
  """
  length: Callable[[DecodeState], Array]
  settle: Callable[[DecodeState, Array], DecodeState]


@dataclasses.dataclass(frozen=True)
class RoundMenu:
  """Round functions of several kinds and the rule that picks the next one.

  choose(state) -> int32 index into ``rounds``: a pure function of the state (called
  before each round to decide whether the current run of rounds goes on, so the same
  state must give the same index); the chosen round itself commits whatever the choice
  advances (e.g. an exploration schedule). streaks: per kind, None (the rule is asked
  before each of its rounds) or a ``Streak``; empty: None for every kind. tail_layers:
  the KV layers admission gives a private copy of the prompt's last page
  (``engine.admit``; None: all).
  """
  rounds: tuple[RoundFn, ...]
  choose: Callable[[DecodeState], Array]
  streaks: tuple[Streak | None, ...] = ()
  tail_layers: int | None = None


def run_loop(state: DecodeState, prompts: Prompts, round_fn: RoundFn | RoundMenu,
             sampling: SamplingParams, *, continuous: bool,
             on_admit: AdmitHook | None = None, max_rounds: int | Array | None = None,
             until_live: int | None = None) -> DecodeState:
  """Decodes until every request has finished or the page pool ran out (or after
  ``max_rounds`` rounds, or once at most ``until_live`` sequences are decoding or
  waiting: slot compaction then narrows the batch)."""
  num_requests = count_requests(prompts)

  def pending(state):
    busy = ~is_done(state, num_requests)
    if until_live is None:
      return busy
    return busy & (live_sequences(state, num_requests) > until_live)

  # No lax.cond around these steps: a cond's untaken identity branch copies its whole
  # operand, i.e. every KV page, on each iteration. Each step is a no-op when its masks
  # are empty, which is cheap.
  tail_layers = round_fn.tail_layers if isinstance(round_fn, RoundMenu) else None

  def body_of(round_fn: RoundFn) -> Callable:
    def body(carry):
      rounds, state = carry
      state = release_finished(state)
      state = admit(state, prompts, sampling, continuous=continuous, on_admit=on_admit,
                    tail_layers=tail_layers)
      state = count_request_rounds(round_fn(state), state.active_N, state.slot_request_N)
      return rounds + 1, state
    return body

  def going(carry):
    rounds, state = carry
    return pending(state) if max_rounds is None else (rounds < max_rounds) & pending(state)

  carry = (jnp.int32(0), state)
  if isinstance(round_fn, RoundMenu):
    menu = round_fn

    def run_of(index: int, round_fn: RoundFn) -> Callable:
      # Rounds of this kind while the menu keeps choosing it.
      return lambda carry: jax.lax.while_loop(
          lambda c: going(c) & (menu.choose(c[1]) == index), body_of(round_fn), carry)

    def streak_of(streak: Streak, round_fn: RoundFn) -> Callable:
      def run(carry):
        first, length = carry[0], streak.length(carry[1])
        rounds, state = jax.lax.while_loop(lambda c: going(c) & (c[0] - first < length),
                                           body_of(round_fn), carry)
        return rounds, streak.settle(state, rounds - first)
      return run

    streaks = menu.streaks or (None,) * len(menu.rounds)
    runs = [run_of(index, r) if streaks[index] is None else streak_of(streaks[index], r)
            for index, r in enumerate(menu.rounds)]
    carry = jax.lax.while_loop(going, lambda c: jax.lax.switch(menu.choose(c[1]), runs, c),
                               carry)
  else:
    carry = jax.lax.while_loop(going, body_of(round_fn), carry)
  # The loop stops as soon as the last sequence ends, before the body that would
  # release it (and run a round with no active slot).
  return release_finished(carry[1])


def count_request_rounds(state: DecodeState, active_N: Array, request_N: Array) -> DecodeState:
  """Adds the round just run to the count of each request that decoded in it: a batch
  runs until its slowest request ends, so per-request rounds say which ones set the
  pace (e.g. prompts a drafter predicts badly)."""
  rounds_R = state.counters["request_rounds_R"]
  rows_N = jnp.where(active_N, request_N, rounds_R.shape[0])
  # And the round to the count of rounds with that many live slots (the tail's shape).
  by_live = state.counters["rounds_by_live"]
  counters = dict(state.counters, request_rounds_R=rounds_R.at[rows_N].add(1, mode="drop"),
                  rounds_by_live=by_live.at[jnp.sum(active_N)].add(1, mode="drop"))
  return state.replace(counters=counters)
