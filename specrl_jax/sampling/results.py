"""What a rollout returns: the final decode state fetched to the host and turned into
``GenerateOutput``, and the error a pool that ran out raises."""

from __future__ import annotations

import dataclasses

from typing import Any

import jax
import numpy as np

from specrl_jax.sampling.engine import DecodeState
from specrl_jax.sampling.layout import Layout
from specrl_jax.sampling.hooks import RoundHook


class PagePoolExhaustedError(RuntimeError):
  """The KV page pool could not hold the live sequences."""


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """Rollouts for R requests with at most L = max_new_tokens tokens each.

  tokens: int32 [R, L], -1 after each response's end (a stop token is included).
  lengths: int32 [R].
  logprobs: float32 [R, L], log-prob of each emitted token under the warped target
    distribution it was sampled from (0 after the end).
  stats: acceptance_length, target_calls, generated_tokens, seconds, request_rounds
    (int [R]: the rounds each request decoded in; lengths - 1 over it is a request's
    tokens per round), ...
  """
  tokens: np.ndarray
  lengths: np.ndarray
  logprobs: np.ndarray
  stats: dict[str, Any]


def fetch_results(state: DecodeState) -> DecodeState:
  """The final state on the host without its KV pages, which the output does not need
  and which dwarf everything else."""
  return jax.device_get(state.replace(kv=None))


def raise_if_exhausted(final: DecodeState, layout: Layout, inputs) -> None:
  if final.pool.exhausted:
    raise PagePoolExhaustedError(
        f"KV page pool exhausted: {layout.num_pages} pages of {layout.page_size} tokens "
        f"cannot hold {layout.num_slots} live sequences of up to "
        f"{layout.max_pages_per_seq * layout.page_size} tokens plus {inputs[0].shape[0]} "
        f"prompts. Raise EngineConfig.num_pages (at least {layout.pages_always_enough} "
        "always suffices) or lower EngineConfig.num_slots.")


def to_output(final: DecodeState, seconds: float, rounds: RoundHook | None = None, **hook_stats
              ) -> GenerateOutput:
  """The output of a fetched final state; ``rounds`` (the round hook) adds its own
  ``stats(final, **hook_stats)``."""
  lengths = np.asarray(final.out_lengths_R)
  counters = {name: np.asarray(value) for name, value in final.counters.items()}
  generated = int(lengths.sum())
  target_calls = int(counters["target_calls"])
  stats: dict[str, Any] = {
      "generated_tokens": generated,
      "target_calls": target_calls,
      "seconds": seconds,
      "tokens_per_second": generated / seconds if seconds > 0 else float("nan"),
      # Rounds each request decoded in (its first token is sampled at admission).
      "request_rounds": counters["request_rounds_R"],
      # Rounds by the number of slots live in them: a long-tailed rollout's tail.
      "rounds_by_live": counters["rounds_by_live"].tolist(),
      # A plain round emits one token.
      "acceptance_length": 1.0,
      "per_position_acceptance": [],
  }
  if rounds is not None:
    stats.update(rounds.stats(final, **hook_stats))
  return GenerateOutput(tokens=np.asarray(final.out_tokens_RxL), lengths=lengths,
                        logprobs=np.asarray(final.out_log_probs_RxL), stats=stats)
