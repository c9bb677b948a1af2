"""Prompt datasets on local disk: JSON Lines, Parquet, or a folder written by
``datasets``' ``save_to_disk``, all read with pyarrow.

    records = read_records("train.jsonl")          # list of dicts, one per row
    train, held_out = split_records(records, eval_fraction=0.1, seed=0)

A ``save_to_disk`` folder holds Arrow IPC stream files listed in its state.json; a
DatasetDict folder (several splits) must be named down to one split's folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from specrl_jax.config import ConfigError, check, is_finite_number

SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetError(ConfigError):
  """A dataset file or folder cannot be read as prompts."""


def _arrow_folder(path: str):
  import pyarrow as pa
  if os.path.isfile(os.path.join(path, "dataset_dict.json")):
    splits = sorted(name for name in os.listdir(path)
                    if os.path.isdir(os.path.join(path, name)))
    raise DatasetError(f"{path} is a DatasetDict with splits {splits}: give one split's "
                       f"folder, e.g. {os.path.join(path, splits[0]) if splits else path}")
  state_file = os.path.join(path, "state.json")
  if os.path.isfile(state_file):
    with open(state_file, encoding="utf-8") as f:
      files = [entry["filename"] for entry in json.load(f).get("_data_files", [])]
  else:
    files = sorted(name for name in os.listdir(path) if name.endswith(".arrow"))
  if not files:
    raise DatasetError(f"{path} is a folder without Arrow files: expected a folder written by "
                       "datasets' save_to_disk (state.json and data-*.arrow)")
  tables = []
  for name in files:
    with pa.memory_map(os.path.join(path, name)) as source:
      tables.append(pa.ipc.open_stream(source).read_all())
  return pa.concat_tables(tables)


# pyarrow's JSON reader parses a file in blocks of this many bytes (its default); a
# row longer than a block cannot be parsed, so a failed read is retried with the whole
# file as one block (which also makes the row numbers in its errors count from the
# file's start rather than the block's).
JSON_BLOCK_BYTES = 1 << 20
MAX_BLOCK_BYTES = (1 << 31) - 1


def _read_json_lines(path: str):
  import pyarrow as pa
  import pyarrow.json
  try:
    return pyarrow.json.read_json(path)
  except pa.ArrowInvalid:
    if os.path.getsize(path) <= JSON_BLOCK_BYTES:
      raise
  # One block holding the whole file: rows of any length (memory is the file's size).
  block = min(os.path.getsize(path) + 1, MAX_BLOCK_BYTES)
  return pyarrow.json.read_json(path, read_options=pyarrow.json.ReadOptions(block_size=block))


def _first_character(path: str) -> str:
  with open(path, "rb") as f:
    while chunk := f.read(1 << 16):
      stripped = chunk.lstrip()
      if stripped:
        return stripped[:1].decode("latin-1")
  return ""


def _rows_of(path: str, rows: list[Any], what: str) -> list[dict[str, Any]]:
  for index, row in enumerate(rows):
    if not isinstance(row, dict):
      raise DatasetError(f"dataset {path!r}: {what(index)} is {type(row).__name__} "
                         f"{str(row)[:80]!r}; expected an object {{\"column\": value, ...}}")
  columns = list(dict.fromkeys(name for row in rows for name in row))
  # As pyarrow reads JSON Lines: every row has every column, None where it had none.
  return [{name: row.get(name) for name in columns} for row in rows]


def _read_json_array(path: str) -> list[dict[str, Any]]:
  """A .json file holding one array of row objects (``json.dump(rows, f)``)."""
  with open(path, encoding="utf-8") as f:
    try:
      rows = json.load(f)
    except json.JSONDecodeError as error:
      raise DatasetError(f"dataset {path!r} is not valid JSON: {error} (a .json dataset is "
                         "one array of row objects, or JSON Lines: one object per line)") from None
  return _rows_of(path, rows, lambda index: f"row {index} (counting from 0)")


def _read_json_rows(path: str) -> list[dict[str, Any]]:
  """JSON Lines parsed row by row: what pyarrow refuses to put in one typed column
  (an answer column of texts and lists of texts) is kept as each row has it."""
  rows, lines = [], []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as error:
        raise DatasetError(f"dataset {path!r} line {number} is not valid JSON ({error}): JSON "
                           "Lines needs one JSON object per line") from None
      lines.append(number)
  return _rows_of(path, rows, lambda index: f"line {lines[index]}")


def read_table(path: str | os.PathLike):
  """The dataset at ``path`` as a pyarrow Table (see the module docstring)."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise DatasetError(f"dataset {path!r} does not exist")
  try:
    if os.path.isdir(path):
      return _arrow_folder(path)
    if path.endswith((".jsonl", ".json")):
      return _read_json_lines(path)
    if path.endswith(".parquet"):
      import pyarrow.parquet
      return pyarrow.parquet.read_table(path)
  except DatasetError:
    raise
  except Exception as error:  # pyarrow's own errors name the line or column
    raise DatasetError(f"dataset {path!r} could not be read: {type(error).__name__}: "
                       f"{error} (rows count from 0)") from None
  raise DatasetError(f"dataset {path!r} has an unknown format: expected a file ending in one "
                     f"of {SUFFIXES} or a folder written by datasets' save_to_disk")


