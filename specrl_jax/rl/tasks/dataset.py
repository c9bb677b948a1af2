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


def read_table(path: str | os.PathLike):
  """The dataset at ``path`` as a pyarrow Table (see the module docstring)."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise DatasetError(f"dataset {path!r} does not exist")
  try:
    if os.path.isdir(path):
      return _arrow_folder(path)
    if path.endswith((".jsonl", ".json")):
      import pyarrow.json
      return pyarrow.json.read_json(path)
    if path.endswith(".parquet"):
      import pyarrow.parquet
      return pyarrow.parquet.read_table(path)
  except DatasetError:
    raise
  except Exception as error:  # pyarrow's own errors name the line or column
    raise DatasetError(f"dataset {path!r} could not be read: {type(error).__name__}: "
                       f"{error}") from None
  raise DatasetError(f"dataset {path!r} has an unknown format: expected a file ending in one "
                     f"of {SUFFIXES} or a folder written by datasets' save_to_disk")


def read_records(path: str | os.PathLike, *, required: Sequence[str] = ()) -> list[dict[str, Any]]:
  """The rows of the dataset at ``path`` as dicts; ``required``: column names every
  row must have (named in the error with the columns there are)."""
  table = read_table(path)
  missing = [name for name in required if name not in table.column_names]
  if missing:
    raise DatasetError(f"dataset {os.fspath(path)!r} has no column {missing[0]!r}; its columns "
                       f"are {table.column_names} (set the field names with --data.*_field=)")
  if table.num_rows == 0:
    raise DatasetError(f"dataset {os.fspath(path)!r} has no rows")
  return table.to_pylist()


def split_records(records: Sequence[dict[str, Any]], *, eval_fraction: float, seed: int
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """(train, held out): ``eval_fraction`` of the rows, chosen by a permutation from
  ``seed``, are held out (at least one when the fraction is > 0, never all)."""
  check(is_finite_number(eval_fraction) and 0 <= eval_fraction < 1, "split_records",
        "eval_fraction", eval_fraction, "a fraction in [0, 1)")
  return split_at(records, held_out_rows(len(records), eval_fraction=eval_fraction, seed=seed))


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


def split_at(records: Sequence[dict[str, Any]], held: set[int]
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """(the rows not in ``held``, the rows in it), each in file order."""
  return ([r for i, r in enumerate(records) if i not in held],
          [r for i, r in enumerate(records) if i in held])
