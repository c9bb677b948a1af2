"""The fingerprint of the data a run trains and evaluates on, kept in its directory, so
that a resume on changed data is refused naming what changed.

    <directory>/data.json   {"path", "rows": [hash per row], "held_out": [row numbers],
                             "eval_path", "eval_rows": [hash per row]}

A row's hash is that of its JSON (keys sorted), so the difference between two
fingerprints says which rows were added, removed or edited. Resuming on a changed
dataset is refused unless ``--data.allow_changed_dataset=true``; then the rows held
out so far stay held out (an edited one too), rows added are trained on, and the
held-out split is never drawn anew over the new row count (that would train on rows
evaluated so far, and evaluate rows trained on).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from specrl_jax.config import ConfigError
from specrl_jax.rl.app import run_directory
from specrl_jax.rl.app.data_section import DataSection
from specrl_jax.rl.tasks.dataset import held_out_rows, read_records

FILE = "data.json"
SHOWN = 5  # row numbers named per kind of change


def row_hashes(records: Sequence[dict[str, Any]]) -> list[str]:
  """A short hash of each row's content (its JSON with sorted keys)."""
  return [hashlib.sha256(json.dumps(row, sort_keys=True, ensure_ascii=False, default=repr)
                         .encode()).hexdigest()[:16] for row in records]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Changes:
  """How rows moved from an old fingerprint to a new one. ``matched``: new row number
  -> old row number, for rows kept (same content) and rows edited (same place)."""
  added: tuple[int, ...]
  removed: tuple[int, ...]
  edited: tuple[int, ...]
  matched: dict[int, int]

  def __bool__(self) -> bool:
    return bool(self.added or self.removed or self.edited)

  def describe(self) -> str:
    def rows(kind: str, numbers: tuple[int, ...]) -> str:
      shown = ", ".join(map(str, numbers[:SHOWN])) + (", ..." if len(numbers) > SHOWN else "")
      return f"{len(numbers)} rows {kind} (rows {shown})"
    parts = [rows(kind, numbers) for kind, numbers in (
        ("added", self.added), ("removed", self.removed), ("edited", self.edited)) if numbers]
    return "; ".join(parts)


def changes(old: Sequence[str], new: Sequence[str]) -> Changes:
  """The rows added (new row numbers), removed (old numbers) and edited (new numbers)
  from the row hashes ``old`` to ``new``."""
  added, removed, edited, matched = [], [], [], {}
  matcher = difflib.SequenceMatcher(None, list(old), list(new), autojunk=False)
  for tag, i1, i2, j1, j2 in matcher.get_opcodes():
    paired = min(i2 - i1, j2 - j1) if tag == "replace" else (i2 - i1 if tag == "equal" else 0)
    matched.update({j1 + n: i1 + n for n in range(paired)})
    if tag == "replace":
      edited.extend(range(j1, j1 + paired))
    added.extend(range(j1 + paired, j2))
    removed.extend(range(i1 + paired, i2))
  return Changes(added=tuple(added), removed=tuple(removed), edited=tuple(edited),
                 matched=matched)


def record(data: DataSection, rows: list[str], held_out: set[int] | None,
           eval_rows: list[str] | None) -> dict[str, Any]:
  return {"path": data.path, "rows": rows, "held_out": sorted(held_out or ()),
          "eval_path": data.eval_path, "eval_rows": eval_rows}


class Fingerprint:
  """The data of a run as it is now, checked against what the run recorded."""

  def __init__(self, data: DataSection):
    self.data = data
    self.rows = row_hashes(read_records(data.path))
    self.eval_rows = row_hashes(read_records(data.eval_path)) if data.eval_path else None
    self.held_out = (held_out_rows(len(self.rows), eval_fraction=data.eval_fraction,
                                   seed=data.seed) if data.eval_fraction > 0 else None)

  def resume(self, recorded: dict[str, Any], log: Callable[[str], None]) -> None:
    """Checks the data against the run's record: refused if rows changed (naming what
    changed) unless data.allow_changed_dataset, then the held-out rows carried over."""
    if recorded.get("path") != self.data.path or recorded.get("eval_path") != self.data.eval_path:
      return  # another dataset: the config's own check names the field
    train = changes(recorded.get("rows") or [], self.rows)
    held = changes(recorded.get("eval_rows") or [], self.eval_rows or [])
    found = [f"{path}: {c.describe()}" for path, c in
             ((self.data.path, train), (self.data.eval_path, held)) if c]
    if found and not self.data.allow_changed_dataset:
      raise ConfigError(
          f"the data changed since the run began ({'; '.join(found)}; recorded in its "
          f"{FILE}): resume on the data it began with, give "
          "--data.allow_changed_dataset=true to continue on this data (the rows held out "
          "so far stay held out), or start over in another --output.directory")
    if self.held_out is not None and recorded.get("held_out") is not None:
      before = set(recorded["held_out"])
      self.held_out = {new for new, old in train.matched.items() if old in before}
    if found:
      log(f"warning: the data changed since the run began ({'; '.join(found)}): continuing "
          f"as --data.allow_changed_dataset=true asks; {len(self.held_out or ())} rows held "
          "out as before (added rows are trained on, none drawn anew)")

  def as_record(self) -> dict[str, Any]:
    return record(self.data, self.rows, self.held_out, self.eval_rows)


def recorded(directory: str) -> dict[str, Any] | None:
  return run_directory.read_json(os.path.join(directory, FILE))


def write(directory: str, fingerprint: Fingerprint) -> None:
  run_directory.write_json(os.path.join(directory, FILE), fingerprint.as_record())
