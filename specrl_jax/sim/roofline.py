"""Rollout time per forward: a roofline for one forward of a network on one inference
instance, and the speculation spec that turns a decode step into a round.

One forward over ``num_seqs`` sequences with ``q`` new tokens each costs

  overhead + max(compute, memory) + collectives + sampling

with compute = (2 * active params * tokens + attention FLOPs) / achieved FLOP/s and
memory = (weights read + KV read) / achieved bandwidth. Both terms are linear in the
total context of the live batch, so the cost of n consecutive decode rounds while the
context grows by a fixed amount per round is a sum of max-of-two-lines, computed in
closed form (``LinearCost.sum_over``); ``rollout.py`` runs the batching over it.

Speculation replaces a decode step by a round: ``depth`` drafter steps, one verify
forward over 1 + draft tokens per sequence, and on average ``tokens_per_round``
emitted tokens (``SpeculationSpec``).
"""

from __future__ import annotations

import dataclasses
import math

from specrl_jax.config import check, check_finite_number, check_positive_int
from specrl_jax.sim import validation
from specrl_jax.sim.hardware import HardwareProfile
from specrl_jax.sim.model_spec import DrafterSpec, ModelSpec
from specrl_jax.speculative.expected import expected_tokens_per_round

_BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0}
# Bytes touched per logit by the sampler: write fp32 logits, read them for the softmax
# and normaliser, read once more to sample or to verify.
_SAMPLER_BYTES_PER_LOGIT = 12.0
_ACTIVATION_BYTES = 2.0  # bf16 activations in collectives


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineProfile:
  """What the inference engine achieves on the hardware.

  compute_efficiency / memory_efficiency: achieved fraction of peak FLOP/s and HBM
  bandwidth in decode-shaped kernels. forward_overhead_s: fixed cost of one target
  forward (scheduling, input preparation, sampler launch, output processing) that the
  accelerator's roofline does not see; draft_step_overhead_s the same for one drafter
  step, which reuses the prepared batch and so costs less; layer_overhead_s: kernel
  launch and synchronisation per layer per forward. memory_utilization: share of HBM
  the engine may use for weights and KV cache. max_num_seqs: the engine's cap on
  concurrently decoded sequences.
  """

  name: str = "engine"
  weight_precision: str = "bf16"
  kv_bytes_per_element: float = 2.0
  compute_efficiency: float = 0.6
  memory_efficiency: float = 0.8
  forward_overhead_s: float = 1e-3
  draft_step_overhead_s: float = 3e-4
  layer_overhead_s: float = 1e-5
  memory_utilization: float = 0.9
  max_num_seqs: int = 1024

  def __post_init__(self):
    owner = f"EngineProfile({self.name!r})"
    validation.one_of(owner, "weight_precision", self.weight_precision, tuple(_BYTES_PER_PARAM))
    check_finite_number(owner, "kv_bytes_per_element", self.kv_bytes_per_element, above=0)
    validation.unit_interval(owner, "compute_efficiency", self.compute_efficiency, open_low=True)
    validation.unit_interval(owner, "memory_efficiency", self.memory_efficiency, open_low=True)
    check_finite_number(owner, "forward_overhead_s", self.forward_overhead_s, at_least=0)
    check_finite_number(owner, "draft_step_overhead_s", self.draft_step_overhead_s, at_least=0)
    check_finite_number(owner, "layer_overhead_s", self.layer_overhead_s, at_least=0)
    validation.unit_interval(owner, "memory_utilization", self.memory_utilization, open_low=True)
    check_positive_int(owner, "max_num_seqs", self.max_num_seqs)

  @property
  def bytes_per_param(self) -> float:
    return _BYTES_PER_PARAM[self.weight_precision]


