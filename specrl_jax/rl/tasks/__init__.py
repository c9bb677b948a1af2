"""Tasks with verifiable rewards, by name: ``make_task("arithmetic", max_digits=3)``;
``longtail_arithmetic`` is addition with long-tailed response lengths."""

from __future__ import annotations

from collections.abc import Callable

from specrl_jax.config import ConfigError
from specrl_jax.rl.tasks.arithmetic import Arithmetic, worked_sum
from specrl_jax.rl.tasks.base import (
    NoValidPromptsError, Problem, PromptBatch, PromptSet, RewardFn, Task, encode_problems,
    make_prompt_set, matches_after_marker, step_indices,
)
from specrl_jax.rl.tasks.countdown import Countdown, parse_lines
from specrl_jax.rl.tasks.dataset import DatasetError, read_records, split_records
from specrl_jax.rl.tasks.dataset_task import DatasetTask
from specrl_jax.rl.tasks.longtail import LongTailArithmetic, digit_distribution
from specrl_jax.rl.tasks.python_reward import (
    PythonRewardTask, RewardFunctionError, arithmetic_answer_checker, decode_answer,
    python_reward, raise_pending_errors,
)
from specrl_jax.rl.tasks.rewards import BUILTIN as BUILTIN_REWARDS, resolve_reward

TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": Arithmetic,
    "countdown": Countdown,
    "longtail_arithmetic": LongTailArithmetic,
}


def register_task(name: str, factory: Callable[..., Task]) -> None:
  if name in TASKS:
    raise ValueError(f"task {name!r} is already registered")
  TASKS[name] = factory


def make_task(name: str, **options) -> Task:
  if name not in TASKS:
    raise ConfigError(f"task={name!r} is invalid: expected one of {sorted(TASKS)}.")
  return TASKS[name](**options)


__all__ = [
    "Arithmetic", "BUILTIN_REWARDS", "Countdown", "DatasetError", "DatasetTask",
    "LongTailArithmetic", "NoValidPromptsError", "Problem", "PromptBatch", "PromptSet",
    "PythonRewardTask", "RewardFn", "RewardFunctionError", "TASKS", "Task",
    "arithmetic_answer_checker", "decode_answer", "digit_distribution", "encode_problems",
    "make_prompt_set", "make_task", "matches_after_marker", "parse_lines", "python_reward",
    "raise_pending_errors", "read_records", "register_task", "resolve_reward",
    "split_records", "step_indices", "worked_sum",
]
