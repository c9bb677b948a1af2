"""Rollout time: a fluid continuous-batching simulation per inference instance, over
the per-forward roofline of ``roofline.py``.

Between events (a sequence finishing, the KV cache filling) nothing changes but the
context, which grows by a fixed amount per round, so each stretch of rounds costs a
closed-form sum (``LinearCost.sum_over``) and a rollout of thousands of sequences and
tens of thousands of rounds costs a few hundred events. With speculation, sequences
advance fluidly by the expected tokens per round (``SpeculationSpec``).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from specrl_jax.config import ConfigError, check, check_positive_int
from specrl_jax.sim import validation
from specrl_jax.sim.hardware import HardwareProfile
from specrl_jax.sim.layout import ParallelLayout
from specrl_jax.sim.lengths import LengthDistribution
from specrl_jax.sim.model_spec import DrafterSpec, ModelSpec
from specrl_jax.sim.roofline import EngineProfile, ForwardCostModel, SpeculationSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutWorkload:
  """One RL step's generation: ``num_sequences`` responses (prompts x samples per
  prompt) to prompts of ``prompt_length`` tokens, spread over the rollout instances."""

  num_sequences: int
  prompt_length: int
  lengths: LengthDistribution
  batching: str = "continuous"

  def __post_init__(self):
    owner = "RolloutWorkload"
    check_positive_int(owner, "num_sequences", self.num_sequences)
    check_positive_int(owner, "prompt_length", self.prompt_length)
    check(hasattr(self.lengths, "sample") and hasattr(self.lengths, "max_length"), owner,
          "lengths", self.lengths, "a FixedLengths, LogNormalLengths or HistogramLengths")
    validation.one_of(owner, "batching", self.batching, ("continuous", "static"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutResult:
  seconds: float  # wall time of the slowest instance, per RL step's batch
  decode_seconds: float
  prefill_seconds: float
  rounds: int  # decode rounds (target forwards) of the slowest instance
  tokens_per_round: float  # per sequence, in expectation
  instance_sequences: int
  instance_generated_tokens: int
  mean_live_batch: float  # round-weighted
  kv_capacity_tokens: int
  preemptions: int

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def kv_capacity_tokens(target: ModelSpec, drafter: DrafterSpec | None, *,
                       hardware: HardwareProfile, engine: EngineProfile, tp: int) -> int:
  """Tokens of KV cache one instance holds once weights are loaded."""
  budget = tp * hardware.hbm_capacity * engine.memory_utilization
  weights = target.total_params * engine.bytes_per_param
  per_token = target.kv_bytes_per_token(engine.kv_bytes_per_element)
  if drafter is not None and drafter.step_network is not None:
    weights += drafter.params * engine.bytes_per_param
    per_token += drafter.step_network.kv_bytes_per_token(engine.kv_bytes_per_element)
  free = budget - weights
  if free < per_token:
    raise ConfigError(
        f"{target.name} ({weights / 1e9:.1f} GB of weights at {engine.weight_precision}) "
        f"does not fit in {budget / 1e9:.1f} GB usable on {tp} x {hardware.name}: "
        "raise rollout_tp or memory_utilization.")
  return int(free // per_token)


def _instance_lengths(workload: RolloutWorkload, instances: int, batches: int) -> np.ndarray:
  """Response lengths of the instance that gets the longest response.

  The step's sample is sorted and dealt round-robin over instances; the first hand
  holds the longest of every stride, so it is the slowest instance. Its queue order
  is a fixed shuffle: the engine does not know lengths in advance.
  """
  total = workload.num_sequences * batches
  lengths = np.sort(workload.lengths.sample(total))[::-1]
  mine = lengths[0::instances]
  return np.random.default_rng(0).permutation(mine)


def simulate_rollout(*, target: ModelSpec, hardware: HardwareProfile,
                     engine: EngineProfile, layout: ParallelLayout,
                     workload: RolloutWorkload,
                     speculation: SpeculationSpec | None = None,
                     batches_in_flight: int = 1) -> RolloutResult:
  """Wall time to generate one step's responses on the rollout pool.

  ``batches_in_flight`` > 1 streams that many steps' batches back to back through the
  engines (async RL with policy lag lets the next batch start while the last one's
  stragglers finish) and reports the time per batch.
  """
  check_positive_int("simulate_rollout", "batches_in_flight", batches_in_flight)
  check(workload.num_sequences * batches_in_flight >= layout.rollout_instances,
        "RolloutWorkload", "num_sequences", workload.num_sequences,
        f">= rollout instances ({layout.rollout_instances}) so every instance has work")
  cost_model = ForwardCostModel(hardware=hardware, engine=engine, tp=layout.rollout_tp,
                                ep=layout.rollout_ep)
  drafter = speculation.drafter if speculation is not None else None
  capacity = kv_capacity_tokens(target, drafter, hardware=hardware, engine=engine,
                                tp=layout.rollout_tp)
  check(capacity >= workload.prompt_length + workload.lengths.max_length,
        "RolloutWorkload", "lengths.max_length", workload.lengths.max_length,
        f"<= KV capacity of one instance minus the prompt ({capacity} tokens)")
  lengths = _instance_lengths(workload, layout.rollout_instances, batches_in_flight)
  per_round = 1.0 if speculation is None else speculation.tokens_per_round
  if workload.batching == "static":
    totals = _static_batching(target, cost_model, speculation, lengths, workload,
                              capacity, per_round)
  else:
    totals = _continuous_batching(target, cost_model, speculation, lengths, workload,
                                  capacity, per_round)
  decode, prefill, rounds, weighted_batch, preemptions = totals
  return RolloutResult(
      seconds=(decode + prefill) / batches_in_flight,
      decode_seconds=decode / batches_in_flight,
      prefill_seconds=prefill / batches_in_flight,
      rounds=rounds, tokens_per_round=per_round, instance_sequences=int(lengths.size),
      instance_generated_tokens=int(lengths.sum()),
      mean_live_batch=weighted_batch / max(rounds, 1), kv_capacity_tokens=capacity,
      preemptions=preemptions)


def _round_cost(target, cost_model, speculation, cache, num_seqs):
  if num_seqs not in cache:
    cache[num_seqs] = cost_model.decode_round(target, speculation, num_seqs=num_seqs)
  return cache[num_seqs]


def _static_batching(target, cost_model, speculation, lengths, workload, capacity,
                     per_round):
  """Fixed batches run to their longest response; finished rows stay as padding."""
  prompt = workload.prompt_length
  batch = max(1, min(cost_model.engine.max_num_seqs,
                     capacity // (prompt + workload.lengths.max_length)))
  drafter = speculation.drafter if speculation is not None else None
  decode = prefill = weighted = 0.0
  rounds = 0
  cache: dict = {}
  for start in range(0, lengths.size, batch):
    chunk = lengths[start:start + batch]
    n = int(math.ceil(chunk.max() / per_round))
    prefill += cost_model.prefill(target, num_seqs=chunk.size, prompt_tokens=prompt,
                                  drafter=drafter)
    for cost in _round_cost(target, cost_model, speculation, cache, chunk.size):
      decode += cost.sum_over(chunk.size * prompt, chunk.size * per_round, n)
    rounds += n
    weighted += n * chunk.size
  return decode, prefill, rounds, weighted, 0


# Admission keeps this share of the KV cache free so a newly admitted batch can grow
# for a while before the engine has to preempt (vLLM's watermark plays this role).
_ADMISSION_HEADROOM = 0.05


def _continuous_batching(target, cost_model, speculation, lengths, workload, capacity,
                         per_round):
  """Fluid continuous batching with KV-capacity admission and recompute preemption.

  Sequences join while the engine has a free slot and the KV cache has room for their
  context; when the growing cache overflows, the newest sequences are preempted and
  later re-prefilled with everything they had generated (vLLM's recompute policy).
  """
  engine = cost_model.engine
  prompt = workload.prompt_length
  drafter = speculation.drafter if speculation is not None else None
  admit_limit = (1 - _ADMISSION_HEADROOM) * capacity
  # Waiting queue entries: (remaining tokens, context tokens).
  waiting = collections.deque((float(n), float(prompt)) for n in lengths)
  remaining = np.zeros((0,))
  context = np.zeros((0,))
  decode = prefill = weighted = 0.0
  rounds = preemptions = 0
  cache: dict = {}
  while waiting or remaining.size:
    admitted_remaining, admitted_context = [], []
    used = float(context.sum())
    while (waiting and remaining.size + len(admitted_remaining) < engine.max_num_seqs
           and (used + waiting[0][1] <= admit_limit
                or remaining.size + len(admitted_remaining) == 0)):
      r, c = waiting.popleft()
      admitted_remaining.append(r)
      admitted_context.append(c)
      used += c
    if admitted_remaining:
      new_context = np.array(admitted_context)
      # Fresh prompts prefill together; recomputed sequences prefill their history.
      for ctx in np.unique(new_context):
        prefill += cost_model.prefill(target, num_seqs=int((new_context == ctx).sum()),
                                      prompt_tokens=float(ctx), drafter=drafter)
      remaining = np.concatenate([remaining, admitted_remaining])
      context = np.concatenate([context, new_context])
    live = remaining.size
    growth = live * per_round
    to_finish = int(max(1, math.ceil(float(remaining.min()) / per_round - 1e-9)))
    room = capacity - used
    to_full = int(room // growth) if room > 0 else 0
    n = max(1, min(to_finish, to_full)) if to_full > 0 else 1
    for cost in _round_cost(target, cost_model, speculation, cache, live):
      decode += cost.sum_over(used, growth, n)
    rounds += n
    weighted += n * live
    remaining = remaining - n * per_round
    context = context + n * per_round
    done = remaining <= 1e-9
    remaining, context = remaining[~done], context[~done]
    # Preempt the newest sequences until the cache fits again.
    while remaining.size > 1 and context.sum() > capacity:
      waiting.appendleft((float(remaining[-1]), float(context[-1])))
      remaining, context = remaining[:-1], context[:-1]
      preemptions += 1
  return decode, prefill, rounds, weighted, preemptions
