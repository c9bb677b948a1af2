"""Field checks shared by the simulator's configs, on top of ``specrl_jax.config``'s.

Every simulator dataclass validates itself at construction, so a negative size, an
acceptance rate outside [0, 1] or an impossible GPU split fails with a message that
names the owner, the field, the bad value and the allowed range.
"""

from __future__ import annotations

from typing import Any

from specrl_jax.config import check, check_finite_number


def unit_interval(owner: str, field: str, value: Any, *, open_low: bool = False) -> None:
  """A probability or efficiency: in [0, 1], or (0, 1] when ``open_low``."""
  if open_low:
    check_finite_number(owner, field, value, above=0, at_most=1)
  else:
    check_finite_number(owner, field, value, at_least=0, at_most=1)


def one_of(owner: str, field: str, value: Any, allowed: tuple) -> None:
  check(value in allowed, owner, field, value, f"one of {allowed}")
