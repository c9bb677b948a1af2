"""Rewards computed by a Python function on the host (e.g. checking a math answer
with a CAS), called from inside the compiled RL step with ``jax.pure_callback``.

The callback is the one host round trip of such a step. If the function fails, the
callback does not crash the XLA program (whose error would bury the cause): it
records the failure, returns NaN rewards, and ``raise_pending_errors`` re-raises it
as ``RewardFunctionError`` naming the sample on the host right after the step. A
failure is anything a call does but return a number: any exception (SystemExit and
KeyboardInterrupt included), a call still running after ``timeout`` seconds, and,
with ``workers`` > 0 (each call in a separate worker process, for untrusted code), a
worker that dies or exceeds its memory limit. See ``reward_workers``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import check, is_finite_number
from specrl_jax.models import tokenizer
from specrl_jax.models.text_tokenizer import TextTokenizer
from specrl_jax.rl.tasks.base import Problem, Task
from specrl_jax.rl.tasks.reward_workers import (
    RewardWorkers, SampleError, call_all_with_timeout)

# (response text, this sample's reward targets as numpy arrays) -> reward
HostRewardFn = Callable[[str, Mapping[str, np.ndarray]], float]


class RewardFunctionError(RuntimeError):
  """A Python reward function failed (raised, timed out, or killed its worker) while
  scoring a batch."""


_LOCK = threading.Lock()
_PENDING: list[tuple[str, SampleError, str]] = []
_FAILURES: list[tuple[str, SampleError, str]] = []
# What a sample scores when its call timed out or killed its worker process and the
# task scores such samples instead of failing the run: no evidence the answer is right.
FAILED_SAMPLE_SCORE = 0.0


def raise_pending_errors() -> None:
  """Raises the first failure a host reward function hit since the last call."""
  with _LOCK:
    pending, _PENDING[:] = list(_PENDING), []
  if pending:
    name, error, text = pending[0]
    raise RewardFunctionError(
        f"the Python reward function {name} {error.problem} on sample {error.index} of its "
        f"batch (response {text[:80]!r}) ({len(pending)} batch(es) failed; their rewards "
        "were NaN and were not trained on)."
    ) from error.cause


def record_error(name: str, error: SampleError, text: str) -> None:
  """Keeps a failure of reward function ``name`` on sample text ``text`` for
  ``raise_pending_errors`` (a host callback must not raise into XLA)."""
  with _LOCK:
    _PENDING.append((name, error, text))


def record_failure(name: str, error: SampleError, text: str) -> None:
  """Keeps a sample that scored a failure score instead of failing the run (a worker
  that timed out or died, ``RewardWorkers(failure_score=...)``) for ``take_failures``."""
  with _LOCK:
    _FAILURES.append((name, error, text))


def take_failures() -> list[str]:
  """One line per sample scored as failed since the last call, naming the function,
  the sample, what happened and the start of its response."""
  with _LOCK:
    failures, _FAILURES[:] = list(_FAILURES), []
  return [f"the reward function {name} {error.problem} on sample {error.index} of its batch "
          f"(response {text[:80]!r}): it scored {FAILED_SAMPLE_SCORE}" for name, error, text
          in failures]


def decode_samples(text_tokenizer: TextTokenizer, targets, tokens_RxL, lengths_R
                   ) -> list[tuple[str, dict[str, np.ndarray]]]:
  """(response text up to its stop token, its targets row) of every sample."""
  targets = {k: np.asarray(v) for k, v in targets.items()}
  tokens_RxL, lengths_R = np.asarray(tokens_RxL), np.asarray(lengths_R)
  return [(text_tokenizer.decode(row[:n].tolist()), {k: v[i] for k, v in targets.items()})
          for i, (row, n) in enumerate(zip(tokens_RxL, lengths_R))]


def on_host(host: Callable[..., np.ndarray], targets, tokens_RxL, lengths_R):
  """float32 [R] rewards from ``host(targets, tokens_RxL, lengths_R)`` run on the host
  inside a compiled step (one callback per batch)."""
  shape = jax.ShapeDtypeStruct(tokens_RxL.shape[:1], jnp.float32)
  return jax.pure_callback(host, shape, dict(targets), tokens_RxL, lengths_R,
                           vmap_method="sequential")


def decode_answer(ids: np.ndarray) -> str:
  """Text of a -1-padded answer token array (the targets format of the built-in tasks)."""
  return tokenizer.decode([int(i) for i in np.asarray(ids) if i >= 0])


def check_options(owner: str, timeout, workers, memory_limit_mb) -> None:
  check(timeout is None or (is_finite_number(timeout) and timeout > 0), owner, "timeout",
        timeout, "None (no limit) or a finite number of seconds > 0")
  check(isinstance(workers, int) and not isinstance(workers, bool) and workers >= 0, owner,
        "workers", workers, "an integer >= 0 (0 = call the function in this process)")
  check(memory_limit_mb is None or (isinstance(memory_limit_mb, int)
                                    and not isinstance(memory_limit_mb, bool)
                                    and memory_limit_mb > 0 and workers > 0),
        owner, "memory_limit_mb", memory_limit_mb,
        "None, or a positive integer with workers > 0 (a limit needs a worker process)")


def python_reward(fn: HostRewardFn, *, name: str | None = None, timeout: float | None = 60.0,
                  workers: int = 0, memory_limit_mb: int | None = None, threads: int = 1,
                  text_tokenizer: TextTokenizer | None = None):
  """A jittable reward (targets, tokens_RxL, lengths_R) -> float32 [R] that calls
  ``fn(response_text, targets_row)`` for every sample on the host; the response is
  decoded by ``text_tokenizer`` (default the built-in one) up to its stop token.

  timeout: seconds one call may run (None: no limit). In this process (workers=0) a
    call past it is abandoned, still running in its thread; in a worker it is killed.
  workers: 0 calls ``fn`` in this process; N > 0 in N worker processes (isolation for
    untrusted code; ``fn`` must pickle, e.g. a module-level function).
  memory_limit_mb: with workers, the address space one worker may grow by (RLIMIT_AS).
  threads: without workers, how many calls run at once on host threads.
  """
  check_options("python_reward", timeout, workers, memory_limit_mb)
  check(isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1,
        "python_reward", "threads", threads, "an integer >= 1")
  text_tokenizer = text_tokenizer or tokenizer.text_tokenizer()
  label = name or getattr(fn, "__qualname__", repr(fn))
  pool = (RewardWorkers(fn, num_workers=workers, timeout=timeout,
                        memory_limit_bytes=memory_limit_mb and memory_limit_mb << 20)
          if workers else None)

  def host(targets, tokens_RxL, lengths_R):
    samples = decode_samples(text_tokenizer, targets, tokens_RxL, lengths_R)
    try:
      if pool is not None:
        rewards = pool.score(samples)
      else:
        rewards = call_all_with_timeout(fn, samples, timeout, threads)
      return np.asarray(rewards, np.float32)
    except SampleError as error:  # handed to the host loop, see the module docstring
      record_error(label, error, samples[error.index][0])
      return np.full(len(samples), np.nan, np.float32)

  def reward(targets, tokens_RxL, lengths_R):
    return on_host(host, targets, tokens_RxL, lengths_R)

  return reward


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class PythonRewardTask(Task):
  """``task``'s problems and prompts, scored by a host function instead (timeout,
  workers, memory_limit_mb: as in ``python_reward``).

  Not a value-equal dataclass: two wrappers of the same function are the same step
  only if they are the same object (functions do not compare by behaviour).
  """

  task: Task
  fn: HostRewardFn
  name: str = "python"
  timeout: float | None = 60.0
  workers: int = 0
  memory_limit_mb: int | None = None

  def __post_init__(self):
    check_options("PythonRewardTask", self.timeout, self.workers, self.memory_limit_mb)
    object.__setattr__(self, "_reward", python_reward(
        self.fn, timeout=self.timeout, workers=self.workers,
        memory_limit_mb=self.memory_limit_mb, text_tokenizer=self.task.tokenizer))

  @property
  def tokenizer(self) -> TextTokenizer:
    return self.task.tokenizer

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
