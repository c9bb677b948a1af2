"""The ``data`` section of an experiment: a dataset of prompts, its reward function and
its held-out split (``--dataset`` / ``--reward`` on the command line).

    specrl train --model=PATH --dataset=train.jsonl --reward=rewards.py:score \
        --data.prompt_field=question --data.eval_fraction=0.1 --data.eval_every=10
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specrl_jax.config import (check, check_finite_number, check_non_negative_int,
                               check_positive_int, is_finite_number, is_integer)
from specrl_jax.models.text_tokenizer import TextTokenizer
from specrl_jax.rl.tasks.dataset import read_records, split_indices
from specrl_jax.rl.tasks.dataset_task import DatasetTask
from specrl_jax.rl.tasks.rewards import resolve_reward
from specrl_jax.rl.tasks.row_checks import BadRowsError, RowReport, check_rows, refuse

ON_BAD_ROWS = ("error", "skip")
# Rewards whose calls can hold the GIL past any thread timeout (sympy's big-integer
# powers): run in worker processes unless reward_workers says otherwise.
WORKER_REWARDS = ("math_verify",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
  """path: a .jsonl / .parquet file or a save_to_disk folder ("" = train on
  ``task`` instead); prompt_field / answer_field: its columns (a prompt is text, or a
  list of {"role", "content"} chat messages: the conversational format); system_field: a column
  of system prompts, else system_prompt for every row ("" = none); solution_field: a
  column of worked solutions for the SFT warm start ("" = none: SFT is refused).
  eval_path: held-out rows in a separate file, else eval_fraction of path's rows
  (chosen with seed); eval_every: evaluate every this many RL steps (0 = never),
  eval_k samples per held-out prompt, on at most eval_max_prompts of them (0 = all).
  reward: built-in name, module:function or file.py:function (see rl.tasks.rewards);
  reward_timeout: seconds per call; reward_threads: calls at once; reward_workers:
  run the calls in this many worker processes (0: on threads of this process; None:
  reward_threads workers for math_verify, else 0), each allowed reward_memory_mb more
  memory (None: no limit); a sample is correct for pass@k when its reward is >=
  correct_threshold. on_bad_rows: rows that cannot be used (``rl.tasks.row_checks``)
  are an error naming them ("error"), or are reported and left out ("skip"; the
  metric data_skipped_rows counts them).
  allow_changed_dataset: resume although the dataset's rows changed since the run
  began (``rl.app.data_fingerprint``), the rows held out so far kept held out.
  """
  path: str = ""
  prompt_field: str = "prompt"
  answer_field: str = "answer"
  system_field: str = ""
  system_prompt: str = ""  # a system prompt for every row (when system_field is empty)
  solution_field: str = ""
  eval_path: str = ""
  eval_fraction: float = 0.0  # fraction of path's rows held out for evaluation
  eval_every: int = 0
  eval_k: int = 4  # samples per held-out prompt (pass@1..k)
  eval_max_prompts: int = 0  # held-out prompts evaluated, at most (0 = all)
  reward: str = "exact_match"
  reward_timeout: float = 60.0
  reward_threads: int = 4
  reward_workers: int | None = None
  reward_memory_mb: int | None = None  # extra memory each reward worker may use (None: no limit)
  on_bad_rows: str = "error"
  correct_threshold: float = 1.0  # a sample counts as correct for pass@k at this reward or above
  max_prompt_tokens: int = 512  # rows whose prompt is longer are left out
  max_response_tokens: int = 256  # tokens a rollout may generate
  seed: int = 0  # seed of the held-out split
  allow_changed_dataset: bool = False

  def __post_init__(self):
    owner = "DataSection"
    check(isinstance(self.allow_changed_dataset, bool), owner, "allow_changed_dataset",
          self.allow_changed_dataset, "True or False")
    for name in ("path", "prompt_field", "answer_field", "system_field", "system_prompt",
                 "solution_field", "eval_path", "reward"):
      check(isinstance(getattr(self, name), str), owner, name, getattr(self, name), "a string")
    for name in ("prompt_field", "answer_field", "reward"):
      check(getattr(self, name) != "", owner, name, "''", "a non-empty string")
    check(is_finite_number(self.eval_fraction) and 0 <= self.eval_fraction < 1, owner,
          "eval_fraction", self.eval_fraction, "a fraction in [0, 1)")
    check(not (self.eval_path and self.eval_fraction), owner, "eval_fraction",
          self.eval_fraction, "0 when eval_path is given (one source of held-out rows)")
    for name in ("eval_every", "eval_max_prompts", "seed"):
      check_non_negative_int(owner, name, getattr(self, name))
    for name in ("eval_k", "reward_threads", "max_response_tokens"):
      check_positive_int(owner, name, getattr(self, name))
    check(is_integer(self.max_prompt_tokens) and self.max_prompt_tokens >= 2, owner,
          "max_prompt_tokens", self.max_prompt_tokens, "an integer >= 2")
    check_finite_number(owner, "reward_timeout", self.reward_timeout, above=0, why="(seconds)")
    check_finite_number(owner, "correct_threshold", self.correct_threshold)
    check(self.on_bad_rows in ON_BAD_ROWS, owner, "on_bad_rows", self.on_bad_rows,
          f"one of {ON_BAD_ROWS}")
    if self.reward_workers is not None:
      check_non_negative_int(owner, "reward_workers", self.reward_workers)
    if self.reward_memory_mb is not None:
      check_positive_int(owner, "reward_memory_mb", self.reward_memory_mb)
      check(self.workers > 0, owner, "reward_memory_mb", self.reward_memory_mb,
            "None unless the reward runs in worker processes (--data.reward_workers=N)")
    check(not (self.eval_every and not self.has_eval), owner, "eval_every", self.eval_every,
          "0 unless held-out rows are given (eval_path or eval_fraction > 0)")

  @property
  def has_eval(self) -> bool:
    return bool(self.eval_path) or self.eval_fraction > 0

  @property
  def workers(self) -> int:
    """Reward worker processes (see reward_workers)."""
    if self.reward_workers is not None:
      return self.reward_workers
    return self.reward_threads if self.reward in WORKER_REWARDS else 0

  def make(self, text_tokenizer: TextTokenizer, log: Callable[[str], None] = print,
           held_out_rows: set[int] | None = None) -> tuple[DatasetTask, DatasetTask | None]:
    """(training task, held-out task or None) over the dataset's usable rows: the
    unusable ones are refused, or reported with ``log`` and left out (on_bad_rows).
    The held-out split is drawn over all of the file's rows, so skipping a row never
    moves another between training and evaluation; held_out_rows: the row numbers to
    hold out instead of drawing eval_fraction of them (a resumed run's, on a dataset
    that changed)."""
    required = [self.prompt_field, self.answer_field] + [
        name for name in (self.system_field, self.solution_field) if name]
    fn, name = resolve_reward(self.reward)  # a module that fails to import: before any work
    records = read_records(self.path, required=required)
    task = self._task(records, text_tokenizer, fn, name)
    reports = [check_rows(task, source=self.path)]
    train_rows, held = range(len(records)), None
    if self.eval_path:
      held = task.with_records(read_records(self.eval_path, required=required))
      reports.append(check_rows(held, source=self.eval_path))
      held_rows = range(len(held.records))
    elif self.eval_fraction > 0:
      train_rows, held_rows = split_indices(len(records), eval_fraction=self.eval_fraction,
                                            seed=self.seed, held_out=held_out_rows)
      held = task
    bad = [report for report in reports if report.bad]
    if bad and self.on_bad_rows == "error":
      raise refuse(bad[0])
    for report in bad:
      log(f"warning: --data.on_bad_rows=skip: {report.summary()}; they are left out")
    skipped = sum(len(report.bad) for report in reports)
    train = _usable(task, train_rows, reports[0], "to train on", skipped)
    if held is None:
      return train, None
    return train, _usable(held, held_rows, reports[-1], "held out", skipped)

  def _task(self, records, text_tokenizer, fn, name) -> DatasetTask:
    return DatasetTask(records=tuple(records), text_tokenizer=text_tokenizer, reward_fn=fn,
                       reward_name=name, reward_spec=self.reward, prompt_field=self.prompt_field,
                       answer_field=self.answer_field,
                       solution_field=self.solution_field or None,
                       system_field=self.system_field or None,
                       system_prompt=self.system_prompt or None,
                       max_prompt_length=self.max_prompt_tokens,
                       max_response_length=self.max_response_tokens,
                       timeout=self.reward_timeout, threads=self.reward_threads,
                       workers=self.workers, memory_limit_mb=self.reward_memory_mb)


def _usable(task: DatasetTask, rows, report: RowReport, role: str, skipped: int) -> DatasetTask:
  """``task`` over its ``rows`` that ``report`` found usable; an error if none is."""
  kept = [task.records[i] for i in rows if i not in report.bad_rows]
  if not kept:
    raise BadRowsError(f"{report.summary()}; no usable row is left {role}")
  return dataclasses.replace(task, records=tuple(kept), skipped_rows=skipped)
