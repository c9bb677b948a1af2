"""Command-line overrides and JSON records of nested frozen-dataclass configs.

    config = apply_overrides(config, ["--rl.engine.num_slots=4", "--learner.lora.rank=8"])

An override names a field by its dotted path through nested sections and is parsed to
that field's type, so `--rl.steps=ten` fails with the field and the value; a section
that is off (``X | None``, e.g. ``learner.lora``) starts from its defaults.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from specrl_jax.config import ConfigError


def _parse(text: str, current: Any, annotation: Any, path: str) -> Any:
  """``text`` as a value of the field's type (the annotation, else the default's)."""
  origin = typing.get_origin(annotation)
  args = typing.get_args(annotation)
  if text.lower() == "none" and (current is None or type(None) in args):
    return None
  kind = type(current) if current is not None else next(a for a in args if a is not type(None))
  try:
    if kind is bool:
      lowered = text.lower()
      if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(text)
      return lowered in ("true", "1", "yes")
    if kind is tuple or origin is tuple:
      element = (args[0] if args else type(current[0]) if current else int)
      return tuple(element(part) for part in text.strip("()").split(",") if part.strip())
    return kind(text)
  except (ValueError, TypeError, StopIteration):
    raise ConfigError(f"--{path}={text!r} is invalid: expected a value of type "
                      f"{getattr(kind, '__name__', kind)}.") from None


def _optional_section(owner: type, name: str) -> Any:
  """A default instance of the dataclass in field ``name``'s ``X | None`` annotation."""
  args = typing.get_args(typing.get_type_hints(owner).get(name))
  kinds = [a for a in args if dataclasses.is_dataclass(a)]
  return kinds[0]() if kinds else None


def _replace(config: Any, names: Sequence[str], text: str, path: str) -> Any:
  fields = {f.name: f for f in dataclasses.fields(config)}
  if names[0] not in fields:
    raise ConfigError(f"--{path} is not a config field: {type(config).__name__} has "
                      f"{sorted(fields)}.")
  current = getattr(config, names[0])
  if len(names) > 1:
    if current is None:  # an optional section that is off (e.g. learner.lora) starts
      current = _optional_section(type(config), names[0])  # from its defaults
    if not dataclasses.is_dataclass(current):
      raise ConfigError(f"--{path}: {names[0]} is a value, not a section.")
    value = _replace(current, names[1:], text, path)
  else:
    if dataclasses.is_dataclass(current):
      raise ConfigError(f"--{path} names a section; set one of its fields, e.g. "
                        f"--{path}.{dataclasses.fields(current)[0].name}=...")
    hints = typing.get_type_hints(type(config))
    value = _parse(text, current, hints.get(names[0]), path)
  return dataclasses.replace(config, **{names[0]: value})


def apply_overrides(config: Any, overrides: Sequence[str]) -> Any:
  """Applies ``--section.field=value`` overrides in order."""
  for override in overrides:
    if not override.startswith("--") or "=" not in override:
      raise ConfigError(f"override {override!r} is invalid: expected --section.field=value.")
    path, text = override[2:].split("=", 1)
    config = _replace(config, path.split("."), text, path)
  return config


def to_dict(config: Any) -> dict[str, Any]:
  return dataclasses.asdict(config)


def _from_record(kind: type, record: dict[str, Any]) -> Any:
  hints = typing.get_type_hints(kind)
  values = {}
  for field in dataclasses.fields(kind):
    if field.name not in record:
      continue  # a field the record predates takes its default
    value = record[field.name]
    sections = [a for a in (hints[field.name], *typing.get_args(hints[field.name]))
                if dataclasses.is_dataclass(a)]
    if isinstance(value, dict) and sections:
      value = _from_record(sections[0], value)
    elif isinstance(value, list):
      value = tuple(value)
    values[field.name] = value
  return kind(**values)


def from_dict_of(kind: type, record: dict[str, Any]) -> Any:
  """The ``kind`` config ``to_dict`` wrote (e.g. a run's config.json; lists become
  tuples); sections or fields it lacks take their defaults, fields it has that the
  config no longer has are ignored."""
  return _from_record(kind, record)