def acceptance_from_length(acceptance_length: float, depth: int) -> tuple[float, ...]:
  """The i.i.d. per-position acceptance rate a with (1 - a^(k+1)) / (1 - a) equal to
  the reported acceptance length (tokens per target forward), for k = depth."""
  check_positive_int("acceptance_from_length", "depth", depth)
  check(isinstance(acceptance_length, (int, float)) and 1 <= acceptance_length <= depth + 1,
        "acceptance_from_length", "acceptance_length", acceptance_length,
        f"a number in [1, depth + 1 = {depth + 1}]")
  low, high = 0.0, 1.0
  for _ in range(100):
    mid = (low + high) / 2
    if sum(mid**i for i in range(depth + 1)) < acceptance_length:
      low = mid
    else:
      high = mid
  return ((low + high) / 2,) * depth


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculationSpec:
  """Speculative decoding for the simulator.

  acceptance: conditional per-position acceptance rates, acceptance[i] = P(draft i+1
  accepted | drafts 1..i accepted), each in [0, 1]; shorter than the depth means the
  last rate repeats. (vLLM's per-position metric is unconditional: the running product
  of these.) tree: children per node by depth, as in ``sj.SpecConfig``; acceptance is
  then per depth.
  """

  drafter: DrafterSpec
  num_draft_tokens: int
  acceptance: tuple[float, ...]
  tree: tuple[int, ...] | None = None

  def __post_init__(self):
    owner = "SpeculationSpec"
    check(isinstance(self.drafter, DrafterSpec), owner, "drafter", self.drafter,
          "a DrafterSpec")
    check_positive_int(owner, "num_draft_tokens", self.num_draft_tokens)
    check(isinstance(self.acceptance, tuple) and len(self.acceptance) > 0, owner,
          "acceptance", self.acceptance, "a non-empty tuple of rates in [0, 1]")
    for i, rate in enumerate(self.acceptance):
      validation.unit_interval(owner, f"acceptance[{i}]", rate)
    if self.tree is not None:
      check(isinstance(self.tree, tuple) and len(self.tree) > 0
            and all(isinstance(b, int) and b > 0 for b in self.tree), owner, "tree",
            self.tree, "None or a non-empty tuple of positive children counts")

  @classmethod
  def from_acceptance_length(cls, *, drafter: DrafterSpec, num_draft_tokens: int,
                             acceptance_length: float) -> "SpeculationSpec":
    return cls(drafter=drafter, num_draft_tokens=num_draft_tokens,
               acceptance=acceptance_from_length(acceptance_length, num_draft_tokens))

  @property
  def depth(self) -> int:
    return len(self.tree) if self.tree is not None else self.num_draft_tokens

  @property
  def draft_tokens_per_step(self) -> tuple[int, ...]:
    """Tokens each drafter step processes per sequence (nodes at the previous depth)."""
    if self.tree is None:
      return (1,) * self.num_draft_tokens
    nodes, widths = 1, []
    for children in self.tree:
      widths.append(nodes)
      nodes *= children
    return tuple(widths)

  @property
  def verify_tokens(self) -> int:
    """Query tokens per sequence in the verify forward: the last token plus drafts."""
    if self.tree is None:
      return 1 + self.num_draft_tokens
    nodes, total = 1, 1
    for children in self.tree:
      nodes *= children
      total += nodes
    return total

  @property
  def tokens_per_round(self) -> float:
    return expected_tokens_per_round(self.acceptance, self.depth)


