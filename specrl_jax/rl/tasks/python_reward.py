"""Rewards computed by a Python function on the host (e.g. checking a math answer
with a CAS), called from inside the compiled RL step with ``jax.pure_callback``.

The callback is the one host round trip of such a step. If the function raises, the
callback does not crash the XLA program (whose error would bury the cause): it
records the exception, returns NaN rewards, and ``raise_pending_errors`` re-raises it
as ``RewardFunctionError`` on the host right after the step.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.models import tokenizer
from specrl_jax.rl.tasks.base import Problem, Task

# (response text, this sample's reward targets as numpy arrays) -> reward
HostRewardFn = Callable[[str, Mapping[str, np.ndarray]], float]


class RewardFunctionError(RuntimeError):
  """A Python reward function raised while scoring a batch."""


_LOCK = threading.Lock()
_PENDING: list[tuple[str, BaseException]] = []


def raise_pending_errors() -> None:
  """Raises the first exception a host reward function hit since the last call."""
  with _LOCK:
    pending, _PENDING[:] = list(_PENDING), []
  if pending:
    name, error = pending[0]
    raise RewardFunctionError(
        f"the Python reward function {name} raised {type(error).__name__}: {error} "
        f"({len(pending)} batch(es) failed; their rewards were NaN and were not trained on)."
    ) from error


def decode_answer(ids: np.ndarray) -> str:
  """Text of a -1-padded answer token array (the targets format of the built-in tasks)."""
  return tokenizer.decode([int(i) for i in np.asarray(ids) if i >= 0])


def python_reward(fn: HostRewardFn, *, name: str | None = None):
  """A jittable reward (targets, tokens_RxL, lengths_R) -> float32 [R] that calls
  ``fn(response_text, targets_row)`` for every sample on the host."""
  label = name or getattr(fn, "__qualname__", repr(fn))

  def host(targets, tokens_RxL, lengths_R):
    targets = {k: np.asarray(v) for k, v in targets.items()}
    tokens_RxL, lengths_R = np.asarray(tokens_RxL), np.asarray(lengths_R)
    try:
      rewards = [float(fn(tokenizer.decode(row[:n].tolist()),
                          {k: v[i] for k, v in targets.items()}))
                 for i, (row, n) in enumerate(zip(tokens_RxL, lengths_R))]
      return np.asarray(rewards, np.float32)
    except Exception as error:  # handed to the host loop, see the module docstring
      with _LOCK:
        _PENDING.append((label, error))
      return np.full(tokens_RxL.shape[:1], np.nan, np.float32)

  def reward(targets, tokens_RxL, lengths_R):
    shape = jax.ShapeDtypeStruct(tokens_RxL.shape[:1], jnp.float32)
    return jax.pure_callback(host, shape, dict(targets), tokens_RxL, lengths_R,
                             vmap_method="sequential")

  return reward


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class PythonRewardTask(Task):
  """``task``'s problems and prompts, scored by a host function instead.

  Not a value-equal dataclass: two wrappers of the same function are the same step
  only if they are the same object (functions do not compare by behaviour).
  """

  task: Task
  fn: HostRewardFn
  name: str = "python"

  def __post_init__(self):
    object.__setattr__(self, "_reward", python_reward(self.fn))

  @property
  def max_response_tokens(self) -> int:
    return self.task.max_response_tokens

  @property
  def max_prompt_tokens(self) -> int:
    return self.task.max_prompt_tokens

  def sample(self, rng: np.random.Generator) -> Problem:
    return self.task.sample(rng)

  def reward(self, targets, tokens_RxL, lengths_R):
    return self._reward(targets, tokens_RxL, lengths_R)


def arithmetic_answer_checker(response: str, targets: Mapping[str, Any]) -> float:
  """A host-side checker of the arithmetic task: the text after the last '#' as an
  integer equals the answer (what a real math checker would do with parsing)."""
  expected = int(decode_answer(targets["answer"]))
  if "#" not in response:
    return 0.0
  tail = response.rsplit("#", 1)[1].strip()
  return float(tail.isdigit() and int(tail) == expected)
