"""A task made of dataset rows and a reward over text: the prompts are the rows'
prompt column rendered by the policy's own tokenizer, the reward a Python function
``reward(prompt, completion, answer, **fields)`` run on host threads (``rewards``).

Each problem's reward target is its row index, so the host function finds the row's
prompt, answer and other columns; the compiled step sees only token arrays.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from specrl_jax.config import check, check_positive_int, is_finite_number
from specrl_jax.models.text_tokenizer import TextTokenizer
from specrl_jax.rl.tasks.base import Problem, Task
from specrl_jax.rl.tasks.dataset import DatasetError
from specrl_jax.rl.tasks.python_reward import python_reward
from specrl_jax.rl.tasks.reward_workers import call_all_with_timeout
from specrl_jax.rl.tasks.rewards import TextReward, keyword_filter

class NonFiniteRewardError(ValueError):
  """A reward function returned NaN or an infinity."""


def _is_conversation(value) -> bool:
  return (isinstance(value, list) and len(value) > 0
          and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                  and isinstance(m.get("content"), str) for m in value))


# Scored samples kept for the run's log (the metrics JSONL and TensorBoard text).
SAMPLES_KEPT = 4


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class DatasetTask(Task):
  """Rows of a dataset scored by ``reward_fn``.

  prompt_field / answer_field: the columns of the prompt text and the answer;
  solution_field: a column of worked solutions for the SFT warm start (None: none);
  system_field: a column of per-row system prompts, else ``system_prompt`` for all
  (None: no system message); max_prompt_length / max_response_length: in tokens
  (longer prompts are dropped, responses are cut there); timeout: seconds one reward
  call may run; threads: reward calls at once. Compared by identity (functions do not
  compare by behaviour), like ``PythonRewardTask``.
  """
  records: tuple[dict[str, Any], ...]
  text_tokenizer: TextTokenizer
  reward_fn: TextReward
  reward_name: str = "reward"
  prompt_field: str = "prompt"
  answer_field: str = "answer"
  solution_field: str | None = None
  system_field: str | None = None
  system_prompt: str | None = None
  max_prompt_length: int = 512
  max_response_length: int = 256
  timeout: float | None = 60.0
  threads: int = 4
  name: str = "dataset"

  def __post_init__(self):
    owner = "DatasetTask"
    check(len(self.records) > 0, owner, "records", "()", "at least one row")
    for field in ("max_prompt_length", "max_response_length", "threads"):
      value = getattr(self, field)
      check_positive_int(owner, field, value)
    check(self.timeout is None or (is_finite_number(self.timeout) and self.timeout > 0), owner,
          "timeout", self.timeout, "None or a finite number of seconds > 0")
    columns = set(self.records[0])
    for field in ("prompt_field", "answer_field", "solution_field", "system_field"):
      column = getattr(self, field)
      if column is not None and column not in columns:
        raise DatasetError(f"DatasetTask.{field}={column!r} is not a column of the dataset; "
                           f"its columns are {sorted(columns)}")
    object.__setattr__(self, "_keywords", keyword_filter(self.reward_fn))
    object.__setattr__(self, "_recent", collections.deque(maxlen=SAMPLES_KEPT))
    object.__setattr__(self, "_reward", python_reward(
        self.score, name=self.reward_name, timeout=self.timeout, threads=self.threads,
        text_tokenizer=self.text_tokenizer))

  @property
  def tokenizer(self) -> TextTokenizer:
    return self.text_tokenizer

  @property
  def max_prompt_tokens(self) -> int:
    return self.max_prompt_length

  @property
  def max_response_tokens(self) -> int:
    return self.max_response_length

  def with_records(self, records: Sequence[dict[str, Any]]) -> "DatasetTask":
    """The same task over other rows (e.g. the held-out split)."""
    return dataclasses.replace(self, records=tuple(records))

  def problem(self, index: int) -> Problem:
    row = self.records[index]
    value = row[self.prompt_field]
    system = row[self.system_field] if self.system_field else self.system_prompt
    system = str(system) if system else None
    messages = None
    if _is_conversation(value):  # the conversational format: chat messages
      has_system = any(m["role"] == "system" for m in value)
      messages = tuple(([] if has_system or system is None
                        else [{"role": "system", "content": system}])
                       + [{"role": m["role"], "content": m["content"]} for m in value])
      value = value[-1]["content"]
    elif not isinstance(value, str):
      raise DatasetError(f"row {index}: column {self.prompt_field!r} holds "
                         f"{type(value).__name__} {value!r}; expected the prompt's text or a "
                         "list of chat messages ({'role': ..., 'content': ...})")
    return Problem(prompt=value,
                   solution=str(row[self.solution_field]) if self.solution_field else "",
                   targets={"index": np.asarray(index, np.int32)}, system=system,
                   messages=messages)

  def problems(self) -> list[Problem]:
    return [self.problem(i) for i in range(len(self.records))]

  def prompt_problems(self, size: int, rng: np.random.Generator) -> list[Problem]:
    """Every row once (the RL steps shuffle them by epoch); ``size`` is ignored."""
    del size, rng
    return self.problems()

  def sample(self, rng: np.random.Generator) -> Problem:
    return self.problem(int(rng.integers(len(self.records))))

  def score(self, completion: str, targets) -> float:
    """The reward of ``completion`` to the row ``targets["index"]``."""
    row = self.records[int(targets["index"])]
    fields = {k: v for k, v in row.items() if k not in (self.prompt_field, self.answer_field)}
    prompt = row[self.prompt_field]  # as the dataset has it: text or chat messages
    value = float(self.reward_fn(prompt, completion, row[self.answer_field],
                                 **self._keywords(fields)))
    if not math.isfinite(value):
      raise NonFiniteRewardError(f"returned {value}: rewards must be finite numbers")
    self._recent.append({"prompt": prompt if isinstance(prompt, str) else prompt[-1]["content"],
                         "completion": completion, "reward": value})
    return value

  def take_samples(self) -> list[dict[str, Any]]:
    """The last few (prompt, completion, reward) scored since the previous call."""
    samples = []
    while self._recent:
      samples.append(self._recent.popleft())
    return samples

  def score_texts(self, indices: Sequence[int], completions: Sequence[str]) -> list[float]:
    """Rewards of completions to rows, on host threads (for evaluation)."""
    samples = [(text, {"index": index}) for index, text in zip(indices, completions)]
    rewards = call_all_with_timeout(self.score, samples, self.timeout, self.threads)
    return [float(r) for r in rewards]

  def reward(self, targets, tokens_RxL, lengths_R):
    return self._reward(targets, tokens_RxL, lengths_R)
