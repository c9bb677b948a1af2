"""Plain generation (``sj.generate`` without a drafter) and the decoding that plain and
speculative generation share: validated prompts laid out and placed on the mesh, then
decoded whole or split over the mesh's batch shards, with plain rounds or those of a
round hook (``sampling.rollout``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from specrl_jax.config import SamplingParams
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling import sharded
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.inputs import check_arguments
from specrl_jax.sampling.plan import RolloutPlan, plan_for_prompts
from specrl_jax.sampling.programs import bucket_inputs, trim
from specrl_jax.sampling.results import GenerateOutput, raise_if_exhausted, to_output
from specrl_jax.sampling.compaction import compaction_stats
from specrl_jax.sampling.rollout import generate_on_shards, generate_whole, widths_of
from specrl_jax.sampling.hooks import RoundHook

# (graphdef, params, hook_params, inputs, rng, layout, placement) -> GenerateOutput.
DecodeFn = Callable[..., GenerateOutput]


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *,
             sampling: SamplingParams = SamplingParams(), rng: jax.Array | None = None,
             engine: EngineConfig = EngineConfig(), mesh: Mesh | None = None
             ) -> GenerateOutput:
  """Samples a response for every prompt with plain decoding (``sj.generate`` without
  a drafter, which documents the arguments)."""
  prompts, rng = check_arguments(model.config, prompts, sampling=sampling, rng=rng,
                                 drafter=None, spec=None)
  return decode(model, prompts, rng, sampling=sampling, engine=engine, mesh=mesh)


def decode(model: Transformer, prompts: list[list[int]], rng: jax.Array, *,
           sampling: SamplingParams, engine: EngineConfig, mesh: Mesh | None,
           rounds: RoundHook | None = None, decode_fn: DecodeFn | None = None) -> GenerateOutput:
  """Decodes validated ``prompts`` with plain rounds or the round hook ``rounds``, as
  their ``plan.plan_for_prompts`` lays them out.

  decode_fn: replaces the whole-rollout program (the adaptive engine's host loop): it
  gets the placed, unbucketed inputs; meshes with batch shards do not run it.
  """
  graphdef, params = nnx.split(model)
  plan, inputs, blocks = plan_for_prompts(model.config, prompts, sampling=sampling,
                                          engine=engine, rounds=rounds, mesh=mesh,
                                          params=params)
  params, hook_params, placement = plan.place(
      params, rounds.params() if rounds is not None else ())
  if blocks is not None:
    return _decode_on_shards(plan, graphdef, params, hook_params, inputs, blocks, rng,
                             sampling=sampling, placement=placement)
  layout = plan.layout
  if decode_fn is None:
    inputs, layout = bucket_inputs(inputs, layout, plan.engine)
  if mesh is not None:
    inputs, rng = sharded.replicate(mesh, (inputs, rng))
  if decode_fn is not None:
    return decode_fn(graphdef, params, hook_params, inputs, rng, layout, placement)
  return trim(generate_whole(graphdef, params, inputs, rng, sampling=sampling, layout=layout,
                             rounds=rounds, hook_params=hook_params, placement=placement),
              len(prompts))


def _decode_on_shards(plan: RolloutPlan, graphdef, params, hook_params, inputs: tuple,
                      blocks: sharded.RequestBlocks, rng, *, sampling: SamplingParams,
                      placement: str | None) -> GenerateOutput:
  """The whole rollout with the requests split over the mesh's batch shards, each
  shard's engine on its contiguous block (one compiled program for all shards)."""
  mesh, layout, rounds = plan.mesh, plan.layout, plan.rounds
  start = time.perf_counter()
  final = generate_on_shards(graphdef, params, hook_params, sharded.replicate(mesh, rng),
                             *sharded.on_rows(mesh, inputs), mesh=mesh, sampling=sampling,
                             layout=layout, rounds=rounds)
  final = jax.device_get(final)
  seconds = time.perf_counter() - start
  if np.any(final.pool.exhausted):
    raise_if_exhausted(final.replace(pool=final.pool.replace(exhausted=True)), layout,
                        (inputs[0][0],))
  counters = dict(sharded.sum_shards(final.counters),
                  request_rounds_R=blocks.gather_rows(final.counters["request_rounds_R"]))
  merged = final.replace(out_tokens_RxL=blocks.gather_rows(final.out_tokens_RxL),
                         out_log_probs_RxL=blocks.gather_rows(final.out_log_probs_RxL),
                         out_lengths_R=blocks.gather_rows(final.out_lengths_R),
                         counters=counters)
  output = to_output(merged, seconds, rounds, placement=placement, shards=len(blocks.real))
  if layout.compaction_min_width:
    # Shards compact on their own; their rounds per width are summed.
    output.stats["compaction"] = compaction_stats(counters, widths_of(layout))
  return output
