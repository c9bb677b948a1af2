"""Multi-digit addition with worked steps: a column at a time, right to left.

  prompt   "<bos>47+85="
  solution "7+5=12\n4+8+1=13\n#132"   (then EOS)

Each line adds one column and the carry from the previous one; the line's sum is
written in full, so the carry is its tens digit. The reward checks only the final
answer after '#', so a policy may drop or reorder the steps if that helps it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specrl_jax.config import check
from specrl_jax.rl.tasks.base import Problem, Task, answer_tokens, matches_after_marker, token_of


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arithmetic(Task):
  """a + b with ``min_digits``..``max_digits`` digits per operand; reward 1 for the
  exact sum after '#' followed by EOS, else 0."""

  min_digits: int = 2
  max_digits: int = 3
  name: str = "arithmetic"

  def __post_init__(self):
    owner = "Arithmetic"
    check(isinstance(self.min_digits, int) and 1 <= self.min_digits <= 6, owner,
          "min_digits", self.min_digits, "an integer in [1, 6]")
    check(isinstance(self.max_digits, int) and self.min_digits <= self.max_digits <= 6, owner,
          "max_digits", self.max_digits, f"an integer in [min_digits={self.min_digits}, 6]")

  @property
  def answer_width(self) -> int:
    return self.max_digits + 1

  @property
  def max_response_tokens(self) -> int:
    # "d+d+1=dd\n" per column, then "#" + answer + EOS.
    return 9 * self.max_digits + self.answer_width + 2

  @property
  def max_prompt_tokens(self) -> int:
    return 2 * self.max_digits + 3  # BOS, "+", "="

  def _operand(self, rng: np.random.Generator) -> int:
    return random_operand(rng, int(rng.integers(self.min_digits, self.max_digits + 1)))

  def sample(self, rng: np.random.Generator) -> Problem:
    a, b = self._operand(rng), self._operand(rng)
    return Problem(prompt=f"{a}+{b}=", solution=worked_sum(a, b),
                   targets={"answer": answer_tokens(str(a + b), self.answer_width)})

  def reward(self, targets, tokens_RxL, lengths_R):
    correct_R = matches_after_marker(tokens_RxL, lengths_R, token_of("#"), targets["answer"])
    return correct_R.astype(np.float32)


def random_operand(rng: np.random.Generator, digits: int) -> int:
  """A uniform integer of exactly ``digits`` digits (0-9 for one digit)."""
  if digits <= 18:  # what one int64 draw holds
    return int(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits))
  tail = "".join(str(d) for d in rng.integers(0, 10, digits - 1))
  return int(str(rng.integers(1, 10)) + tail)


def worked_sum(a: int, b: int) -> str:
  """The column-by-column solution text of a + b, ending in '#' and the sum."""
  digits_a, digits_b = str(a)[::-1], str(b)[::-1]
  lines, carry = [], 0
  for column in range(max(len(digits_a), len(digits_b))):
    x = int(digits_a[column]) if column < len(digits_a) else 0
    y = int(digits_b[column]) if column < len(digits_b) else 0
    total = x + y + carry
    lines.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}")
    carry = total // 10
  return "\n".join(lines) + f"\n#{a + b}"
