"""The cost model an adaptive speculative engine asks: is a draft of k tokens worth it
for this live batch, given the acceptance measured so far?

A speculative round of draft length k costs k drafter steps plus one target forward over
k + 1 tokens per sequence, and emits 1 + sum_i prod_{j <= i} a_j tokens per sequence
in expectation (a_j: conditional per-position acceptance). Plain decoding (k = 0) is
one target forward over one token per sequence. ``best_k`` compares tokens per second
and never picks a k the model predicts slower than plain decoding.

Per-call costs come from a few measured points (``LinearCallCost.fit``: overhead plus
per-token and per-sequence terms; ``MeasuredCallCost.fit``: the points themselves,
interpolated in tokens, where time is not a line) or from the roofline of a ModelSpec on a
HardwareProfile with a fitted scale and overhead (``RooflineCallCost.fit``), which
keeps the memory-to-compute kink where verification stops being free. On a CPU the
linear fit is the better one: small-batch matmuls there run far below peak, so time
grows with tokens from the first one and the roofline's flat memory-bound region is
not seen (bench-160m under jit: about 27 ms + 3 ms per token on the shared 2 cores).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

from specrl_jax.config import check, check_finite_number, check_non_negative_int, check_positive_int
from specrl_jax.sim import validation
from specrl_jax.sim.hardware import HardwareProfile
from specrl_jax.sim.model_spec import ModelSpec
from specrl_jax.sim.roofline import EngineProfile, ForwardCostModel
from specrl_jax.speculative.expected import (check_acceptance, expected_rounds_to_finish,
                                             expected_tokens_per_round)

_BYTES_PER_ELEMENT = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0}

# A measured call: (batch size, query tokens per sequence, seconds).
CallPoint = tuple[int, int, float]


class CallCost(Protocol):

  def seconds(self, batch_size: int, query_tokens: int = 1) -> float:
    ...


def _check_points(owner: str, points: Sequence[CallPoint]) -> np.ndarray:
  check(len(points) > 0, owner, "points", points,
        "a non-empty list of (batch_size, query_tokens, seconds)")
  for i, point in enumerate(points):
    check(len(point) == 3 and point[0] >= 1 and point[1] >= 1 and point[2] > 0, owner,
          f"points[{i}]", point, "(batch_size >= 1, query_tokens >= 1, seconds > 0)")
  return np.asarray(points, np.float64)


def _non_negative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
  """Least squares on relative error (each row divided by its measured time, so a
  1 ms call counts as much as a 1 s one) with coefficients >= 0: drop the most
  negative column and refit (a handful of columns, so this settles in a few passes)."""
  design, target = design / target[:, None], np.ones_like(target)
  active = list(range(design.shape[1]))
  coefficients = np.zeros(design.shape[1])
  while active:
    solution, *_ = np.linalg.lstsq(design[:, active], target, rcond=None)
    if (solution >= 0).all():
      coefficients[active] = solution
      break
    active.pop(int(np.argmin(solution)))
  return coefficients


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearCallCost:
  """seconds = overhead + per_token * batch * query_tokens + per_sequence * batch."""

  overhead_s: float
  per_token_s: float
  per_sequence_s: float = 0.0

  def __post_init__(self):
    for field in ("overhead_s", "per_token_s", "per_sequence_s"):
      check_finite_number("LinearCallCost", field, getattr(self, field), at_least=0)

  def seconds(self, batch_size: int, query_tokens: int = 1) -> float:
    return (self.overhead_s + self.per_token_s * batch_size * query_tokens
            + self.per_sequence_s * batch_size)

  @classmethod
  def fit(cls, points: Sequence[CallPoint]) -> "LinearCallCost":
    """Non-negative least squares (relative error) on measured points."""
    data = _check_points("LinearCallCost.fit", points)
    batch, query, seconds = data.T
    design = np.stack([np.ones_like(batch), batch * query, batch], axis=1)
    overhead, per_token, per_sequence = _non_negative_least_squares(design, seconds)
    return cls(overhead_s=float(overhead), per_token_s=float(per_token),
               per_sequence_s=float(per_sequence))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredCallCost:
  """seconds = overhead + per_sequence * batch + the measured time at the call's token
  count (batch x query tokens, the rows every matmul of the call multiplies), linear
  between measured counts and along the end segments beyond them; counts measured at
  several shapes average. The two terms carry what the measured calls lacked (e.g. an
  engine's attention over each sequence's cache when the table timed bare forwards).

  For machines where time is not a line in tokens: on a CPU one row runs a
  matrix-vector kernel and two rows a matrix-matrix one, so a 6 x 768 target takes
  6.6 ms at 1 token, 8.3 ms at 2 and 8.1 ms at 4, which no line through all three fits."""

  tokens: tuple[int, ...]
  seconds_at: tuple[float, ...]
  overhead_s: float = 0.0
  per_sequence_s: float = 0.0

  def __post_init__(self):
    owner = "MeasuredCallCost"
    check(len(self.tokens) > 0 and len(self.tokens) == len(self.seconds_at), owner,
          "tokens", self.tokens, "a non-empty tuple as long as seconds_at")
    check(all(b > a for a, b in zip(self.tokens, self.tokens[1:])), owner, "tokens",
          self.tokens, "strictly increasing token counts")
    for i, (count, seconds) in enumerate(zip(self.tokens, self.seconds_at)):
      check_positive_int(owner, f"tokens[{i}]", count)
      check_finite_number(owner, f"seconds_at[{i}]", seconds, above=0)
    check_finite_number(owner, "overhead_s", self.overhead_s, at_least=0)
    check_finite_number(owner, "per_sequence_s", self.per_sequence_s, at_least=0)

  def seconds(self, batch_size: int, query_tokens: int = 1) -> float:
    return (self.overhead_s + self.per_sequence_s * batch_size
            + self._table_seconds(batch_size * query_tokens))

  def _table_seconds(self, count: int) -> float:
    xs, ys = self.tokens, self.seconds_at
    if len(xs) == 1:
      return ys[0]
    if xs[0] <= count <= xs[-1]:
      return float(np.interp(count, xs, ys))
    i = 0 if count < xs[0] else len(xs) - 2
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(0.0, ys[i] + slope * (count - xs[i]))

  @classmethod
  def fit(cls, points: Sequence[CallPoint]) -> "MeasuredCallCost":
    """The table of measured points (mean seconds per token count)."""
    data = _check_points("MeasuredCallCost.fit", points)
    counts = (data[:, 0] * data[:, 1]).astype(np.int64)
    tokens = tuple(int(c) for c in np.unique(counts))
    return cls(tokens=tokens,
               seconds_at=tuple(float(data[counts == c, 2].mean()) for c in tokens))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RooflineCallCost:
  """seconds = overhead + scale * roofline(batch, query_tokens), the roofline of
  ``network`` on ``hardware`` with each sequence holding ``context_tokens``."""

  network: ModelSpec
  hardware: HardwareProfile
  context_tokens: int
  overhead_s: float = 0.0
  scale: float = 1.0
  tp: int = 1
  precision: str = "fp32"  # weights and KV cache; the CPU engine runs float32

  def __post_init__(self):
    owner = "RooflineCallCost"
    validation.one_of(owner, "precision", self.precision, ("fp32", "bf16", "fp8"))
    check_non_negative_int(owner, "context_tokens", self.context_tokens)
    check_finite_number(owner, "overhead_s", self.overhead_s, at_least=0)
    check_finite_number(owner, "scale", self.scale, above=0)
    check_positive_int(owner, "tp", self.tp)

  def roofline_seconds(self, batch_size: int, query_tokens: int = 1) -> float:
    """The bare roofline at peak rates, no overheads."""
    engine = EngineProfile(weight_precision=self.precision,
                           kv_bytes_per_element=_BYTES_PER_ELEMENT[self.precision],
                           compute_efficiency=1.0, memory_efficiency=1.0,
                           forward_overhead_s=0.0, layer_overhead_s=0.0)
    model = ForwardCostModel(hardware=self.hardware, engine=engine, tp=self.tp)
    cost = model.forward(self.network, num_seqs=batch_size, query_tokens=query_tokens,
                         overhead=0.0)
    return cost.at(batch_size * self.context_tokens)

  def seconds(self, batch_size: int, query_tokens: int = 1) -> float:
    return self.overhead_s + self.scale * self.roofline_seconds(batch_size, query_tokens)

  @classmethod
  def fit(cls, points: Sequence[CallPoint], *, network: ModelSpec,
          hardware: HardwareProfile, context_tokens: int, tp: int = 1,
          precision: str = "fp32") -> "RooflineCallCost":
    """Fits overhead and scale (1 / achieved efficiency) to measured points."""
    data = _check_points("RooflineCallCost.fit", points)
    bare = cls(network=network, hardware=hardware, context_tokens=context_tokens, tp=tp,
               precision=precision)
    roofline = np.array([bare.roofline_seconds(int(b), int(q)) for b, q, _ in data])
    design = np.stack([np.ones_like(roofline), roofline], axis=1)
    overhead, scale = _non_negative_least_squares(design, data[:, 2])
    check(scale > 0, "RooflineCallCost.fit", "points", points,
          "measurements whose time grows with the roofline (fitted scale was 0)")
    return dataclasses.replace(bare, overhead_s=float(overhead), scale=float(scale))


def conditional_acceptance(unconditional: Sequence[float]) -> tuple[float, ...]:
  """Converts vLLM-style per-position rates (P(draft i accepted), non-increasing) to
  the conditional rates this module uses (P(draft i accepted | drafts before it were))."""
  rates = [float(r) for r in unconditional]
  check(len(rates) > 0 and all(0 <= r <= 1 for r in rates)
        and all(b <= a + 1e-12 for a, b in zip(rates, rates[1:])),
        "conditional_acceptance", "unconditional", tuple(rates),
        "a non-empty non-increasing sequence of rates in [0, 1]")
  out, previous = [], 1.0
  for rate in rates:
    out.append(rate / previous if previous > 0 else 0.0)
    previous = rate
  return tuple(min(1.0, r) for r in out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculationCostModel:
  """Expected throughput of plain and speculative decoding rounds.

  target: cost of one target forward over (batch, query tokens per sequence).
  drafter: cost of one drafter step over (batch, 1). round_overhead_s: fixed extra per
  speculative round (verification bookkeeping, host-side drafting such as n-gram).
  """

  target: CallCost
  drafter: CallCost
  round_overhead_s: float = 0.0

  def __post_init__(self):
    for field in ("target", "drafter"):
      check(callable(getattr(getattr(self, field), "seconds", None)),
            "SpeculationCostModel", field, getattr(self, field),
            "an object with seconds(batch_size, query_tokens)")
    check_finite_number("SpeculationCostModel", "round_overhead_s", self.round_overhead_s,
                        at_least=0)

  @classmethod
  def from_measurements(cls, *, target_points: Sequence[CallPoint],
                        drafter_points: Sequence[CallPoint],
                        round_overhead_s: float = 0.0) -> "SpeculationCostModel":
    """Linear fits of measured target forwards and drafter steps."""
    return cls(target=LinearCallCost.fit(target_points),
               drafter=LinearCallCost.fit(drafter_points),
               round_overhead_s=round_overhead_s)

  def round_seconds(self, batch_size: int, k: int) -> float:
    check_positive_int("SpeculationCostModel", "batch_size", batch_size)
    check_non_negative_int("SpeculationCostModel", "k", k)
    if k == 0:
      return self.target.seconds(batch_size, 1)
    return (k * self.drafter.seconds(batch_size, 1) + self.target.seconds(batch_size, k + 1)
            + self.round_overhead_s)

  def expected_tokens_per_round(self, k: int, per_position_acceptance: Sequence[float]
                                ) -> float:
    """Per sequence; positions beyond the measured ones repeat the last rate."""
    check_non_negative_int("SpeculationCostModel", "k", k)
    if k == 0:
      return 1.0
    return expected_tokens_per_round(check_acceptance(per_position_acceptance), k)

  def expected_tokens_per_second(self, batch_size: int, k: int,
                                 per_position_acceptance: Sequence[float]) -> float:
    return (batch_size * self.expected_tokens_per_round(k, per_position_acceptance)
            / self.round_seconds(batch_size, k))

  def seconds_per_token(self, batch_size: int, k: int,
                        per_position_acceptance: Sequence[float]) -> float:
    """Predicted decode time per emitted token of one sequence (what a benchmark of
    batch_size sequences reports as wall time / tokens per sequence)."""
    return (self.round_seconds(batch_size, k)
            / self.expected_tokens_per_round(k, per_position_acceptance))

  def batch_decode_seconds(self, batch_size: int, k: int,
                           per_position_acceptance: Sequence[float], new_tokens: int) -> float:
    """Predicted time for a batch of ``batch_size`` sequences to each decode
    ``new_tokens`` tokens (no stop tokens): expected rounds of the slowest sequence
    times the round time. With speculation the sequences need different numbers of
    rounds and the batch runs until the last finishes (``expected_batch_rounds``;
    acceptance per position as in ``expected_tokens_per_round``)."""
    return (self.round_seconds(batch_size, k)
            * expected_batch_rounds(batch_size, k, per_position_acceptance, new_tokens))

  def best_k(self, batch_size: int, per_position_acceptance: Sequence[float], k_max: int,
             *, min_gain: float = 1.0) -> int:
    """The draft length with the highest expected tokens/s; 0 (plain decoding) unless
    some k beats plain by a factor of at least ``min_gain`` (> 1 adds hysteresis
    against measurement noise)."""
    check_non_negative_int("SpeculationCostModel", "k_max", k_max)
    check(isinstance(min_gain, (int, float)) and min_gain >= 1.0, "SpeculationCostModel",
          "min_gain", min_gain, "a number >= 1")
    rates = check_acceptance(per_position_acceptance)
    plain = self.expected_tokens_per_second(batch_size, 0, rates)
    best, best_rate = 0, plain
    for k in range(1, k_max + 1):
      rate = self.expected_tokens_per_second(batch_size, k, rates)
      if rate > best_rate:
        best, best_rate = k, rate
    return best if best_rate >= min_gain * plain else 0


def expected_batch_rounds(batch_size: int, k: int, per_position_acceptance: Sequence[float],
                          new_tokens: int) -> float:
  """Expected number of rounds until all ``batch_size`` sequences have ``new_tokens``
  tokens, each round emitting 1 + (accepted drafts of ``k``) per sequence, drafts
  accepted in order with the conditional rates given (the last one repeats)."""
  check_positive_int("expected_batch_rounds", "batch_size", batch_size)
  check_positive_int("expected_batch_rounds", "new_tokens", new_tokens)
  return expected_rounds_to_finish([new_tokens] * batch_size, k, per_position_acceptance)
