"""What a draft of depth k is expected to gain, from per-position acceptance rates.

``acceptance[i]`` is the conditional rate P(draft i+1 accepted | drafts 1..i accepted);
a sequence shorter than the depth repeats its last rate. Pure numpy, shared by the
adaptive controller and the performance simulator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrl_jax.config import check, check_non_negative_int, is_finite_number

# Pseudo-rounds of the prior on a chain position's acceptance: position 0 starts at 1/2
# (Laplace); a deeper one at the estimate of the position before it. Deep positions are
# reached only by the rounds that accepted every earlier draft, often only in exploration
# rounds of the longest chain, and fading halves their counts at each rollout's end: a
# prior of 1/2 there held them near 1/2 while the drafter accepted ~0.76 (38M pair,
# docs/results.md, "In-loop adaptive"), and a position reached 0.01 times jumped from
# the previous position's rate to 1/2.
PRIOR_ROUNDS = 2.0


def acceptance_estimates(accepted_Z, reached_Z) -> list:
  """Per-position conditional acceptance from counts of accepted and reached drafts:
  position 0 a Laplace estimate, each deeper one shrunk toward the one before it by
  ``PRIOR_ROUNDS`` (never reached: the one before). Plain arithmetic, so one rule serves
  the host controller's numpy counts and the in-loop controller's traced ones."""
  rates = [(accepted_Z[0] + 1) / (reached_Z[0] + 2)]
  for i in range(1, len(accepted_Z)):
    rates.append((accepted_Z[i] + PRIOR_ROUNDS * rates[-1]) / (reached_Z[i] + PRIOR_ROUNDS))
  return rates


def check_acceptance(per_position_acceptance: Sequence[float],
                     owner: str = "SpeculationCostModel") -> tuple[float, ...]:
  """The rates as floats, each checked to be a probability."""
  rates = tuple(float(a) for a in per_position_acceptance)
  check(len(rates) > 0, owner, "per_position_acceptance", rates,
        "a non-empty sequence of conditional acceptance rates in [0, 1]")
  for i, rate in enumerate(rates):
    check(is_finite_number(rate) and 0 <= rate <= 1, owner, f"per_position_acceptance[{i}]",
          rate, "a number in [0, 1]")
  return rates


def expected_tokens_per_round(acceptance: tuple[float, ...], depth: int) -> float:
  """1 + sum over positions i <= depth of P(first i drafts all accepted), with
  ``acceptance[i]`` the conditional rate at position i (the last rate repeats)."""
  total, alive = 1.0, 1.0
  for i in range(depth):
    alive *= acceptance[min(i, len(acceptance) - 1)]
    total += alive
  return total


def expected_rounds_to_finish(remaining_tokens: Sequence[int], k: int,
                              per_position_acceptance: Sequence[float]) -> float:
  """Expected rounds until every sequence has emitted its ``remaining_tokens`` (the
  batch waits for its unluckiest sequence), computed exactly: the distribution of one
  sequence's emitted count after n rounds is the n-fold convolution of the per-round
  count (1 + accepted drafts), and the batch is done by round n with probability
  prod_s P(sequence s is done by round n)."""
  check_non_negative_int("expected_rounds_to_finish", "k", k)
  remaining = np.asarray(remaining_tokens, np.int64)
  check(remaining.ndim == 1 and np.all(remaining >= 0), "expected_rounds_to_finish",
        "remaining_tokens", remaining_tokens, "a sequence of integers >= 0")
  remaining = remaining[remaining > 0]
  if remaining.size == 0:
    return 0.0
  if k == 0:
    return float(remaining.max())
  rates = check_acceptance(per_position_acceptance)
  rates = np.array([rates[min(i, len(rates) - 1)] for i in range(k)])
  reach = np.concatenate([[1.0], np.cumprod(rates)])  # P(at least j drafts accepted)
  # per_round[t] = P(a round emits t tokens): 0 for t = 0, then 1 + j for j accepted.
  per_round = np.concatenate([[0.0], reach[:-1] - reach[1:], [reach[-1]]])
  longest = int(remaining.max())
  # emitted[t] = P(t tokens emitted so far), counts >= longest pooled in the last bin.
  emitted = np.zeros(longest + 1)
  emitted[0] = 1.0
  expected = 0.0
  for _ in range(longest):  # at least one token per round: done within `longest` rounds
    step = np.convolve(emitted, per_round)
    emitted = step[:longest + 1]
    emitted[-1] += step[longest + 1:].sum()
    done_by = np.cumsum(emitted[::-1])[::-1]  # done_by[t] = P(emitted >= t)
    batch_done = float(np.prod(done_by[remaining]))
    expected += 1.0 - batch_done
    if batch_done > 1 - 1e-12:
      break
  return expected + 1.0  # the first round always runs; the sum counts the rounds after it
