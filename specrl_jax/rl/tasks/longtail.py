"""Addition with long-tailed response lengths: operand digit counts from a power law.

Both operands of a problem have d digits, P(d) proportional to d ** -tail_exponent on
min_digits..max_digits. The worked solution (``worked_sum``) takes a line per column,
so response lengths inherit the heavy tail: with the defaults (1-16 digits, P(d) ~ 1/d)
the mean problem has 4.7 digits and about 1 in 54 has 16, whose solution is over 3x the
mean response's length. A batch then waits for its few long sums: the long-tailed rollout
workload that slot compaction and the per-width statistics are measured on.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specrl_jax.config import check, is_finite_number, is_integer
from specrl_jax.rl.tasks.arithmetic import Arithmetic, random_operand, worked_sum
from specrl_jax.rl.tasks.base import Problem, answer_tokens

# Operands are drawn as int64 (``random_operand``), which holds 18 decimal digits.
MAX_DIGITS = 18


def digit_distribution(min_digits: int, max_digits: int, tail_exponent: float
                       ) -> tuple[np.ndarray, np.ndarray]:
  """(digit counts int64 [D], their probabilities float64 [D]) with P(d) proportional to
  d ** -tail_exponent."""
  digits_D = np.arange(min_digits, max_digits + 1)
  weights_D = digits_D.astype(np.float64) ** -float(tail_exponent)
  return digits_D, weights_D / weights_D.sum()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LongTailArithmetic(Arithmetic):
  """a + b, both of d digits with P(d) ~ d ** -tail_exponent on
  ``min_digits``..``max_digits``; reward 1 for the exact sum after '#' then EOS (the
  arithmetic task's reward, sized for the longest operands)."""

  min_digits: int = 1
  max_digits: int = 16
  tail_exponent: float = 1.0
  name: str = "longtail_arithmetic"

  def __post_init__(self):
    owner = "LongTailArithmetic"
    check(is_integer(self.min_digits) and 1 <= self.min_digits <= MAX_DIGITS, owner,
          "min_digits", self.min_digits, f"an integer in [1, {MAX_DIGITS}]")
    check(is_integer(self.max_digits) and self.min_digits <= self.max_digits <= MAX_DIGITS,
          owner, "max_digits", self.max_digits,
          f"an integer in [min_digits={self.min_digits}, {MAX_DIGITS}] (operands are "
          "drawn as int64)")
    check(is_finite_number(self.tail_exponent) and self.tail_exponent > 0, owner,
          "tail_exponent", self.tail_exponent,
          "a finite number > 0 (P(d) ~ d ** -tail_exponent; larger: a rarer, longer tail "
          "relative to the mean)")

  def digit_distribution(self) -> tuple[np.ndarray, np.ndarray]:
    """(digit counts [D], their probabilities [D])."""
    return digit_distribution(self.min_digits, self.max_digits, self.tail_exponent)

  def sample(self, rng: np.random.Generator) -> Problem:
    digits_D, probabilities_D = self.digit_distribution()
    digits = int(rng.choice(digits_D, p=probabilities_D))
    a, b = random_operand(rng, digits), random_operand(rng, digits)
    return Problem(prompt=f"{a}+{b}=", solution=worked_sum(a, b),
                   targets={"answer": answer_tokens(str(a + b), self.answer_width)})
