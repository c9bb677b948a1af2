"""A task made of dataset rows and a reward over text: the prompts are the rows'
prompt column rendered by the policy's own tokenizer, the reward a Python function
``reward(prompt, completion, answer, **fields)`` run on host threads or in worker
processes (``rewards``, ``row_scorer``).

Each problem's reward target is its row index, so the host function finds the row's
prompt, answer and other columns; the compiled step sees only token arrays.

With worker processes, a call that does not return within the timeout or kills its
worker (``os._exit``, a crash, its memory limit) scores ``FAILED_SAMPLE_SCORE`` (0.0)
and is reported (``python_reward.take_failures``) rather than ending the run: one
hostile completion costs its own reward. In this process a timed-out call cannot be
stopped, so it ends the run (``RewardFunctionError``), as any exception or a returned
value that is no finite real number does in either mode.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from specrl_jax.config import check, check_positive_int
from specrl_jax.models.text_tokenizer import TextTokenizer
from specrl_jax.rl.tasks.base import Problem, Task
from specrl_jax.rl.tasks.dataset import DatasetError
from specrl_jax.rl.tasks.python_reward import (
    FAILED_SAMPLE_SCORE, check_options, decode_samples, on_host, record_error, record_failure)
from specrl_jax.rl.tasks.reward_workers import RewardWorkers, SampleError, call_all_with_timeout
from specrl_jax.rl.tasks.rewards import TextReward
from specrl_jax.rl.tasks.row_scorer import RowScorer


def _is_conversation(value) -> bool:
  return (isinstance(value, list) and len(value) > 0
          and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                  and isinstance(m.get("content"), str) for m in value))


# Scored samples kept for the run's log (the metrics JSONL and TensorBoard text), and
# how many scored samples wait to be chosen from at most (a bound when nobody takes them).
SAMPLES_KEPT = 4
PENDING_SAMPLES = 1 << 14


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class DatasetTask(Task):
  """Rows of a dataset scored by ``reward_fn``.

  prompt_field / answer_field: the columns of the prompt text and the answer;
  solution_field: a column of worked solutions for the SFT warm start (None: none);
  system_field: a column of per-row system prompts, else ``system_prompt`` for all
  (None: no system message); max_prompt_length / max_response_length: in tokens
  (``row_checks`` reports longer prompts; responses are cut there); timeout: seconds
  one reward call may run; threads: reward calls at once in this process; workers: N >
  0 runs the calls in N worker processes instead (module docstring), each allowed to
  grow by memory_limit_mb (None: no limit); reward_spec: the ``--reward`` value the
  function came from (workers import it from there; None: the function is pickled);
  skipped_rows: how many unusable rows of its files were left out (a metric).
  Compared by identity (functions do not compare by behaviour), like
  ``PythonRewardTask``.
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
  workers: int = 0
  memory_limit_mb: int | None = None
  reward_spec: str | None = None
  skipped_rows: int = 0
  name: str = "dataset"

  def __post_init__(self):
    owner = "DatasetTask"
    check(len(self.records) > 0, owner, "records", "()", "at least one row")
    for field in ("max_prompt_length", "max_response_length", "threads"):
      value = getattr(self, field)
      check_positive_int(owner, field, value)
    check_options(owner, self.timeout, self.workers, self.memory_limit_mb)
    columns = set(self.records[0])
    for field in ("prompt_field", "answer_field", "solution_field", "system_field"):
      column = getattr(self, field)
      if column is not None and column not in columns:
        raise DatasetError(f"DatasetTask.{field}={column!r} is not a column of the dataset; "
                           f"its columns are {sorted(columns)}")
    scorer = RowScorer(self.records, self.reward_fn, prompt_field=self.prompt_field,
                       answer_field=self.answer_field, reward_name=self.reward_name,
                       reward_spec=self.reward_spec)
    object.__setattr__(self, "_scorer", scorer)
    # (row, sample) of the samples scored for training, until a step's log takes them.
    object.__setattr__(self, "_recent", collections.deque(maxlen=PENDING_SAMPLES))
    object.__setattr__(self, "_recent_lock", threading.Lock())
    pool = None
    if self.workers:
      pool = RewardWorkers(scorer, num_workers=self.workers, timeout=self.timeout,
                           memory_limit_bytes=self.memory_limit_mb and self.memory_limit_mb << 20,
                           failure_score=FAILED_SAMPLE_SCORE)
    object.__setattr__(self, "_pool", pool)

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
    value = row.get(self.prompt_field)
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
                         f"{type(value).__name__} {repr(value)[:80]}; expected the prompt's "
                         "text or a list of chat messages ({'role': ..., 'content': ...})")
    return Problem(prompt=value, solution=self.solution(index),
                   targets={"index": np.asarray(index, np.int32)}, system=system,
                   messages=messages)

  def solution(self, index: int) -> str:
    """Row ``index``'s worked solution ("" without a solution column); a null one is
    refused, never trained on as the text "None"."""
    if not self.solution_field:
      return ""
    value = self.records[index].get(self.solution_field)
    if value is None or not isinstance(value, (str, int, float)) or isinstance(value, bool):
      raise DatasetError(f"row {index}: column {self.solution_field!r} holds "
                         f"{type(value).__name__} {repr(value)[:80]}; expected the worked "
                         "solution's text")
    return str(value)

  def problems(self) -> list[Problem]:
    return [self.problem(i) for i in range(len(self.records))]

  def prompt_problems(self, size: int, rng: np.random.Generator) -> list[Problem]:
    """Every row once (the RL steps shuffle them by epoch); ``size`` is ignored."""
    del size, rng
    return self.problems()

  def sample(self, rng: np.random.Generator) -> Problem:
    return self.problem(int(rng.integers(len(self.records))))

  def score(self, completion: str, targets) -> float:
    """The reward of ``completion`` to the row ``targets["index"]``, in this process."""
    return self._scorer(completion, targets)

  def _score_all(self, samples: Sequence[tuple[str, dict]]) -> list[float]:
    """Rewards of (completion, targets) samples, in sample order; SampleError for
    the first that fails (workers: timeouts and deaths score FAILED_SAMPLE_SCORE)."""
    if self._pool is None:
      return call_all_with_timeout(self._scorer, samples, self.timeout, self.threads)
    rewards = self._pool.score(samples)
    for error in self._pool.take_failures():
      record_failure(self.reward_name, error, samples[error.index][0])
    return rewards

  def _keep_samples(self, samples, rewards) -> None:
    with self._recent_lock:
      for (completion, targets), value in zip(samples, rewards):
        row = int(targets["index"])
        prompt = self.records[row][self.prompt_field]
        self._recent.append((row, {"prompt": prompt if isinstance(prompt, str)
                                   else prompt[-1]["content"],
                                   "completion": completion, "reward": float(value)}))

  def take_samples(self, rows: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """A few (prompt, completion, reward) scored for training since the previous call.

    rows: the step's rows in step order: then the first ``SAMPLES_KEPT`` samples of
    those rows in sample order (by the row's place in the step, then the group's
    order), whatever order the rollout shards' reward calls ran in, and the samples
    of other rows (a batch scored ahead, async) stay for their own step. None: the
    last ``SAMPLES_KEPT`` scored.
    """
    with self._recent_lock:
      if rows is None:
        kept = [sample for _, sample in list(self._recent)[-SAMPLES_KEPT:]]
        self._recent.clear()
        return kept
      place = {}
      for position, row in enumerate(rows):
        place.setdefault(int(row), position)
      mine = [(place[row], order, sample) for order, (row, sample) in enumerate(self._recent)
              if row in place]
      others = [(row, sample) for row, sample in self._recent if row not in place]
      self._recent.clear()
      self._recent.extend(others)
    return [sample for *_, sample in sorted(mine, key=lambda m: m[:2])[:SAMPLES_KEPT]]

  def score_texts(self, indices: Sequence[int], completions: Sequence[str]) -> list[float]:
    """Rewards of completions to rows (for evaluation; not kept as samples)."""
    samples = [(text, {"index": index}) for index, text in zip(indices, completions)]
    return [float(r) for r in self._score_all(samples)]

  def _host(self, targets, tokens_RxL, lengths_R) -> np.ndarray:
    samples = decode_samples(self.text_tokenizer, targets, tokens_RxL, lengths_R)
    try:
      rewards = self._score_all(samples)
    except SampleError as error:  # raised on the host after the step (python_reward)
      record_error(self.reward_name, error, samples[error.index][0])
      return np.full(len(samples), np.nan, np.float32)
    self._keep_samples(samples, rewards)
    return np.asarray(rewards, np.float32)

  def reward(self, targets, tokens_RxL, lengths_R):
    return on_host(self._host, targets, tokens_RxL, lengths_R)
