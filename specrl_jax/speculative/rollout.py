"""Speculative rounds wired into the sampling engine's decode loop.

``Speculation`` is the engine's round hook for a drafter (``sampling.rollout``): it
adds the drafter's KV layers, state and counters, prefills the drafter with the
prompts, brings an idle drafter back in step and runs speculative rounds of its
topology, or, for an empty topology and a drafter that catches up, plain rounds that
show the drafter the target's output (adaptive speculation's k = 0). ``rollout`` is the
whole rollout with the drafter named by its static arguments, as RL steps compile it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import SamplingParams, SpecConfig
from specrl_jax.kv.paged import LayerOffset
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling import rollout as engine
from specrl_jax.sampling.engine import DecodeState
from specrl_jax.sampling.layout import Layout
from specrl_jax.sampling.plain import plain_round
from specrl_jax.speculative.catch_up import catch_up_drafter
from specrl_jax.speculative.drafters.base import Drafter, RoundInputs
from specrl_jax.speculative.round import speculative_round
from specrl_jax.speculative.topology import TreeTopology


@dataclasses.dataclass(frozen=True, kw_only=True)
class Speculation:
  """The static speculative arguments of a decode program, as the engine's round hook.

  max_pending: see ``draft_tree`` (an adaptive engine that switches draft lengths passes
  its longest one's)."""
  drafter: Drafter
  topology: TreeTopology
  draft_mode: str
  max_pending: int | None = None

  @property
  def hidden_layers(self) -> tuple[int, ...]:
    return self.drafter.hidden_layers

  def params(self) -> Any:
    return self.drafter.params()

  def kv_layers(self) -> tuple:
    return self.drafter.kv_layers()

  def init_state(self, num_slots: int, counters: dict) -> tuple[Any, dict]:
    depth = self.topology.depth
    counters = dict(counters, draft_rounds=jnp.int32(0),
                    accepted_per_position=jnp.zeros((depth,), jnp.int32),
                    drafted_per_position=jnp.zeros((depth,), jnp.int32))
    return self.drafter.init_state(num_slots), counters

  def prefill(self, params, state: DecodeState, prefill_kv, num_layers: int, tokens_UxT,
              lengths_U, target_output) -> tuple[DecodeState, Any]:
    drafter_state, view = self.drafter.prefill(
        params, state.drafter, LayerOffset(inner=prefill_kv, offset=num_layers), tokens_UxT,
        lengths_U, target_output)
    return state.replace(drafter=drafter_state), view.inner

  def loop(self, model: Transformer, params, state: DecodeState, sampling: SamplingParams):
    """(state, round_fn, on_admit) of the decode loop."""
    drafter, topology = self.drafter, self.topology

    def on_admit(s, admit_N, prompt_N, prompts):
      return s.replace(drafter=drafter.on_admit(params, s.drafter, admit_N,
                                                prompts.lengths_U[prompt_N]))

    if topology.depth == 0 and drafter.catches_up:
      return state, (lambda s: idle_round(model, drafter, params, s, sampling)), on_admit
    if drafter.catches_up:
      # After plain rounds that left the drafter idle (adaptive k = 0); otherwise a no-op.
      state = catch_up_drafter(drafter, params, state, model.config.num_layers)

    def round_fn(s):
      return speculative_round(model, drafter, params, s, sampling, topology, self.draft_mode,
                               self.max_pending)

    return state, round_fn, on_admit

  def compact_state(self, drafter_state, slots_W):
    return self.drafter.compact_state(drafter_state, slots_W)

  def stats(self, final: DecodeState, *, placement: str | None = None,
            shards: int | None = None) -> dict[str, Any]:
    """What a rollout reports of its drafting. shards: the final state stacks this many
    batch shards (each drafter's own stats then)."""
    stats = acceptance_stats(final.counters)
    if shards is None:
      stats["drafter"] = self.drafter.stats(final.drafter)
    else:
      stats["drafter_per_shard"] = [
          self.drafter.stats(jax.tree.map(lambda x, s=shard: x[s], final.drafter))
          for shard in range(shards)]
    if placement is not None:
      stats["drafter_sharding"] = placement
    return stats


def acceptance_length(accepted_per_position, draft_rounds):
  """Tokens per target call in the rounds that drafted: 1 + accepted drafts / drafted
  rounds, and 1 when nothing was drafted (docs/metrics.md).

  Traceable on jax arrays; host numbers stay in numpy (float64), so host stats read
  exactly what they did before there was one formula for both.
  """
  xp = jnp if isinstance(accepted_per_position, jax.Array) or isinstance(
      draft_rounds, jax.Array) else np
  rounds = xp.maximum(draft_rounds, 1)
  return xp.where(xp.asarray(draft_rounds) > 0,
                  1.0 + xp.sum(accepted_per_position) / rounds, 1.0)


def acceptance_stats(counters: dict) -> dict[str, Any]:
  """Acceptance length and per-position acceptance from a rollout's counters."""
  drafted_rounds = int(counters.get("draft_rounds", 0))
  if not drafted_rounds:
    return {"acceptance_length": 1.0, "per_position_acceptance": []}
  accepted = np.asarray(counters["accepted_per_position"])
  # Of the drafts at each position, the share accepted (a position is drafted only by
  # chains at least that long).
  drafted = np.asarray(counters["drafted_per_position"])
  return {"acceptance_length": float(acceptance_length(accepted, drafted_rounds)),
          "per_position_acceptance": (accepted[drafted > 0] / drafted[drafted > 0]).tolist(),
          "draft_rounds": drafted_rounds}


def idle_round(model: Transformer, drafter: Drafter, drafter_params, state: DecodeState,
               sampling: SamplingParams) -> DecodeState:
  """A plain round that keeps an idle drafter that ``catches_up`` in step (adaptive
  speculation with k = 0): it is shown the target's output through ``record``."""
  num_layers = model.config.num_layers

  def record(s: DecodeState, out):
    drafter_state, drafter_kv = drafter.record(
        drafter_params, s.drafter, LayerOffset(inner=out.kv, offset=num_layers),
        RoundInputs.of(s), out)
    return s.replace(drafter=drafter_state), drafter_kv.inner

  return plain_round(model, state, sampling, hidden_layers=drafter.hidden_layers,
                     observe=record)


def speculation(config, sampling: SamplingParams, drafter=None, spec: SpecConfig | None = None):
  """(bound drafter, topology, draft_mode): the static speculative arguments of
  ``rollout`` (all None for plain decoding)."""
  if drafter is None:
    if spec is not None:
      raise ValueError("spec was given without a drafter: pass drafter=sj.drafters.... to "
                       "decode speculatively, or drop spec for plain decoding.")
    return None, None, None
  spec = spec or SpecConfig()
  # With a greedy target only the argmax can be accepted: rank children instead of
  # sampling them (still exact, and never worse).
  draft_mode = "greedy" if sampling.greedy else spec.draft_mode
  return drafter.bind(config), TreeTopology.from_spec(spec), draft_mode


def rounds_of(drafter: Drafter | None, topology: TreeTopology | None, draft_mode: str | None,
              max_pending: int | None = None) -> Speculation | None:
  """The engine's round hook for these static arguments (None: plain rounds)."""
  if drafter is None:
    return None
  return Speculation(drafter=drafter, topology=topology, draft_mode=draft_mode,
                     max_pending=max_pending)


def rollout(graphdef, params, drafter_params, tokens_UxT, lengths_U, prompt_of_request_R,
            last_request_U, rng, *, sampling: SamplingParams, layout: Layout,
            drafter: Drafter | None, topology: TreeTopology | None, draft_mode: str | None
            ) -> DecodeState:
  """The whole rollout as a traceable function (prefill + decode loop), for callers
  that compile it into a larger step (e.g. a jitted RL step). Returns the final
  DecodeState: ``out_tokens_RxL``, ``out_log_probs_RxL``, ``out_lengths_R``,
  ``counters`` and ``pool.exhausted`` are the results. Use ``prepare`` for the inputs."""
  return engine.rollout(graphdef, params, drafter_params, tokens_UxT, lengths_U,
                        prompt_of_request_R, last_request_U, rng, sampling=sampling,
                        layout=layout, rounds=rounds_of(drafter, topology, draft_mode))


_generate = jax.jit(rollout, static_argnames=("graphdef", "sampling", "layout", "drafter",
                                              "topology", "draft_mode"))
