"""The files of a Hugging Face model folder: which hold the weights, and reading them.

The weights file is chosen as transformers' ``from_pretrained`` chooses it for a local
folder (transformers 5, ``modeling_utils._get_resolved_checkpoint_files``): the file
config.json names in ``transformers_weights`` when it names one, else
model.safetensors, else model.safetensors.index.json, whose ``weight_map`` lists the
shard files. As in transformers, the shards' own headers say which tensors each
holds; the weight_map's tensor -> shard entries only contribute the set of files.

Every file a folder refers to must lie inside it: entries that are absolute, contain
``..`` or otherwise leave the folder are refused. The test is on the path as written,
not on where symlinks lead, because Hugging Face's hub cache builds every snapshot
folder from symlinks into a shared blobs/ folder next to it.

Every error names the file it is about.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors then reads it)
import numpy as np
from safetensors import SafetensorError, safe_open

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# safetensors dtype -> the name config.json's dtype field gives it. Only floats are
# weights; integer and bool tensors are indices or masks, never a parameter here.
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class HFFormatError(ValueError):
  """A Hugging Face folder this library cannot read, or a model it cannot write."""


def refuse(condition: bool, message: str) -> None:
  if condition:
    raise HFFormatError(message)


def read_json(file: str) -> dict[str, Any]:
  """The JSON object in ``file``; anything else is refused naming the file."""
  try:
    with open(file, encoding="utf-8") as f:
      data = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise HFFormatError(f"{file} is not valid JSON: {error}") from error
  except OSError as error:
    raise HFFormatError(f"{file} cannot be read: {error}") from error
  refuse(not isinstance(data, dict),
         f"{file} holds a JSON {type(data).__name__}; expected an object.")
  return data


def _inside(folder: str, entry: Any, source: str, what: str) -> str:
  """``entry``, a path relative to ``folder``, joined to it; refused if it leaves it."""
  refuse(not isinstance(entry, str) or not entry,
         f"{source}: {what}={entry!r} is not a file name.")
  parts = entry.replace("\\", "/").split("/")
  joined = os.path.join(folder, entry)
  root = os.path.abspath(folder)
  outside = (os.path.isabs(entry) or ".." in parts
             or os.path.commonpath([root, os.path.abspath(joined)]) != root)
  refuse(outside, f"{source}: {what}={entry!r} lies outside the model folder {folder}; "
         "allowed: a path relative to the folder, without '..'.")
  return joined


def weights_file(folder: str, hf_config: dict[str, Any]) -> str:
  """The file transformers reads the weights from: a .safetensors file or an index."""
  config_file = os.path.join(folder, CONFIG_FILE)
  explicit = hf_config.get("transformers_weights")
  if explicit is not None:
    file = _inside(folder, explicit, config_file, "transformers_weights")
    refuse(not explicit.endswith((".safetensors", ".safetensors.index.json")),
           f"{config_file}: transformers_weights={explicit!r} is neither a .safetensors "
           "file nor a .safetensors.index.json index.")
    refuse(not os.path.isfile(file),
           f"{config_file}: transformers_weights={explicit!r} names a file {folder} lacks.")
    return file
  for name in (SINGLE_FILE, INDEX_FILE):
    if os.path.isfile(os.path.join(folder, name)):
      return os.path.join(folder, name)
  raise HFFormatError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}.")


def shard_files(folder: str, index_file: str) -> list[str]:
  """The shard files an index lists, sorted by name (transformers' reading order)."""
  weight_map = read_json(index_file).get("weight_map")
  refuse(not isinstance(weight_map, dict) or not weight_map,
         f"{index_file} lacks a non-empty 'weight_map' object.")
  files = {_inside(folder, entry, index_file, f"weight_map[{name!r}]")
           for name, entry in weight_map.items()}
  missing = sorted(os.path.relpath(f, folder) for f in files if not os.path.isfile(f))
  refuse(bool(missing), f"{index_file} lists shard files {folder} lacks: {missing}")
  return sorted(files)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorInfo:
  """One tensor as a safetensors header describes it, before any data is read."""
  file: str
  dtype: str  # safetensors' spelling: "BF16", "F32", "I64", "BOOL", ...
  shape: tuple[int, ...]


def _open(file: str):
  try:
    return safe_open(file, framework="numpy")
  except (SafetensorError, OSError) as error:
    raise HFFormatError(f"{file} is not a readable safetensors file: {error}") from error


def tensor_infos(folder: str, hf_config: dict[str, Any]) -> dict[str, TensorInfo]:
  """Checkpoint tensor name -> where it is and what its header says, in reading order.

  A tensor held by two shards is refused: transformers would silently keep the later.
  """
  chosen = weights_file(folder, hf_config)
  files = shard_files(folder, chosen) if chosen.endswith(".json") else [chosen]
  infos: dict[str, TensorInfo] = {}
  for file in files:
    with _open(file) as f:
      for name in f.keys():
        if name in infos:
          raise HFFormatError(f"tensor {name!r} is in both {infos[name].file} and {file}; "
                              "allowed: one shard per tensor.")
        piece = f.get_slice(name)
        infos[name] = TensorInfo(file=file, dtype=piece.get_dtype(),
                                 shape=tuple(piece.get_shape()))
  return infos


def weights_dtype(infos: dict[str, TensorInfo]) -> str | None:
  """The first floating tensor's dtype, as transformers' dtype="auto" finds it when
  config.json names none; None when the checkpoint has no floating tensor."""
  return next((FLOAT_DTYPES[i.dtype] for i in infos.values() if i.dtype in FLOAT_DTYPES),
              None)


def read_tensors(infos: dict[str, TensorInfo],
                 names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (name, array) in the checkpoint's own dtype, opening each file once.

  bfloat16 arrives as an ml_dtypes.bfloat16 array: no float32 copy on the host.
  """
  by_file: dict[str, list[str]] = {}
  for name in names:
    by_file.setdefault(infos[name].file, []).append(name)
  for file, file_names in by_file.items():
    with _open(file) as f:
      for name in file_names:
        try:
          array = f.get_tensor(name)
        except (SafetensorError, OSError, TypeError) as error:
          raise HFFormatError(f"{file}: tensor {name!r} cannot be read: {error}") from error
        yield name, array
