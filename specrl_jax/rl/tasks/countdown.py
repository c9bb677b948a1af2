"""Countdown: combine the given numbers with + - * to reach a target.

  prompt   "<bos>3 5 7 to 22:"
  solution "3*5=15\n15+7=22\n"   (then EOS)

Every line "a op b=c" must be arithmetic that holds, with operands taken from the
numbers not yet used (the given ones and earlier lines' results); all numbers are
used, and the last result is the target. The checker is a token-level state machine
(``lax.scan``), so it runs inside the compiled RL step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import check
from specrl_jax.models import tokenizer
from specrl_jax.rl.tasks.base import Problem, Task, digits_of, token_of

_OPS = ("+", "-", "*")
# Numbers past this are invalid: it keeps int32 arithmetic exact.
_MAX_NUMBER = 10 ** 6


@dataclasses.dataclass(frozen=True, kw_only=True)
class Countdown(Task):
  """``num_numbers`` numbers in [1, ``max_number``]; reward 1 for a valid derivation
  of the target, else 0."""

  num_numbers: int = 3
  max_number: int = 9
  name: str = "countdown"

  def __post_init__(self):
    owner = "Countdown"
    check(isinstance(self.num_numbers, int) and 2 <= self.num_numbers <= 5, owner,
          "num_numbers", self.num_numbers, "an integer in [2, 5]")
    check(isinstance(self.max_number, int) and 1 <= self.max_number <= 99, owner,
          "max_number", self.max_number, "an integer in [1, 99]")

  @property
  def max_response_tokens(self) -> int:
    # Each line: two operands, op, '=', result, newline; results stay below 10**6.
    return (self.num_numbers - 1) * 20 + 1

  @property
  def max_prompt_tokens(self) -> int:
    digits = len(str(self.max_number))
    target_digits = len(str(self.max_number ** self.num_numbers))
    return 1 + self.num_numbers * (digits + 1) + 3 + target_digits + 1

  def sample(self, rng: np.random.Generator) -> Problem:
    numbers = [int(n) for n in rng.integers(1, self.max_number + 1, self.num_numbers)]
    order = [numbers[i] for i in rng.permutation(self.num_numbers)]
    value, lines = order[0], []
    for operand in order[1:]:
      op = _OPS[int(rng.integers(len(_OPS)))]
      left, right = (value, operand) if op != "-" or value >= operand else (operand, value)
      value = _apply(op, left, right)
      lines.append(f"{left}{op}{right}={value}\n")
    prompt = " ".join(str(n) for n in numbers) + f" to {value}:"
    return Problem(prompt=prompt, solution="".join(lines),
                   targets={"numbers": np.asarray(numbers, np.int32),
                            "target": np.asarray(value, np.int32)})

  def reward(self, targets, tokens_RxL, lengths_R):
    return jax.vmap(self._solves)(targets["numbers"], targets["target"],
                                  tokens_RxL).astype(jnp.float32)

  def _solves(self, numbers_N, target, tokens_L):
    lines_Kx4, num_lines, well_formed = parse_lines(tokens_L, self.num_numbers - 1)
    num_numbers = self.num_numbers
    pool = jnp.concatenate([numbers_N, jnp.zeros((num_numbers - 1,), jnp.int32)])
    used = jnp.zeros((2 * num_numbers - 1,), bool)
    ok = well_formed & (num_lines == num_numbers - 1)
    index_P = jnp.arange(2 * num_numbers - 1)
    for line in range(num_numbers - 1):
      left, op, right, result = (lines_Kx4[line, i] for i in range(4))
      for operand in (left, right):
        available = (pool == operand) & ~used & (index_P < num_numbers + line)
        ok &= jnp.any(available)
        used = used.at[jnp.argmax(available)].set(True)
      value = jnp.select([op == 1, op == 2, op == 3],
                         [left + right, left - right, left * right], -1)
      ok &= value == result
      pool = pool.at[num_numbers + line].set(result)
    last = lines_Kx4[num_numbers - 2, 3]
    return ok & (last == target)


def _apply(op: str, left: int, right: int) -> int:
  return {"+": left + right, "-": left - right, "*": left * right}[op]


def parse_lines(tokens_L: jax.Array, max_lines: int):
  """Parses "a op b=c\\n" lines up to EOS.

  Returns (lines int32 [max_lines, 4] as (a, op, b, c) with op 1:+ 2:- 3:*, the line
  count, and whether the text was exactly such lines followed by EOS).
  """
  plus, minus, times = token_of("+"), token_of("-"), token_of("*")
  equals, newline = token_of("="), token_of("\n")

  def step(carry, token):
    lines, count, field, number, has_digit, op, left, right, ok, done = carry
    is_digit, digit = digits_of(token)
    token_op = jnp.select([token == plus, token == minus, token == times], [1, 2, 3], 0)
    live = ~done
    # A digit extends the number; anything else closes the current field.
    grown = number * 10 + digit
    ok &= ~(live & is_digit & (grown >= _MAX_NUMBER))
    closes_left = live & (token_op > 0)
    closes_right = live & (token == equals)
    closes_line = live & (token == newline)
    ends = live & (token == tokenizer.EOS_ID)
    stops = live & (token < 0)
    known = is_digit | closes_left | closes_right | closes_line | ends | stops
    ok &= ~live | known
    ok &= ~closes_left | ((field == 0) & has_digit)
    ok &= ~closes_right | ((field == 1) & has_digit)
    ok &= ~closes_line | ((field == 2) & has_digit & (count < max_lines))
    ok &= ~ends | ((field == 0) & ~has_digit)
    ok &= ~stops  # the response ran out without EOS
    row = jnp.stack([left, op, right, number])
    lines = jnp.where(closes_line & (count < max_lines),
                      lines.at[jnp.minimum(count, max_lines - 1)].set(row), lines)
    left = jnp.where(closes_left, number, left)
    op = jnp.where(closes_left, token_op, op)
    right = jnp.where(closes_right, number, right)
    field = jnp.where(closes_left, 1, jnp.where(closes_right, 2,
                                                jnp.where(closes_line, 0, field)))
    count = count + closes_line
    digit_in = live & is_digit
    number = jnp.where(digit_in, grown, jnp.where(live, 0, number))
    has_digit = jnp.where(live, digit_in, has_digit)
    done = done | ends | stops | ~ok
    return (lines, count, field, number, has_digit, op, left, right, ok, done), None

  zero = jnp.int32(0)
  init = (jnp.zeros((max_lines, 4), jnp.int32), zero, zero, zero, jnp.bool_(False), zero,
          zero, zero, jnp.bool_(True), jnp.bool_(False))
  (lines, count, *_, ok, done), _ = jax.lax.scan(step, init, tokens_L.astype(jnp.int32))
  return lines, count, ok & done