def read_records(path: str | os.PathLike, *, required: Sequence[str] = ()) -> list[dict[str, Any]]:
  """The rows of the dataset at ``path`` as dicts; ``required``: column names every
  row must have (named in the error with the columns there are). A .json file may
  hold JSON Lines or one array of rows."""
  path = os.fspath(path)
  if path.endswith(".json") and os.path.isfile(path) and _first_character(path) == "[":
    records = _read_json_array(path)
    columns = list(records[0]) if records else []
  else:
    try:
      table = read_table(path)
      records, columns = table.to_pylist(), table.column_names
    except DatasetError:
      if not (path.endswith((".jsonl", ".json")) and os.path.isfile(path)):
        raise
      records = _read_json_rows(path)  # raises naming the line when pyarrow was right
      columns = list(records[0]) if records else []
  if not records:
    raise DatasetError(f"dataset {path!r} is empty: it has no rows (JSON Lines needs one "
                       "JSON object per line)")
  missing = [name for name in required if name not in columns]
  if missing:
    raise DatasetError(f"dataset {path!r} has no column {missing[0]!r}; its columns "
                       f"are {columns} (set the field names with --data.*_field=)")
  return records


def split_indices(num_rows: int, *, eval_fraction: float, seed: int,
                  held_out: set[int] | None = None) -> tuple[list[int], list[int]]:
  """(train rows, held-out rows) of ``split_records``, as row numbers; ``held_out``: these
  rows instead of drawing them (a resumed run's, on a dataset that changed)."""
  check(is_finite_number(eval_fraction) and 0 <= eval_fraction < 1, "split_records",
        "eval_fraction", eval_fraction, "a fraction in [0, 1)")
  held = (held_out_rows(num_rows, eval_fraction=eval_fraction, seed=seed)
          if held_out is None else held_out)
  return ([i for i in range(num_rows) if i not in held], [i for i in range(num_rows) if i in held])


def split_records(records: Sequence[dict[str, Any]], *, eval_fraction: float, seed: int
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """(train, held out): ``eval_fraction`` of the rows, chosen by a permutation from
  ``seed``, are held out (at least one when the fraction is > 0, never all)."""
  train, held = split_indices(len(records), eval_fraction=eval_fraction, seed=seed)
  return [records[i] for i in train], [records[i] for i in held]


def held_out_rows(num_rows: int, *, eval_fraction: float, seed: int) -> set[int]:
  """The row numbers ``split_records`` holds out of ``num_rows`` rows."""
  count = int(round(eval_fraction * num_rows))
  if eval_fraction > 0:
    count = max(1, count)
  if count >= num_rows:
    raise DatasetError(f"eval_fraction={eval_fraction} holds out all {num_rows} rows; "
                       "lower it or give the held-out rows as a separate file")
  order = np.random.default_rng([seed, 0x5E1]).permutation(num_rows)
  return set(order[:count].tolist())
