"""``specrl_jax.generate``: the public rollout entry point. Without a drafter it decodes
plainly (``sampling.generate``); with one, the same engine runs speculative rounds
(``Speculation``), or adaptive speculation's host loop chooses the draft length."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
from jax.sharding import Mesh

from specrl_jax.config import SamplingParams, SpecConfig
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling import sharded
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.generate import decode
from specrl_jax.sampling.inputs import check_arguments
from specrl_jax.sampling.layout import pack
from specrl_jax.sampling.results import GenerateOutput, PagePoolExhaustedError
from specrl_jax.speculative.adaptive import DraftLengthController
from specrl_jax.speculative.adaptive_generate import adaptive_controller, generate_adaptive
from specrl_jax.speculative.concurrency import ConcurrencyAwareController
from specrl_jax.speculative.rollout import Speculation, rollout, rounds_of, speculation

# What callers that compile a rollout into a larger program use (``prepare`` packs the
# inputs of ``rollout``), besides ``generate`` itself.
__all__ = ["GenerateOutput", "PagePoolExhaustedError", "generate", "prepare", "rollout"]


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *,
             sampling: SamplingParams = SamplingParams(), rng: jax.Array | None = None,
             drafter=None, spec: SpecConfig | None = None,
             engine: EngineConfig = EngineConfig(),
             controller: ConcurrencyAwareController | DraftLengthController | None = None,
             mesh: Mesh | None = None) -> GenerateOutput:
  """Samples a response for every prompt (repeat a prompt G times for a GRPO group:
  identical prompts are prefilled once and share their KV pages).

  controller: with ``SpecConfig(adaptive=True)``, the controller to use and update; pass
    the same one to every call of a run (e.g. each RL step) so that what it measured
    carries over instead of being explored again. Default: a fresh
    ``ConcurrencyAwareController`` (a shape per live width: with
    ``EngineConfig(compaction=True)`` a long-tailed rollout's tail can draft longer than
    its full batch). A ``DraftLengthController`` chooses one chain length for every
    width.
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
  if adaptive and mesh is not None and sharded.batch_shards(mesh) > 1:
    raise ValueError(
        f"adaptive speculation runs on meshes without batch shards: mesh {dict(mesh.shape)} "
        "splits requests over data*fsdp > 1. Use data = fsdp = 1 (tensor parallelism "
        "only), or a fixed SpecConfig(num_draft_tokens=...).")
  rounds = rounds_of(*speculation(config, sampling, drafter, spec))
  decode_fn = None
  if adaptive:
    controller = adaptive_controller(controller, spec.num_draft_tokens, spec.adaptive_trees)
    decode_fn = functools.partial(_adaptive, rounds, sampling=sampling,
                                  rounds_per_decision=spec.rounds_per_decision,
                                  controller=controller)
  return decode(model, prompts, rng, sampling=sampling, engine=engine, mesh=mesh,
                rounds=rounds, decode_fn=decode_fn)


def _adaptive(rounds: Speculation, graphdef, params, drafter_params, inputs, rng, layout,
              placement, *, sampling: SamplingParams, rounds_per_decision: int,
              controller: ConcurrencyAwareController) -> GenerateOutput:
  output = generate_adaptive(graphdef, params, rounds.drafter, inputs, rng, sampling=sampling,
                             layout=layout, topology=rounds.topology,
                             draft_mode=rounds.draft_mode,
                             rounds_per_decision=rounds_per_decision, controller=controller,
                             drafter_params=drafter_params)
  if placement is not None:
    output.stats["drafter_sharding"] = placement
  return output


def prepare(config, prompts: list[list[int]], sampling: SamplingParams, engine: EngineConfig,
            drafter=None, spec: SpecConfig | None = None, *, weight_bytes: int | None = None,
            tensor_shards: int = 1):
  """Host-side packing of validated prompts into static-shape arrays (``sampling.layout.
  pack``, whose memory planning counts the drafter's weights and KV layers).

  Returns (inputs, layout, drafter, topology, draft_mode) where inputs =
  (tokens_UxT, lengths_U, prompt_of_request_R, last_request_U) as device arrays and the
  rest are the static arguments of ``rollout``.
  """
  drafter, topology, draft_mode = speculation(config, sampling, drafter, spec)
  inputs, layout = pack(config, prompts, sampling, engine, rounds=drafter,
                        weight_bytes=weight_bytes, tensor_shards=tensor_shards)
  return inputs, layout, drafter, topology, draft_mode
