"""``specrl_jax.generate``: the public rollout entry point (plain or speculative)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from specrl_jax.config import SamplingParams, SpecConfig
from specrl_jax.kernels.dispatch import resolve_attention
from specrl_jax.kv import pool as page_pool
from specrl_jax.kv.paged import LayerOffset, PagedKV, init_pages
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.engine import DecodeState, EngineConfig, Prompts, is_done, run_loop
from specrl_jax.sampling.inputs import check_arguments
from specrl_jax.sampling.memory import plan_engine_memory, sharded_bytes, tree_bytes
from specrl_jax.sampling.plain import plain_round
from specrl_jax.sampling import sharded
from specrl_jax.sampling.prefill import prefill
from specrl_jax.sampling.programs import PROGRAMS, bucket_inputs, trim
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.adaptive import DraftLengthController
from specrl_jax.speculative.catch_up import catch_up_drafter
from specrl_jax.speculative.round import speculative_round
from specrl_jax.speculative.topology import TreeTopology


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


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static shapes of one compiled generate program."""
  num_slots: int
  page_size: int
  num_pages: int
  max_pages_per_seq: int
  max_new_tokens: int
  continuous: bool
  pages_always_enough: int
  kv_dtype: str = "float32"
  attention: str = "auto"     # EngineConfig.attention, resolved in init_state


def _group_prompts(prompts: list[list[int]]):
  """Distinct prompts (first-seen order), each request's prompt and each prompt's last request."""
  index_of: dict[tuple[int, ...], int] = {}
  prompt_of_request = []
  for prompt in prompts:
    prompt_of_request.append(index_of.setdefault(tuple(prompt), len(index_of)))
  unique = list(index_of)
  last_request = np.zeros(len(unique), np.int32)
  for request, prompt in enumerate(prompt_of_request):
    last_request[prompt] = request
  return unique, np.asarray(prompt_of_request, np.int32), last_request


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
      weight_bytes=_weight_bytes(params, engine, mesh), tensor_shards=_tensor_shards(mesh))
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
    output = _generate_adaptive(graphdef, params, drafter, inputs, rng, sampling=sampling,
                                layout=layout, topology=topology, draft_mode=draft_mode,
                                rounds_per_decision=spec.rounds_per_decision,
                                controller=controller, drafter_params=drafter_params)
  else:
    output = trim(_generate_whole(graphdef, params, drafter, inputs, rng, sampling=sampling,
                                  layout=layout, topology=topology, draft_mode=draft_mode,
                                  drafter_params=drafter_params), len(prompts))
  if placement is not None and drafter is not None:
    output.stats["drafter_sharding"] = placement
  return output


def _generate_whole(graphdef, params, drafter: Drafter | None, inputs, rng, *,
                    sampling: SamplingParams, layout: _Layout,
                    topology: TreeTopology | None, draft_mode: str | None,
                    drafter_params=None) -> GenerateOutput:
  """The whole rollout as one compiled program, timed."""
  if drafter_params is None:
    drafter_params = drafter.params() if drafter is not None else ()
  start = time.perf_counter()
  final = PROGRAMS.call(rollout, (graphdef,),
                        dict(sampling=sampling, layout=layout, drafter=drafter,
                             topology=topology, draft_mode=draft_mode),
                        params, drafter_params, *inputs, rng)
  final = _fetch_results(final)
  seconds = time.perf_counter() - start
  _raise_if_exhausted(final, layout, inputs)
  return _to_output(final, seconds, drafter)


