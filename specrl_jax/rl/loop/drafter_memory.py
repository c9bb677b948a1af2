"""Drafters that draft from the run's earlier rollouts, kept on the host between RL steps.

The history drafter (``speculative.drafters.history``) searches a bank of earlier
rollouts of each prompt. The bank lives in a host-side ``HistoryStore``; each sync step
takes its arrays as an argument of the one compiled step (fixed shapes: no
recompilation as it fills) and returns the step's rollouts, which the store then
remembers. ``RolloutMemory`` is that exchange; ``rollout_memory`` finds it in a
drafter (or its None).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from specrl_jax.config import ConfigError
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.drafters.history import History
from specrl_jax.speculative.drafters.history_store import HistoryStore


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutMemory:
  """The host-side bank of a history drafter and how it meets the compiled step."""
  store: HistoryStore

  def arrays(self) -> dict[str, Any]:
    """The bank as the next rollout reads it (the same shapes every step)."""
    return self.store.device_arrays()

  @staticmethod
  def place(drafter_params: dict[str, Any], bank: dict[str, Any]) -> dict[str, Any]:
    """The drafter's params with this step's bank in them (inside the compiled step)."""
    return dict(drafter_params, bank=bank)

  def observe(self, prompt_tokens_PxT, prompt_lengths_P, tokens_RxC, lengths_R,
              group_size: int) -> None:
    """Remembers a step's rollouts: row r is sample r % G of prompt r // G, its
    response the ``lengths_R[r]`` tokens after the prompt (host arrays)."""
    prompt_tokens_PxT, prompt_lengths_P, tokens_RxC, lengths_R = (
        np.asarray(x) for x in jax.device_get(
            (prompt_tokens_PxT, prompt_lengths_P, tokens_RxC, lengths_R)))
    for row, (tokens_C, length) in enumerate(zip(tokens_RxC, lengths_R)):
      prompt = row // group_size
      start = int(prompt_lengths_P[prompt])
      self.store.add(prompt_tokens_PxT[prompt, :start].tolist(),
                     tokens_C[start:start + int(length)].tolist())


def rollout_memory(drafter: Drafter | None) -> RolloutMemory | None:
  """The drafter's memory of earlier rollouts (a ``History``'s store), else None."""
  if not isinstance(drafter, History):
    return None
  if jax.process_count() > 1:
    raise ConfigError("the history drafter runs in one process: its bank of earlier "
                      "rollouts is kept by the host that ran them (multi-process runs: "
                      "another drafter kind).")
  return RolloutMemory(store=drafter.store)
