"""The ``data`` section of an experiment: a dataset of prompts, its reward function and
its held-out split (``--dataset`` / ``--reward`` on the command line).

    specrl train --model=PATH --dataset=train.jsonl --reward=rewards.py:score \
        --data.prompt_field=question --data.eval_fraction=0.1 --data.eval_every=10
"""

from __future__ import annotations

import dataclasses

from specrl_jax.config import (check, check_finite_number, check_non_negative_int,
                               check_positive_int, is_finite_number, is_integer)
from specrl_jax.models.text_tokenizer import TextTokenizer
from specrl_jax.rl.tasks.dataset import read_records, split_records
from specrl_jax.rl.tasks.dataset_task import DatasetTask
from specrl_jax.rl.tasks.rewards import resolve_reward


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
  reward_timeout: seconds per call; reward_threads: calls at once; a sample is
  correct for pass@k when its reward is >= correct_threshold.
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
  correct_threshold: float = 1.0  # a sample counts as correct for pass@k at this reward or above
  max_prompt_tokens: int = 512  # rows whose prompt is longer are left out
  max_response_tokens: int = 256  # tokens a rollout may generate
  seed: int = 0  # seed of the held-out split

  def __post_init__(self):
    owner = "DataSection"
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
    check(not (self.eval_every and not self.has_eval), owner, "eval_every", self.eval_every,
          "0 unless held-out rows are given (eval_path or eval_fraction > 0)")

  @property
  def has_eval(self) -> bool:
    return bool(self.eval_path) or self.eval_fraction > 0

  def make(self, text_tokenizer: TextTokenizer) -> tuple[DatasetTask, DatasetTask | None]:
    """(training task, held-out task or None) over the dataset's rows."""
    required = [self.prompt_field, self.answer_field] + [
        name for name in (self.system_field, self.solution_field) if name]
    records = read_records(self.path, required=required)
    held_out = None
    if self.eval_path:
      held_out = read_records(self.eval_path, required=required)
    elif self.eval_fraction > 0:
      records, held_out = split_records(records, eval_fraction=self.eval_fraction,
                                        seed=self.seed)
    fn, name = resolve_reward(self.reward)
    task = DatasetTask(records=tuple(records), text_tokenizer=text_tokenizer, reward_fn=fn,
                       reward_name=name, prompt_field=self.prompt_field,
                       answer_field=self.answer_field,
                       solution_field=self.solution_field or None,
                       system_field=self.system_field or None,
                       system_prompt=self.system_prompt or None,
                       max_prompt_length=self.max_prompt_tokens,
                       max_response_length=self.max_response_tokens,
                       timeout=self.reward_timeout, threads=self.reward_threads)
    return task, task.with_records(held_out) if held_out else None