def _generate_on_shards(config, graphdef, params, drafter, prompts: list[list[int]], rng, *,
                        sampling: SamplingParams, spec: SpecConfig | None,
                        engine: EngineConfig, mesh: Mesh) -> GenerateOutput:
  """The whole rollout with the requests split over the mesh's batch shards, each
  shard's engine on its contiguous block (one compiled program for all shards)."""
  sharded.check_mesh(mesh)
  blocks = sharded.RequestBlocks.split(prompts, sharded.batch_shards(mesh))
  width = padded_width(max(len(p) for p in prompts), engine)
  inputs, _ = sharded.pack_blocks(blocks, _group_prompts, pack_prompts, width)
  prompt_pages = int(np.max(np.sum(-(-inputs[1] // engine.page_size), axis=1)))
  drafter, topology, draft_mode = speculation(config, sampling, drafter, spec)
  layout = engine_layout(config, prompt_width=width, prompt_pages=prompt_pages,
                         num_requests=len(blocks.blocks[0]), sampling=sampling, engine=engine,
                         drafter=drafter, weight_bytes=_weight_bytes(params, engine, mesh),
                         tensor_shards=_tensor_shards(mesh))
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
    _raise_if_exhausted(final.replace(pool=final.pool.replace(exhausted=True)), layout,
                        (inputs[0][0],))
  counters = dict(sharded.sum_shards(final.counters),
                  request_rounds_R=blocks.gather_rows(final.counters["request_rounds_R"]))
  merged = final.replace(out_tokens_RxL=blocks.gather_rows(final.out_tokens_RxL),
                         out_log_probs_RxL=blocks.gather_rows(final.out_log_probs_RxL),
                         out_lengths_R=blocks.gather_rows(final.out_lengths_R),
                         counters=counters)
  output = _to_output(merged, seconds)
  if drafter is not None:
    output.stats["drafter_sharding"] = placement
    output.stats["drafter_per_shard"] = [
        drafter.stats(jax.tree.map(lambda x, s=shard: x[s], final.drafter))
        for shard in range(len(blocks.real))]
  return output


def _fetch_results(state: DecodeState) -> DecodeState:
  """The final state on the host without its KV pages and token history, which the
  output does not need and which dwarf everything else."""
  return jax.device_get(state.replace(kv=None, history_NxC=None))


def _raise_if_exhausted(final: DecodeState, layout: _Layout, inputs) -> None:
  if final.pool.exhausted:
    raise PagePoolExhaustedError(
        f"KV page pool exhausted: {layout.num_pages} pages of {layout.page_size} tokens "
        f"cannot hold {layout.num_slots} live sequences of up to "
        f"{layout.max_pages_per_seq * layout.page_size} tokens plus {inputs[0].shape[0]} "
        f"prompts. Raise EngineConfig.num_pages (at least {layout.pages_always_enough} "
        "always suffices) or lower EngineConfig.num_slots.")


def _generate_adaptive(graphdef, params, drafter: Drafter, inputs, rng, *,
                       sampling: SamplingParams, layout: _Layout, topology: TreeTopology,
                       draft_mode: str, rounds_per_decision: int,
                       controller: DraftLengthController | None,
                       drafter_params=None) -> GenerateOutput:
  """Decodes in batches of rounds, re-choosing the chain length (0 = plain) between
  batches with a DraftLengthController. The state is built for the longest chain, so
  every length runs on it; each length compiles once.

  When the controller has settled on plain decoding and no probe of a chain is due,
  the whole rollout is plain decoding's own program, without the drafter's state (no
  drafter prefill, no records): it costs what ``generate`` without a drafter costs, and
  reports no ``stats["drafter"]``."""
  longest = topology.depth
  if controller is None:
    controller = DraftLengthController(k_max=longest)
  elif controller.k_max != longest:
    raise ValueError(f"controller.k_max={controller.k_max} differs from the spec's "
                     f"num_draft_tokens={longest}: they must match.")
  first_decision = len(controller.history)
  num_requests = inputs[2].shape[0]
  # What the tail report would say of a fresh state: every slot admitted, full budgets.
  queued = num_requests > layout.num_slots
  plain_measured = 0 in controller.round_seconds
  k = controller.choose(
      None if queued else [sampling.max_new_tokens] * min(layout.num_slots, num_requests))
  if k == 0 and plain_measured:
    return _plain_rollout(graphdef, params, inputs, rng, sampling=sampling, layout=layout,
                          controller=controller, first_decision=first_decision)
  drafter_params = drafter.params() if drafter_params is None else drafter_params
  start = time.perf_counter()
  state, prompts = _start(graphdef, params, drafter_params, *inputs, rng, sampling=sampling,
                          layout=layout, drafter=drafter, topology=topology)
  # Batches are timed from dispatch to read-back: reading the counters waits for the
  # prefill, so that it does not count in the first.
  counters = jax.device_get(state.counters)
  # A round's drafter first feeds the tokens emitted since it last saw the sequence: up
  # to k + 1 after a round of length k. A drafter that catches up is brought in step at
  # the start of each batch (``catch_up_drafter``), so rounds of length k feed at most
  # k + 1. Others feed up to the longest chain + 1 whatever k is (one program per
  # length, so a rollout never stops to compile for a pair of consecutive lengths),
  # and in plain rounds one token, after a first round that feeds what drafting left.
  catch_up = 1
  longest_pending = (lambda k: k + 1) if drafter.catches_up else (lambda k: longest + 1)
  while True:
    compiled_before = _continue_and_report._cache_size()
    began = time.perf_counter()
    max_rounds = controller.decision_rounds(rounds_per_decision)
    if k == 0 and drafter.stateless:  # nothing to keep in step: a plain decoding step
      calls = [(dict(drafter_params=(), drafter=None, topology=None, draft_mode=None),
                max_rounds)]
    else:
      # k = 0 with a drafter that catches up: plain rounds that only ``record``.
      rounds = dict(drafter_params=drafter_params, drafter=drafter,
                    topology=TreeTopology((1,) * k), draft_mode=draft_mode)
      calls = [(dict(rounds, max_pending=longest_pending(k) if k else 1), max_rounds)]
      if k == 0 and catch_up > 1 and not drafter.catches_up:
        # Its plain rounds feed it one token each; the first after drafting, more.
        calls = [(dict(rounds, max_pending=catch_up), 1)] + (
            [(calls[0][0], max_rounds - 1)] if max_rounds > 1 else [])
    for rounds, batch_rounds in calls:  # dispatched back to back: no host sync between
      state, report = _continue_and_report(graphdef, params, state=state, prompts=prompts,
                                           max_rounds=jnp.int32(batch_rounds),
                                           sampling=sampling, layout=layout, **rounds)
    catch_up = longest + 1 if k else 1
    now, done, (remaining_N, queued) = jax.device_get(report)
    seconds = time.perf_counter() - began
    # A length's first batch includes compiling it: keep its acceptance, not its time.
    compiled = _continue_and_report._cache_size() > compiled_before
    controller.observe(
        k, int(now["target_calls"] - counters["target_calls"]), None if compiled else seconds,
        now["accepted_per_position"] - counters["accepted_per_position"],
        int(now["draft_rounds"] - counters["draft_rounds"]))
    counters = now
    if done:
      break
    # While requests wait, every freed slot is refilled: tokens per second is what
    # counts. Without a queue the batch ends with its slowest sequence.
    k = controller.choose(None if queued else remaining_N.tolist())
  final = _fetch_results(state)
  seconds = time.perf_counter() - start
  _raise_if_exhausted(final, layout, inputs)
  return _with_schedule(_to_output(final, seconds, drafter), controller, first_decision)


def _plain_rollout(graphdef, params, inputs, rng, *, sampling: SamplingParams,
                   layout: _Layout, controller: DraftLengthController,
                   first_decision: int) -> GenerateOutput:
  """A rollout the controller decided to decode plainly throughout: one decision."""
  output = _generate_whole(graphdef, params, None, inputs, rng, sampling=sampling,
                           layout=layout, topology=None, draft_mode=None)
  # Its time includes the prefill: not a clean per-round time (plain rounds are timed
  # again in the rollouts that probe a chain).
  controller.observe(0, output.stats["target_calls"], None, np.zeros(controller.k_max), 0)
  return _with_schedule(output, controller, first_decision)


def _with_schedule(output: GenerateOutput, controller: DraftLengthController,
                   first_decision: int) -> GenerateOutput:
  """``output`` with the lengths this call's decisions chose and the round times so far."""
  output.stats["draft_length_schedule"] = controller.history[first_decision:]
  output.stats["round_seconds_by_draft_length"] = dict(sorted(controller.round_seconds.items()))
  return output


def _weight_bytes(params, engine: EngineConfig, mesh: Mesh | None) -> int | None:
  """The target's weights on one device as generate lays them out, when a memory budget
  needs them."""
  if engine.memory_fraction is None and engine.memory_budget_bytes is None:
    return None
  return tree_bytes(params) if mesh is None else sharded_bytes(params, mesh)


def _tensor_shards(mesh: Mesh | None) -> int:
  return 1 if mesh is None else mesh.shape["tensor"]


def prepare(config, prompts: list[list[int]], sampling: SamplingParams, engine: EngineConfig,
            drafter=None, spec: SpecConfig | None = None, *, weight_bytes: int | None = None,
            tensor_shards: int = 1):
  """Host-side packing of validated prompts into static-shape arrays.

  With a memory budget (``EngineConfig.memory_fraction`` / ``memory_budget_bytes``) the
  pool's pages and, for num_slots=0, the slots come from ``kv.planner``, and slots that
  cannot fit raise its MemoryBudgetError here, before anything compiles. weight_bytes:
  the target's weights on one device (default: estimated from ``config``); tensor_shards:
  ways the KV heads are split.

  Returns (inputs, layout, drafter, topology, draft_mode) where inputs =
  (tokens_UxT, lengths_U, prompt_of_request_R, last_request_U) as device arrays and the
  rest are the static arguments of ``rollout``.
  """
  unique, prompt_of_request, last_request = _group_prompts(prompts)
  tokens, lengths = pack_prompts(unique, padded_width(max(len(p) for p in unique), engine))
  drafter, topology, draft_mode = speculation(config, sampling, drafter, spec)
  layout = engine_layout(config, prompt_width=tokens.shape[1],
                         prompt_pages=int(np.sum(-(-lengths // engine.page_size))),
                         num_requests=len(prompts), sampling=sampling, engine=engine,
                         drafter=drafter, weight_bytes=weight_bytes,
                         tensor_shards=tensor_shards)
  inputs = tuple(jnp.asarray(a) for a in (tokens, lengths, prompt_of_request, last_request))
  return inputs, layout, drafter, topology, draft_mode


def padded_width(longest_prompt: int, engine: EngineConfig) -> int:
  """Prompt arrays are padded to a multiple of the bucket, bounding recompilation."""
  return -(-longest_prompt // engine.prompt_bucket) * engine.prompt_bucket


def pack_prompts(unique: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens_UxT zero-padded to ``width``, lengths_U) on the host."""
  tokens = np.zeros((len(unique), width), np.int32)
  for row, prompt in enumerate(unique):
    tokens[row, :len(prompt)] = prompt
  return tokens, np.asarray([len(p) for p in unique], np.int32)


def engine_layout(config, *, prompt_width: int, prompt_pages: int, num_requests: int,
                  sampling: SamplingParams, engine: EngineConfig, drafter=None,
                  weight_bytes: int | None = None, tensor_shards: int = 1) -> _Layout:
  """The static shape of a decode program, from shapes alone: prompts ``prompt_width``
  wide (padded) needing ``prompt_pages`` pages in all, and ``num_requests`` samples of
  the model ``config``. With a memory budget in ``engine`` the pool and (num_slots=0)
  the slots come from ``kv.planner`` (``drafter``'s weights and KV layers counted;
  weight_bytes: the target's on one device, default estimated from ``config``), and
  slots that cannot fit raise its MemoryBudgetError."""
  num_slots = engine.num_slots or min(num_requests, 256)
  page_size = engine.page_size
  # Room for the prompt and every emitted token: keys a speculative round commits past
  # that (accepted drafts beyond the budget, never emitted) go to the trash page.
  max_pages = -(-(prompt_width + sampling.max_new_tokens + 1) // page_size)
  # Pages every prompt holds until its last sample is admitted, and the trash page.
  reserved = 1 + prompt_pages
  plan = plan_engine_memory(config, engine, drafter, weight_bytes=weight_bytes,
                            tensor_shards=tensor_shards)
  if plan is not None:
    num_slots = plan.admit(num_slots, pages_per_sequence=max_pages, reserved_pages=reserved,
                           shrink=engine.num_slots == 0)
  enough = reserved + num_slots * max_pages
  return _Layout(num_slots=num_slots, page_size=page_size,
                 num_pages=plan.num_pages if plan is not None else engine.num_pages or enough,
                 max_pages_per_seq=max_pages,
                 max_new_tokens=sampling.max_new_tokens,
                 continuous=engine.continuous_batching, pages_always_enough=enough,
                 kv_dtype=engine.kv_dtype or config.dtype, attention=engine.attention)


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


def _to_output(final: DecodeState, seconds: float, drafter: Drafter | None = None
               ) -> GenerateOutput:
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
  }
  drafted_rounds = int(counters.get("draft_rounds", 0))
  if drafted_rounds:
    accepted = counters["accepted_per_position"]
    stats["acceptance_length"] = 1.0 + float(accepted.sum()) / drafted_rounds
    # Of the drafts at each position, the share accepted (a position is drafted
    # only by chains at least that long).
    drafted = counters["drafted_per_position"]
    stats["per_position_acceptance"] = (accepted[drafted > 0] / drafted[drafted > 0]).tolist()
    stats["draft_rounds"] = drafted_rounds
  else:
    stats["acceptance_length"] = 1.0
    stats["per_position_acceptance"] = []
  if drafter is not None:
    stats["drafter"] = drafter.stats(final.drafter)
  return GenerateOutput(tokens=np.asarray(final.out_tokens_RxL), lengths=lengths,
                        logprobs=np.asarray(final.out_log_probs_RxL), stats=stats)


def init_state(config, layout: _Layout, num_requests: int, rng: jax.Array,
               drafter: Drafter | None = None, topology: TreeTopology | None = None
               ) -> DecodeState:
  layer_shapes = ((config.num_kv_heads, config.head_dim),) * config.num_layers
  counters = {"target_calls": jnp.int32(0),
              "request_rounds_R": jnp.zeros((num_requests,), jnp.int32)}
  drafter_state = ()
  if drafter is not None:
    layer_shapes += drafter.kv_layers()
    counters["draft_rounds"] = jnp.int32(0)
    counters["accepted_per_position"] = jnp.zeros((topology.depth,), jnp.int32)
    counters["drafted_per_position"] = jnp.zeros((topology.depth,), jnp.int32)
    drafter_state = drafter.init_state(layout.num_slots)
  k_pages, v_pages = init_pages(layer_shapes, layout.num_pages, layout.page_size,
                                jnp.dtype(layout.kv_dtype))
  n = layout.num_slots
  attention = resolve_attention(layout.attention)
  kv = PagedKV(k_pages=k_pages, v_pages=v_pages,
               attention_fn=attention.decode, prefill_attention_fn=attention.prefill,
               page_table_BxM=jnp.zeros((n, layout.max_pages_per_seq), jnp.int32),
               prefix_lengths_B=jnp.zeros((n,), jnp.int32),
               new_mask_BxTxT=jnp.ones((n, 1, 1), bool),
               write_positions_BxT=jnp.full((n, 1), -1, jnp.int32))
  zeros_N = jnp.zeros((n,), jnp.int32)
  context = layout.max_pages_per_seq * layout.page_size
  return DecodeState(
      pool=page_pool.init_pool(layout.num_pages), kv=kv, num_pages_N=zeros_N,
      cache_lengths_N=zeros_N, last_token_N=zeros_N, slot_request_N=zeros_N - 1,
      generated_N=zeros_N, finished_N=jnp.zeros((n,), bool), next_request=jnp.int32(0),
      out_tokens_RxL=jnp.full((num_requests, layout.max_new_tokens), -1, jnp.int32),
      out_log_probs_RxL=jnp.zeros((num_requests, layout.max_new_tokens), jnp.float32),
      out_lengths_R=jnp.zeros((num_requests,), jnp.int32),
      history_NxC=jnp.full((n, context), -1, jnp.int32), prompt_lengths_N=zeros_N,
      rng=rng, counters=counters, drafter=drafter_state)


def _round_hooks(model: Transformer, drafter_params, sampling: SamplingParams,
                 drafter: Drafter | None, topology: TreeTopology | None,
                 draft_mode: str | None, max_pending: int | None = None):
  """(round_fn, on_admit) of the decode loop: plain rounds, or speculative rounds of
  ``topology`` whose drafter is told about newly admitted prompts."""
  if drafter is None:
    return (lambda s: plain_round(model, s, sampling)), None

  def on_admit(s, admit_N, prompt_N, prompts):
    return s.replace(drafter=drafter.on_admit(drafter_params, s.drafter, admit_N,
                                              prompts.lengths_U[prompt_N]))

  def round_fn(s):
    return speculative_round(model, drafter, drafter_params, s, sampling, topology,
                             draft_mode, max_pending)

  def idle_round_fn(s):
    return plain_round(model, s, sampling, drafter, drafter_params)

  if topology.depth == 0 and drafter.catches_up:
    return idle_round_fn, on_admit
  return round_fn, on_admit


def start_rollout(graphdef, params, drafter_params, tokens_UxT, lengths_U, prompt_of_request_R,
                  last_request_U, rng, *, sampling: SamplingParams, layout: _Layout,
                  drafter: Drafter | None, topology: TreeTopology | None
                  ) -> tuple[DecodeState, Prompts]:
  """Prefills the prompts (and the drafter's cache): the decode loop's initial state and
  the constant prompt data it admits requests from."""
  model = nnx.merge(graphdef, params)
  state = init_state(model.config, layout, prompt_of_request_R.shape[0], rng, drafter, topology)
  offset = model.config.num_layers

  def drafter_prefill(prefill_kv, target_output):
    nonlocal state
    drafter_state, view = drafter.prefill(drafter_params, state.drafter,
                                          LayerOffset(inner=prefill_kv, offset=offset),
                                          tokens_UxT, lengths_U, target_output)
    state = state.replace(drafter=drafter_state)
    return view.inner

  pool, kv, prompts = prefill(model, state.pool, state.kv, tokens_UxT, lengths_U,
                              prompt_of_request_R, last_request_U, sampling,
                              drafter_prefill if drafter is not None else None,
                              hidden_layers=drafter.hidden_layers if drafter else ())
  return state.replace(pool=pool, kv=kv), prompts


def continue_rollout(graphdef, params, drafter_params, state: DecodeState, prompts: Prompts, *,
                     sampling: SamplingParams, layout: _Layout, drafter: Drafter | None,
                     topology: TreeTopology | None, draft_mode: str | None,
                     max_rounds: int | jax.Array | None = None,
                     max_pending: int | None = None
                     ) -> DecodeState:
  """Runs decode rounds of ``topology`` until every request has finished (or after
  ``max_rounds`` rounds: the adaptive engine re-chooses the draft length between calls)."""
  model = nnx.merge(graphdef, params)
  round_fn, on_admit = _round_hooks(model, drafter_params, sampling, drafter, topology,
                                    draft_mode, max_pending)
  if drafter is not None and drafter.catches_up and topology.depth > 0:
    # After plain rounds that left the drafter idle (adaptive k = 0); otherwise a no-op.
    state = catch_up_drafter(drafter, drafter_params, state, model.config.num_layers)
  return run_loop(state, prompts, round_fn, sampling, continuous=layout.continuous,
                  on_admit=on_admit, max_rounds=max_rounds)


def rollout(graphdef, params, drafter_params, tokens_UxT, lengths_U, prompt_of_request_R,
            last_request_U, rng, *, sampling: SamplingParams, layout: _Layout,
            drafter: Drafter | None, topology: TreeTopology | None, draft_mode: str | None
            ) -> DecodeState:
  """The whole rollout as a traceable function (prefill + decode loop), for callers
  that compile it into a larger step (e.g. a jitted RL step). Returns the final
  DecodeState: ``out_tokens_RxL``, ``out_log_probs_RxL``, ``out_lengths_R``,
  ``counters`` and ``pool.exhausted`` are the results. Use ``prepare`` for the inputs."""
  state, prompts = start_rollout(graphdef, params, drafter_params, tokens_UxT, lengths_U,
                                 prompt_of_request_R, last_request_U, rng, sampling=sampling,
                                 layout=layout, drafter=drafter, topology=topology)
  return continue_rollout(graphdef, params, drafter_params, state, prompts, sampling=sampling,
                          layout=layout, drafter=drafter, topology=topology,
                          draft_mode=draft_mode)


_STATIC = ("graphdef", "sampling", "layout", "drafter", "topology", "draft_mode")
_generate = jax.jit(rollout, static_argnames=_STATIC)
_start = jax.jit(start_rollout, static_argnames=_STATIC[:-1])


def _continue_reporting(graphdef, params, drafter_params, state, prompts, max_rounds, **static):
  """continue_rollout, also returning (counters, whether every request is done, the
  tail report): the adaptive engine reads these few numbers between batches of rounds.
  ``max_rounds`` is traced, so batches of any size share one program."""
  state = continue_rollout(graphdef, params, drafter_params, state, prompts,
                           max_rounds=max_rounds, **static)
  num_requests = prompts.prompt_of_request_R.shape[0]
  return state, (state.counters, is_done(state, num_requests), _tail(state, num_requests))


def _tail(state: DecodeState, num_requests: int) -> tuple[jax.Array, jax.Array]:
  """(remaining_N, queued): the token budget left to each slot's sequence once the
  waiting requests have taken the free slots (0 for a slot left empty), and whether
  requests would still be waiting after that."""
  budget = state.out_tokens_RxL.shape[1]
  free_N = ~state.active_N
  waiting = num_requests - state.next_request
  admitted_N = free_N & (jnp.cumsum(free_N) <= waiting)
  remaining_N = jnp.where(state.active_N, budget - state.generated_N,
                          jnp.where(admitted_N, budget, 0))
  return remaining_N, waiting > jnp.sum(free_N)


def _sharded_rollout(graphdef, params, drafter_params, rng, tokens_SxUxT, lengths_SxU,
                     prompt_of_request_SxR, last_request_SxU, *, mesh: Mesh, **static
                     ) -> DecodeState:
  """``rollout`` on every batch shard of ``mesh`` (its own rng stream), the final
  states stacked on a leading shard axis, without pages and token history."""
  def one_shard(params, drafter_params, rng, *inputs):
    rng = jax.random.fold_in(rng, jax.lax.axis_index(sharded.BATCH_AXES))
    final = rollout(graphdef, params, drafter_params, *inputs, rng, **static)
    return final.replace(kv=None, history_NxC=None)
  return sharded.per_shard(one_shard, mesh, num_replicated=3)(
      params, drafter_params, rng, tokens_SxUxT, lengths_SxU, prompt_of_request_SxR,
      last_request_SxU)


_generate_sharded = jax.jit(_sharded_rollout, static_argnames=_STATIC + ("mesh",))

_continue_and_report = jax.jit(_continue_reporting,
                               static_argnames=_STATIC + ("max_pending",),
                               donate_argnames=("state",))
