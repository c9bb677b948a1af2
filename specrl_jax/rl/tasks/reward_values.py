"""What a host reward function may return, and its conversion to the float trained on.

Standard library only: the reward worker script loads this file by path, so that a
worker process does not import the package (and JAX) for a plain reward function.

Accepted: int, float and bool, numpy's real and bool scalars, fractions (anything
``numbers.Real``), finite once converted. A coroutine (an ``async def`` reward) is
run to its result on the calling thread first. Everything else is refused with
``RewardValueError`` naming the type and value: None, strings, lists, arrays (one
element or not: a reward is one number per sample, not a batch), complex numbers,
NaN, infinities and integers too large for a float (10**400).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers

ALLOWED = "a finite real number (float, int, bool or a numpy real scalar)"


class RewardValueError(TypeError):
  """A reward function returned something other than a finite real number."""


def _shown(value) -> str:
  text = repr(value)
  return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _awaited(value):
  try:
    asyncio.get_running_loop()
  except RuntimeError:  # no loop running in this thread: run the coroutine here
    return asyncio.run(_result(value))
  if inspect.iscoroutine(value):
    value.close()  # never awaited otherwise: silence "coroutine was never awaited"
  raise RewardValueError(f"returned {_shown(value)}, which cannot be awaited here (an event "
                         "loop is already running in this thread): make the reward a plain "
                         f"function returning {ALLOWED}")


async def _result(awaitable):
  return await awaitable


def reward_value(value) -> float:
  """``value`` as a float, or RewardValueError saying what was returned (module
  docstring)."""
  if inspect.isawaitable(value):
    value = _awaited(value)
  if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
    value = bool(value)
  if not isinstance(value, numbers.Real):
    raise RewardValueError(f"returned {_shown(value)}, not {ALLOWED}")
  try:
    number = float(value)
  except (OverflowError, ValueError) as error:
    raise RewardValueError(f"returned {_shown(value)}, too large for a float ({error}), not "
                           f"{ALLOWED}") from None
  if not math.isfinite(number):
    raise RewardValueError(f"returned {_shown(value)}, not {ALLOWED}")
  return number
