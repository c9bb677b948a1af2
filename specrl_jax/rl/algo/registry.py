"""Registries by name: how a family of choices (aggregation modes, policy objectives,
advantage estimators) grows without editing the code that picks one.

A config names its choice as a string, validated against the registry when the config
is built, so a misspelt name fails before anything compiles and lists what exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

Fn = TypeVar("Fn", bound=Callable)


def registrar(kind: str, table: dict[str, Fn]) -> Callable[[str], Callable[[Fn], Fn]]:
  """A ``register(name)`` decorator adding functions to ``table``; ``kind`` names the
  family in the error a second registration of one name raises."""
  def register(name: str) -> Callable[[Fn], Fn]:
    if not isinstance(name, str) or not name:
      raise ValueError(f"a {kind} is registered under a non-empty string, not {name!r}")

    def add(function: Fn) -> Fn:
      if name in table:
        raise ValueError(f"{kind} {name!r} is already registered")
      table[name] = function
      return function
    return add
  return register