@dataclasses.dataclass(frozen=True)
class LinearCost:
  """fixed + max(compute0 + compute1 * x, memory0 + memory1 * x), x = live context."""

  fixed: float
  compute0: float
  compute1: float
  memory0: float
  memory1: float

  def at(self, context: float) -> float:
    return self.fixed + max(self.compute0 + self.compute1 * context,
                            self.memory0 + self.memory1 * context)

  def sum_over(self, context0: float, step: float, n: int) -> float:
    """Sum of ``at(context0 + j * step)`` for j in [0, n), in closed form."""
    if n <= 0:
      return 0.0
    lines = ((self.compute0 + self.compute1 * context0, self.compute1 * step),
             (self.memory0 + self.memory1 * context0, self.memory1 * step))

    def series(line, start, stop):  # sum of a + b j over j in [start, stop)
      a, b = line
      count = stop - start
      return count * a + b * (start + stop - 1) * count / 2 if count > 0 else 0.0

    (a0, b0), (a1, b1) = lines
    if b0 == b1:
      split = 0 if a0 >= a1 else n
    else:
      # Line 0 dominates where a0 + b0 j >= a1 + b1 j.
      crossing = (a1 - a0) / (b0 - b1)
      split = int(min(max(math.ceil(crossing), 0), n))
    if b0 > b1:  # line 1 first, line 0 from the crossing on
      total = series(lines[1], 0, split) + series(lines[0], split, n)
    elif b0 < b1:
      total = series(lines[0], 0, split) + series(lines[1], split, n)
    else:
      total = series(lines[0] if split == 0 else lines[1], 0, n)
    return n * self.fixed + total


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardCostModel:
  """Roofline cost of forwards of one network on one inference instance."""

  hardware: HardwareProfile
  engine: EngineProfile
  tp: int = 1
  ep: int = 1

  def __post_init__(self):
    check_positive_int("ForwardCostModel", "tp", self.tp)
    check(self.ep in (1, self.tp), "ForwardCostModel", "ep", self.ep, f"1 or tp={self.tp}")

  def _collectives(self, network: ModelSpec, tokens: float) -> float:
    if self.tp == 1:
      return 0.0
    hardware = self.hardware
    message = tokens * network.hidden_size * _ACTIVATION_BYTES
    all_reduce = hardware.collective_latency_s + 2 * (self.tp - 1) / self.tp * message / (
        hardware.interconnect_bandwidth)
    if network.is_moe and self.ep == self.tp:
      # Attention output all-reduce, then dispatch and combine all-to-alls.
      routed = message * network.experts_per_token * (self.tp - 1) / self.tp / self.tp
      all_to_all = hardware.collective_latency_s + routed / hardware.interconnect_bandwidth
      per_layer = all_reduce + 2 * all_to_all
    else:
      per_layer = 2 * all_reduce
    return network.num_layers * per_layer

  def forward(self, network: ModelSpec, *, num_seqs: float, query_tokens: float,
              overhead: float, extra_matmul_params: float = 0.0,
              sampled_vocab: int | None = None,
              context_tokens_offset: float = 0.0) -> LinearCost:
    """Cost of one forward of ``network`` as a function of the live context (the
    total tokens already in the batch's KV cache). ``sampled_vocab`` is the width of
    the distributions the sampler or verifier reads per token (None: the network's
    vocabulary). ``context_tokens_offset`` adds context the attention sees beyond the
    cache, summed over sequences (a prefill attends on average to half its prompt)."""
    hardware, engine = self.hardware, self.engine
    tokens = num_seqs * query_tokens
    flops_per_s = (self.tp * hardware.peak_flops(engine.weight_precision)
                   * engine.compute_efficiency)
    bytes_per_s = self.tp * hardware.hbm_bandwidth * engine.memory_efficiency
    matmul_flops = network.forward_matmul_flops(tokens) + 2 * extra_matmul_params * tokens
    # Attention FLOPs per unit of context: every query token sees the whole context.
    attention_per_context = network.attention_flops(query_tokens, 1.0)
    weight_bytes = (network.weights_read(tokens) + extra_matmul_params) * engine.bytes_per_param
    kv_per_token = network.kv_bytes_per_token(engine.kv_bytes_per_element)
    vocab = network.vocab_size if sampled_vocab is None else sampled_vocab
    sampler = tokens * vocab * _SAMPLER_BYTES_PER_LOGIT / (hardware.hbm_bandwidth *
                                                           engine.memory_efficiency)
    fixed = (overhead + engine.layer_overhead_s * network.num_layers
             + self._collectives(network, tokens) + sampler)
    compute0 = (matmul_flops + attention_per_context * context_tokens_offset) / flops_per_s
    memory0 = (weight_bytes + kv_per_token * (tokens + context_tokens_offset)) / bytes_per_s
    return LinearCost(fixed=fixed, compute0=compute0,
                      compute1=attention_per_context / flops_per_s, memory0=memory0,
                      memory1=kv_per_token / bytes_per_s)

  def decode_round(self, target: ModelSpec, speculation: SpeculationSpec | None, *,
                   num_seqs: int) -> list[LinearCost]:
    """The forwards of one decode round (plain: one target step)."""
    engine = self.engine
    if speculation is None:
      return [self.forward(target, num_seqs=num_seqs, query_tokens=1,
                           overhead=engine.forward_overhead_s)]
    costs = [self.forward(target, num_seqs=num_seqs,
                          query_tokens=speculation.verify_tokens,
                          overhead=engine.forward_overhead_s)]
    drafter = speculation.drafter
    if drafter.host_seconds_per_round > 0:
      costs.append(LinearCost(drafter.host_seconds_per_round, 0.0, 0.0, 0.0, 0.0))
    if drafter.step_network is not None:
      for step, width in enumerate(speculation.draft_tokens_per_step):
        # The first step also consumes the verified tokens' fused hidden states.
        extra = drafter.round_matmul_params if step == 0 else 0
        costs.append(self.forward(drafter.step_network, num_seqs=num_seqs,
                                  query_tokens=width, overhead=engine.draft_step_overhead_s,
                                  extra_matmul_params=extra))
    return costs

  def prefill(self, target: ModelSpec, *, num_seqs: int, prompt_tokens: float,
              drafter: DrafterSpec | None = None) -> float:
    """One chunk of prompts (or re-prefill after preemption): compute-bound, attention
    over half the prompt on average. A learned drafter prefills its own cache too."""
    if num_seqs <= 0 or prompt_tokens <= 0:
      return 0.0
    # Only the last position of each prompt is sampled.
    causal_context = num_seqs * prompt_tokens / 2
    cost = self.forward(target, num_seqs=num_seqs, query_tokens=prompt_tokens,
                        overhead=self.engine.forward_overhead_s, sampled_vocab=0,
                        context_tokens_offset=causal_context)
    seconds = cost.at(0.0) + num_seqs * target.vocab_size * _SAMPLER_BYTES_PER_LOGIT / (
        self.hardware.hbm_bandwidth * self.engine.memory_efficiency)
    if drafter is not None and drafter.step_network is not None:
      seconds += self.forward(drafter.step_network, num_seqs=num_seqs,
                              query_tokens=prompt_tokens, sampled_vocab=0,
                              overhead=self.engine.draft_step_overhead_s,
                              extra_matmul_params=drafter.round_matmul_params,
                              context_tokens_offset=causal_context).at(0.0)
    return seconds
