"""Dataset rows that cannot be trained on, found and reported before anything runs.

A row is unusable when its prompt is missing, null or not text/chat messages, its
answer is null or missing (a missing answer would reach the reward as None), its
worked solution is null while the SFT warm start reads solutions, its prompt has
characters the tokenizer cannot encode (they would be dropped), or its encoded prompt
is longer than the task's ``max_prompt_length``. ``check_rows`` lists every such row
with why; ``BadRowsError`` is the one-line refusal naming the file, the first rows and
the fix, and ``RowReport.summary`` the warning a run that skips them prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specrl_jax.models.text_tokenizer import TokenizerFormatError, UnknownTextError
from specrl_jax.rl.tasks.dataset import DatasetError
from specrl_jax.rl.tasks.dataset_task import DatasetTask

SHOWN = 5  # rows named in a report; the rest are counted


class BadRowsError(DatasetError):
  """A dataset has rows that cannot be used (and the run was not told to skip them)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BadRow:
  """Row ``row`` (numbered from 0 in its file) and why it cannot be used; ``tokens``:
  the prompt's length when that is the reason."""
  row: int
  reason: str
  tokens: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowReport:
  """The unusable rows among ``num_rows`` rows of ``source``."""
  source: str
  num_rows: int
  bad: tuple[BadRow, ...]
  prompt_field: str
  max_prompt_tokens: int

  @property
  def bad_rows(self) -> frozenset[int]:
    return frozenset(b.row for b in self.bad)

  def summary(self) -> str:
    """One line: how many rows, the first few with why, and what to do."""
    shown = "; ".join(f"row {b.row}: {b.reason}" for b in self.bad[:SHOWN])
    more = f"; and {len(self.bad) - SHOWN} more" if len(self.bad) > SHOWN else ""
    lengths = [b.tokens for b in self.bad if b.tokens is not None]
    fixes = []
    if lengths:
      need = -(-max(lengths) // 16) * 16
      fixes.append(f"{len(lengths)} prompt(s) of field {self.prompt_field!r} are longer than "
                   f"--data.max_prompt_tokens={self.max_prompt_tokens} (the longest has "
                   f"{max(lengths)} tokens): raise it to {need} or shorten them")
    if len(lengths) < len(self.bad):
      fixes.append("fix or remove the other rows" if lengths else "fix or remove these rows")
    fix = "; ".join(fixes)
    return (f"dataset {self.source!r}: {len(self.bad)} of {self.num_rows} rows cannot be used "
            f"(rows count from 0): {shown}{more}. {fix[:1].upper()}{fix[1:]}")


def row_problem(task: DatasetTask, index: int) -> BadRow | None:
  """Why row ``index`` of ``task`` cannot be used, or None when it can."""
  row = task.records[index]
  if row.get(task.answer_field) is None:
    return BadRow(row=index, reason=f"its answer (field {task.answer_field!r}) is missing or null")
  try:
    problem = task.problem(index)  # a missing or non-text prompt, a null solution
    ids = problem.prompt_ids(task.tokenizer)
  except DatasetError as error:
    return BadRow(row=index, reason=str(error).removeprefix(f"row {index}: "))
  except (UnknownTextError, TokenizerFormatError) as error:
    return BadRow(row=index, reason=f"its prompt cannot be encoded: {error}")
  if len(ids) > task.max_prompt_length:
    return BadRow(row=index, reason=f"its prompt has {len(ids)} tokens > "
                                    f"max_prompt_tokens={task.max_prompt_length}",
                  tokens=len(ids))
  return None


def check_rows(task: DatasetTask, *, source: str, rows: Sequence[int] | None = None
               ) -> RowReport:
  """The report of ``task``'s rows (``rows``: only these indices; default all)."""
  indices = range(len(task.records)) if rows is None else rows
  bad = tuple(b for b in (row_problem(task, i) for i in indices) if b is not None)
  return RowReport(source=source, num_rows=len(indices), bad=bad, prompt_field=task.prompt_field,
                   max_prompt_tokens=task.max_prompt_length)


def refuse(report: RowReport) -> BadRowsError:
  """The error of a run that does not skip bad rows."""
  return BadRowsError(f"{report.summary()}; or --data.on_bad_rows=skip to train without them")
