"""``specrl_jax.generate``: the public rollout entry point (plain or speculative)."""

from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from specrl_jax.config import SamplingParams, SpecConfig
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.inputs import check_arguments
from specrl_jax.sampling import sharded
from specrl_jax.sampling.programs import bucket_inputs, trim
from specrl_jax.speculative.adaptive import DraftLengthController
from specrl_jax.sampling.layout import (
    engine_layout, group_prompts, pack_prompts, padded_width, prepare, speculation,
    tensor_shards_of, weight_bytes_for,
)
from specrl_jax.sampling.results import (
    GenerateOutput, PagePoolExhaustedError, raise_if_exhausted, to_output,
)
from specrl_jax.sampling.rollout import _generate_sharded, generate_whole, rollout
from specrl_jax.speculative.adaptive_generate import generate_adaptive

# What callers that compile a rollout into a larger program use (``prepare`` packs the
# inputs of ``rollout``), besides ``generate`` itself.
__all__ = ["GenerateOutput", "PagePoolExhaustedError", "generate", "prepare", "rollout"]


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *,
             sampling: SamplingParams = SamplingParams(), rng: jax.Array | None = None,
             drafter=None, spec: SpecConfig | None = None,
             engine: EngineConfig = EngineConfig(),
             controller: DraftLengthController | None = None,
             mesh: Mesh | None = None) -> GenerateOutput:
  """Samples a response for every prompt (repeat a prompt G times for a GRPO group:
  identical prompts are prefilled once and share their KV pages).

  controller: with ``SpecConfig(adaptive=True)``, the draft-length controller to use and
  update; pass the same one to every call of a run (e.g. each RL step) so that what
  it measured carries over instead of being explored again. Default: a fresh one.
  mesh: a ("data", "fsdp", "tensor") mesh (``specrl_jax.parallel.make_mesh``) to decode
    on: the weights and the KV pages' heads are split over "tensor", the requests over
    ("data", "fsdp") in contiguous blocks, each shard with its own page pool and slots
    (``engine`` applies per shard). ``stats["drafter_sharding"]`` says whether the
    drafter was replicated or split like the target.
  """
  config = model.config
  prompts, rng = check_arguments(config, prompts, sampling=sampling, rng=rng,
                                 drafter=drafter, spec=spec)
  adaptive = spec is not None and spec.adaptive
  if controller is not None and not adaptive:
    raise ValueError("controller was given but spec is not adaptive: pass "
                     "spec=sj.SpecConfig(..., adaptive=True) or drop controller.")
  graphdef, params = nnx.split(model)
  engine = sharded.engine_for_mesh(engine, mesh)
  if mesh is not None and sharded.batch_shards(mesh) > 1:
    if adaptive:
      raise ValueError(
          f"adaptive speculation runs on meshes without batch shards: mesh {dict(mesh.shape)} "
          "splits requests over data*fsdp > 1. Use data = fsdp = 1 (tensor parallelism "
          "only), or a fixed SpecConfig(num_draft_tokens=...).")
    return _generate_on_shards(config, graphdef, params, drafter, prompts, rng,
                               sampling=sampling,
                               spec=spec, engine=engine, mesh=mesh)
  inputs, layout, drafter, topology, draft_mode = prepare(
      config, prompts, sampling, engine, drafter, spec,
      weight_bytes=weight_bytes_for(params, engine, mesh), tensor_shards=tensor_shards_of(mesh))
  if not adaptive:
    inputs, layout = bucket_inputs(inputs, layout, engine)
  drafter_params = drafter.params() if drafter is not None else ()
  placement = None
  if mesh is not None:
    sharded.check_mesh(mesh)
    params = sharded.place_weights(params, mesh)
    drafter_params, placement = sharded.place_drafter(drafter_params, params, mesh)
    inputs, rng = sharded.replicate(mesh, (inputs, rng))
  if adaptive:
    output = generate_adaptive(graphdef, params, drafter, inputs, rng, sampling=sampling,
                                layout=layout, topology=topology, draft_mode=draft_mode,
                                rounds_per_decision=spec.rounds_per_decision,
                                controller=controller, drafter_params=drafter_params)
  else:
    output = trim(generate_whole(graphdef, params, drafter, inputs, rng, sampling=sampling,
                                  layout=layout, topology=topology, draft_mode=draft_mode,
                                  drafter_params=drafter_params), len(prompts))
  if placement is not None and drafter is not None:
    output.stats["drafter_sharding"] = placement
  return output


def _generate_on_shards(config, graphdef, params, drafter, prompts: list[list[int]], rng, *,
                        sampling: SamplingParams, spec: SpecConfig | None,
                        engine: EngineConfig, mesh: Mesh) -> GenerateOutput:
  """The whole rollout with the requests split over the mesh's batch shards, each
  shard's engine on its contiguous block (one compiled program for all shards)."""
  sharded.check_mesh(mesh)
  blocks = sharded.RequestBlocks.split(prompts, sharded.batch_shards(mesh))
  width = padded_width(max(len(p) for p in prompts), engine)
  inputs, _ = sharded.pack_blocks(blocks, group_prompts, pack_prompts, width)
  prompt_pages = int(np.max(np.sum(-(-inputs[1] // engine.page_size), axis=1)))
  drafter, topology, draft_mode = speculation(config, sampling, drafter, spec)
  layout = engine_layout(config, prompt_width=width, prompt_pages=prompt_pages,
                         num_requests=len(blocks.blocks[0]), sampling=sampling, engine=engine,
                         drafter=drafter, weight_bytes=weight_bytes_for(params, engine, mesh),
                         tensor_shards=tensor_shards_of(mesh))
  params = sharded.place_weights(params, mesh)
  drafter_params, placement = sharded.place_drafter(
      drafter.params() if drafter is not None else (), params, mesh)
  start = time.perf_counter()
  final = _generate_sharded(graphdef, params, drafter_params, sharded.replicate(mesh, rng),
                            *sharded.on_rows(mesh, inputs), mesh=mesh, sampling=sampling,
                            layout=layout, drafter=drafter, topology=topology,
                            draft_mode=draft_mode)
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
  output = to_output(merged, seconds)
  if drafter is not None:
    output.stats["drafter_sharding"] = placement
    output.stats["drafter_per_shard"] = [
        drafter.stats(jax.tree.map(lambda x, s=shard: x[s], final.drafter))
        for shard in range(len(blocks.real))]
  return output
