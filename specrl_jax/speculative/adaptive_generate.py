"""Adaptive speculation's host loop: batches of decode rounds, the draft shape (a chain
length, 0 = plain decoding, or a tree of the menu) chosen between them per live width by
a ConcurrencyAwareController; with slot compaction the batch narrows between them."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import SamplingParams
from specrl_jax.sampling.compaction import compaction_stats
from specrl_jax.sampling.layout import Layout
from specrl_jax.sampling.results import GenerateOutput, fetch_results, raise_if_exhausted, to_output
from specrl_jax.sampling.programs import programs_compiled
from specrl_jax.sampling.rollout import (
    compact_slots, continue_stage, generate_whole, start, widths_of,
)
from specrl_jax.speculative.adaptive import DraftLengthController
from specrl_jax.speculative.concurrency import ConcurrencyAwareController, Shape
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.rollout import Speculation
from specrl_jax.speculative.topology import TreeTopology


def adaptive_controller(controller, k_max: int, trees: tuple = ()
                        ) -> ConcurrencyAwareController:
  """The controller ``generate`` runs: a fresh concurrency-aware one, the one given, or
  one that wraps a given ``DraftLengthController`` for every width."""
  if controller is None:
    return ConcurrencyAwareController(k_max=k_max, trees=trees)
  if isinstance(controller, DraftLengthController):
    controller = ConcurrencyAwareController(k_max=controller.k_max, trees=trees,
                                            chains=controller, per_width=False)
  if controller.k_max != k_max:
    raise ValueError(f"controller.k_max={controller.k_max} differs from the spec's "
                     f"num_draft_tokens={k_max}: they must match.")
  if controller.trees != trees:
    raise ValueError(f"controller.trees={controller.trees} differ from the spec's "
                     f"adaptive_trees={trees}: they must match.")
  return controller


def generate_adaptive(graphdef, params, drafter: Drafter, inputs, rng, *,
                       sampling: SamplingParams, layout: Layout, topology: TreeTopology,
                       draft_mode: str, rounds_per_decision: int,
                       controller: ConcurrencyAwareController,
                       drafter_params=None) -> GenerateOutput:
  """Decodes in batches of rounds, re-choosing the draft shape for the live width
  between batches. The state is built for the longest chain, so every chain and every
  tree no deeper runs on it; each (shape, width) compiles once. With compaction
  (``layout.compaction_min_width``) a batch also ends once the live sequences fit the
  next width, and the state is narrowed to the narrowest width that holds them.

  Without compaction, when the controller has settled on plain decoding and no probe of
  a chain is due, the whole rollout is plain decoding's own program, without the
  drafter's state (no drafter prefill, no records): it costs what ``generate`` without a
  drafter costs, and reports no ``stats["drafter"]``."""
  longest = topology.depth
  widths = widths_of(layout)
  first_decision = len(controller.history)
  num_requests = inputs[2].shape[0]
  stage = _stage_holding(widths, 0, num_requests)
  # What the tail report would say of a fresh state: every slot admitted, full budgets.
  queued = num_requests > widths[stage]
  plain_measured = 0 in controller.chains_at(widths[stage]).round_seconds
  shape = controller.choose(
      widths[stage],
      None if queued else [sampling.max_new_tokens] * min(widths[stage], num_requests))
  if shape == 0 and plain_measured and len(widths) == 1:
    return _plain_rollout(graphdef, params, inputs, rng, sampling=sampling, layout=layout,
                          controller=controller, first_decision=first_decision)
  drafter_params = drafter.params() if drafter_params is None else drafter_params
  began_rollout = time.perf_counter()
  longest_rounds = Speculation(drafter=drafter, topology=topology, draft_mode=draft_mode)
  state, prompts = start(graphdef, params, drafter_params, inputs, rng, sampling=sampling,
                         layout=layout, rounds=longest_rounds)
  if stage:
    state = compact_slots(state, widths[stage], longest_rounds)
  # Batches are timed from dispatch to read-back: reading the counters waits for the
  # prefill, so that it does not count in the first.
  counters = jax.device_get(state.counters)
  seconds_by_width = [0.0] * len(widths)
  # A round's drafter first feeds the tokens emitted since it last saw the sequence: up
  # to depth + 1 after a round of that depth. A drafter that catches up is brought in
  # step at the start of each batch (``catch_up_drafter``), so rounds of depth d feed at
  # most d + 1. Others feed up to the longest chain + 1 whatever the shape (one program
  # per shape, so a rollout never stops to compile for a pair of consecutive shapes),
  # and in plain rounds one token, after a first round that feeds what drafting left.
  catch_up = 1
  longest_pending = (lambda d: d + 1) if drafter.catches_up else (lambda d: longest + 1)
  while True:
    width = widths[stage]
    depth = len(shape) if isinstance(shape, tuple) else shape
    compiled_before = programs_compiled()
    began = time.perf_counter()
    max_rounds = controller.decision_rounds(width, rounds_per_decision)
    if depth == 0 and drafter.stateless:  # nothing to keep in step: a plain decoding step
      calls = [(dict(hook_params=(), rounds=None), max_rounds)]
    else:
      # Depth 0 with a drafter that catches up: plain rounds that only ``record``.
      def rounds(max_pending):
        return dict(hook_params=drafter_params, rounds=Speculation(
            drafter=drafter, topology=_topology(shape), draft_mode=draft_mode,
            max_pending=max_pending))
      calls = [(rounds(longest_pending(depth) if depth else 1), max_rounds)]
      if depth == 0 and catch_up > 1 and not drafter.catches_up:
        # Its plain rounds feed it one token each; the first after drafting, more.
        calls = [(rounds(catch_up), 1)] + (
            [(calls[0][0], max_rounds - 1)] if max_rounds > 1 else [])
    for batch, batch_rounds in calls:  # dispatched back to back: no host sync between
      state, report = continue_stage(graphdef, params, batch["hook_params"], state, prompts,
                                     jnp.int32(batch_rounds), stage=stage,
                                     sampling=sampling, layout=layout,
                                     rounds=batch["rounds"])
    catch_up = longest + 1 if depth else 1
    now, done, (remaining_N, queued), live = jax.device_get(report)
    seconds = time.perf_counter() - began
    seconds_by_width[stage] += seconds
    # A shape's first batch at a width includes compiling it: keep its acceptance, not
    # its time.
    compiled = programs_compiled() > compiled_before
    controller.observe(
        width, shape, int(now["target_calls"] - counters["target_calls"]),
        None if compiled else seconds,
        now["accepted_per_position"] - counters["accepted_per_position"],
        int(now["draft_rounds"] - counters["draft_rounds"]))
    counters = now
    if done:
      break
    narrower = _stage_holding(widths, stage, int(live))
    if narrower != stage:
      stage = narrower
      state = compact_slots(state, widths[stage], longest_rounds)
      remaining_N = np.sort(remaining_N)[::-1][:widths[stage]]
    # While requests wait, every freed slot is refilled: tokens per second is what
    # counts. Without a queue the batch ends with its slowest sequence.
    shape = controller.choose(widths[stage], None if queued else remaining_N.tolist())
  final = fetch_results(state)
  seconds = time.perf_counter() - began_rollout
  raise_if_exhausted(final, layout, inputs)
  output = to_output(final, seconds, longest_rounds)
  if len(widths) > 1:
    output.stats["compaction"] = compaction_stats(final.counters, widths, seconds_by_width)
  return _with_schedule(output, controller, first_decision)


def _topology(shape: Shape) -> TreeTopology:
  return TreeTopology(shape if isinstance(shape, tuple) else (1,) * shape)


def _stage_holding(widths: tuple[int, ...], stage: int, live: int) -> int:
  """The last stage from ``stage`` on whose width still holds ``live`` sequences."""
  while stage + 1 < len(widths) and live <= widths[stage + 1]:
    stage += 1
  return stage


def _plain_rollout(graphdef, params, inputs, rng, *, sampling: SamplingParams,
                   layout: Layout, controller: ConcurrencyAwareController,
                   first_decision: int) -> GenerateOutput:
  """A rollout the controller decided to decode plainly throughout: one decision."""
  output = generate_whole(graphdef, params, inputs, rng, sampling=sampling, layout=layout)
  # Its time includes the prefill: not a clean per-round time (plain rounds are timed
  # again in the rollouts that probe a chain).
  controller.observe(layout.num_slots, 0, output.stats["target_calls"], None,
                     np.zeros(controller.k_max), 0)
  return _with_schedule(output, controller, first_decision)


def _with_schedule(output: GenerateOutput, controller: ConcurrencyAwareController,
                   first_decision: int) -> GenerateOutput:
  """``output`` with the shapes this call's decisions chose, per width, and the round
  times measured so far."""
  decisions = controller.history[first_decision:]
  output.stats["draft_length_schedule"] = [(shape, rounds) for _, shape, rounds in decisions]
  output.stats["draft_schedule_by_width"] = controller.schedule_by_width(first_decision)
  widest = controller.chains_at(max(width for width, _, _ in decisions))
  output.stats["round_seconds_by_draft_length"] = dict(sorted(widest.round_seconds.items()))
  output.stats["round_seconds_by_width"] = controller.round_seconds()
  return output
