"""Field checks shared by the simulator's configs, on top of ``specrl_jax.config.check``.

Every simulator dataclass validates itself at construction, so a negative size, an
acceptance rate outside [0, 1] or an impossible GPU split fails with a message that
names the owner, the field, the bad value and the allowed range.
"""

from __future__ import annotations

from typing import Any

from specrl_jax.config import check, is_finite_number

_is_number = is_finite_number


def positive_number(owner: str, field: str, value: Any) -> None:
  check(_is_number(value) and value > 0, owner, field, value, "a finite number > 0")


def non_negative_number(owner: str, field: str, value: Any) -> None:
  check(_is_number(value) and value >= 0, owner, field, value, "a finite number >= 0")


def unit_interval(owner: str, field: str, value: Any, *, open_low: bool = False) -> None:
  """A probability or efficiency: in [0, 1], or (0, 1] when ``open_low``."""
  low_ok = value > 0 if open_low else value >= 0
  check(_is_number(value) and low_ok and value <= 1, owner, field, value,
        "a number in (0, 1]" if open_low else "a number in [0, 1]")


def one_of(owner: str, field: str, value: Any, allowed: tuple) -> None:
  check(value in allowed, owner, field, value, f"one of {allowed}")
