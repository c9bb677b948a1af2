"""One reward call on one dataset row: ``reward_fn(prompt, completion, answer,
**fields)`` on *copies* of the row's values, its result checked (``reward_values``).

Copies, because a reward function is user code: one that pops from its answer list or
appends to the prompt's chat messages would otherwise change the row for every later
epoch, evaluation and logged sample. A picklable callable, so that worker processes
can run it; a reward named on the command line (``reward_spec``) is imported anew in
the worker rather than pickled (functions of a file loaded by path do not unpickle).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from specrl_jax.rl.tasks.dataset import DatasetError
from specrl_jax.rl.tasks.reward_values import reward_value
from specrl_jax.rl.tasks.rewards import TextReward, keyword_filter, resolve_reward

# What a reward's first three arguments are called when its signature cannot be read.
RESERVED = ("prompt", "completion", "answer")


def positional_names(fn: TextReward) -> tuple[str, ...]:
  """The names of the three arguments ``fn`` receives positionally (a column of the
  same name would be passed twice)."""
  try:
    parameters = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    return RESERVED
  names = []
  for parameter in parameters[:3]:
    if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
      break
    if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
      names.append(parameter.name)
  return tuple(names)


class RowScorer:
  """``scorer(completion, {"index": row}) -> float``: the reward of a completion to
  row ``index`` of ``records``. Refuses, when made, a column that collides with one
  of the reward's own arguments."""

  def __init__(self, records: Sequence[Mapping[str, Any]], reward_fn: TextReward, *,
               prompt_field: str, answer_field: str, reward_name: str = "reward",
               reward_spec: str | None = None):
    self.records = records
    self.reward_fn = reward_fn
    self.prompt_field, self.answer_field = prompt_field, answer_field
    self.reward_name, self.reward_spec = reward_name, reward_spec
    self._keywords = keyword_filter(reward_fn)
    self._check_columns()

  def _check_columns(self) -> None:
    if not self.records:
      return
    others = {k: None for k in self.records[0] if k not in (self.prompt_field, self.answer_field)}
    for name in positional_names(self.reward_fn):
      if name in self._keywords(others):
        raise DatasetError(
            f"dataset column {name!r} collides with the argument {name!r} of the reward "
            f"function {self.reward_name}: it is called as reward(prompt, completion, answer, "
            "**the other columns), so that column cannot be passed as well; rename the column "
            "in the dataset, or read it as the prompt or answer with --data.prompt_field= / "
            "--data.answer_field=")

  def fields(self, index: int) -> tuple[Any, Any, dict[str, Any]]:
    """(prompt, answer, the other columns the reward takes) of row ``index``, copied."""
    row = self.records[index]
    others = {k: v for k, v in row.items() if k not in (self.prompt_field, self.answer_field)}
    return copy.deepcopy((row[self.prompt_field], row[self.answer_field],
                          self._keywords(others)))

  def __call__(self, completion: str, targets: Mapping[str, Any]) -> float:
    prompt, answer, others = self.fields(int(targets["index"]))
    return reward_value(self.reward_fn(prompt, completion, answer, **others))

  def __reduce__(self):
    # A reward named by spec is resolved again where it is unpickled.
    fn = None if self.reward_spec else self.reward_fn
    return (_rebuilt, (self.records, fn, self.prompt_field, self.answer_field,
                       self.reward_name, self.reward_spec))


def _rebuilt(records, fn, prompt_field, answer_field, reward_name, reward_spec) -> RowScorer:
  if fn is None:
    fn, _ = resolve_reward(reward_spec)
  return RowScorer(records, fn, prompt_field=prompt_field, answer_field=answer_field,
                   reward_name=reward_name, reward_spec=reward_spec)
