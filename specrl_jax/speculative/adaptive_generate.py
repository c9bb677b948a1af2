"""Adaptive speculation's host loop: batches of decode rounds, the chain length (0 =
plain decoding) chosen between them by a DraftLengthController."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import SamplingParams
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.adaptive import DraftLengthController
from specrl_jax.speculative.rollout import Speculation
from specrl_jax.speculative.topology import TreeTopology
from specrl_jax.sampling.layout import Layout
from specrl_jax.sampling.results import GenerateOutput, fetch_results, raise_if_exhausted, to_output
from specrl_jax.sampling.rollout import _continue_and_report, _start, generate_whole


def generate_adaptive(graphdef, params, drafter: Drafter, inputs, rng, *,
                       sampling: SamplingParams, layout: Layout, topology: TreeTopology,
                       draft_mode: str, rounds_per_decision: int,
                       controller: DraftLengthController | None,
                       drafter_params=None) -> GenerateOutput:
  """Decodes in batches of rounds, re-choosing the chain length (0 = plain) between
  batches with a DraftLengthController. The state is built for the longest chain, so
  every length runs on it; each length compiles once.

  When the controller has settled on plain decoding and no probe of a chain is due,
  the whole rollout is plain decoding's own program, without the drafter's state (no
  drafter prefill, no records): it costs what ``generate`` without a drafter costs, and
  reports no ``stats["drafter"]``."""
  longest = topology.depth
  if controller is None:
    controller = DraftLengthController(k_max=longest)
  elif controller.k_max != longest:
    raise ValueError(f"controller.k_max={controller.k_max} differs from the spec's "
                     f"num_draft_tokens={longest}: they must match.")
  first_decision = len(controller.history)
  num_requests = inputs[2].shape[0]
  # What the tail report would say of a fresh state: every slot admitted, full budgets.
  queued = num_requests > layout.num_slots
  plain_measured = 0 in controller.round_seconds
  k = controller.choose(
      None if queued else [sampling.max_new_tokens] * min(layout.num_slots, num_requests))
  if k == 0 and plain_measured:
    return _plain_rollout(graphdef, params, inputs, rng, sampling=sampling, layout=layout,
                          controller=controller, first_decision=first_decision)
  drafter_params = drafter.params() if drafter_params is None else drafter_params
  start = time.perf_counter()
  longest_rounds = Speculation(drafter=drafter, topology=topology, draft_mode=draft_mode)
  state, prompts = _start(graphdef, params, drafter_params, *inputs, rng, sampling=sampling,
                          layout=layout, rounds=longest_rounds)
  # Batches are timed from dispatch to read-back: reading the counters waits for the
  # prefill, so that it does not count in the first.
  counters = jax.device_get(state.counters)
  # A round's drafter first feeds the tokens emitted since it last saw the sequence: up
  # to k + 1 after a round of length k. A drafter that catches up is brought in step at
  # the start of each batch (``catch_up_drafter``), so rounds of length k feed at most
  # k + 1. Others feed up to the longest chain + 1 whatever k is (one program per
  # length, so a rollout never stops to compile for a pair of consecutive lengths),
  # and in plain rounds one token, after a first round that feeds what drafting left.
  catch_up = 1
  longest_pending = (lambda k: k + 1) if drafter.catches_up else (lambda k: longest + 1)
  while True:
    compiled_before = _continue_and_report._cache_size()
    began = time.perf_counter()
    max_rounds = controller.decision_rounds(rounds_per_decision)
    if k == 0 and drafter.stateless:  # nothing to keep in step: a plain decoding step
      calls = [(dict(hook_params=(), rounds=None), max_rounds)]
    else:
      # k = 0 with a drafter that catches up: plain rounds that only ``record``.
      def rounds(max_pending):
        return dict(hook_params=drafter_params, rounds=Speculation(
            drafter=drafter, topology=TreeTopology((1,) * k), draft_mode=draft_mode,
            max_pending=max_pending))
      calls = [(rounds(longest_pending(k) if k else 1), max_rounds)]
      if k == 0 and catch_up > 1 and not drafter.catches_up:
        # Its plain rounds feed it one token each; the first after drafting, more.
        calls = [(rounds(catch_up), 1)] + (
            [(calls[0][0], max_rounds - 1)] if max_rounds > 1 else [])
    for batch, batch_rounds in calls:  # dispatched back to back: no host sync between
      state, report = _continue_and_report(graphdef, params, state=state, prompts=prompts,
                                           max_rounds=jnp.int32(batch_rounds),
                                           sampling=sampling, layout=layout, **batch)
    catch_up = longest + 1 if k else 1
    now, done, (remaining_N, queued) = jax.device_get(report)
    seconds = time.perf_counter() - began
    # A length's first batch includes compiling it: keep its acceptance, not its time.
    compiled = _continue_and_report._cache_size() > compiled_before
    controller.observe(
        k, int(now["target_calls"] - counters["target_calls"]), None if compiled else seconds,
        now["accepted_per_position"] - counters["accepted_per_position"],
        int(now["draft_rounds"] - counters["draft_rounds"]))
    counters = now
    if done:
      break
    # While requests wait, every freed slot is refilled: tokens per second is what
    # counts. Without a queue the batch ends with its slowest sequence.
    k = controller.choose(None if queued else remaining_N.tolist())
  final = fetch_results(state)
  seconds = time.perf_counter() - start
  raise_if_exhausted(final, layout, inputs)
  return _with_schedule(to_output(final, seconds, longest_rounds), controller, first_decision)


def _plain_rollout(graphdef, params, inputs, rng, *, sampling: SamplingParams,
                   layout: Layout, controller: DraftLengthController,
                   first_decision: int) -> GenerateOutput:
  """A rollout the controller decided to decode plainly throughout: one decision."""
  output = generate_whole(graphdef, params, inputs, rng, sampling=sampling, layout=layout)
  # Its time includes the prefill: not a clean per-round time (plain rounds are timed
  # again in the rollouts that probe a chain).
  controller.observe(0, output.stats["target_calls"], None, np.zeros(controller.k_max), 0)
  return _with_schedule(output, controller, first_decision)


def _with_schedule(output: GenerateOutput, controller: DraftLengthController,
                   first_decision: int) -> GenerateOutput:
  """``output`` with the lengths this call's decisions chose and the round times so far."""
  output.stats["draft_length_schedule"] = controller.history[first_decision:]
  output.stats["round_seconds_by_draft_length"] = dict(sorted(controller.round_seconds.items()))
  return output
