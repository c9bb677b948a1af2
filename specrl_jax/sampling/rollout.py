"""The compiled rollout programs: state set-up, prefill, the decode loop, and the jitted
entry points (whole rollouts, per batch shard, and the batches of rounds the adaptive
engine runs).

Rounds are plain unless a *round hook* is given (``rounds``, a static argument, a
``sampling.hooks.RoundHook``; e.g. ``speculative.rollout.Speculation``).
``hook_params`` is the hook's traced pytree (``rounds.params()`` by default).

``start``, ``continue_stage`` and ``compact_slots`` are the decode program in pieces,
each its own compiled program, for engines that decide between batches of rounds on
the host; ``programs.programs_compiled`` says whether a call compiled.
"""

from __future__ import annotations

import time
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from specrl_jax.config import SamplingParams
from specrl_jax.kernels.dispatch import resolve_attention
from specrl_jax.kv import pool as page_pool
from specrl_jax.kv.paged import PagedKV, init_pages
from specrl_jax.sampling.compaction import compact, compaction_stats, stage_widths
from specrl_jax.sampling.decode_loop import run_loop
from specrl_jax.sampling.engine import DecodeState, Prompts, is_done, live_sequences
from specrl_jax.sampling.plain import plain_round
from specrl_jax.sampling import sharded
from specrl_jax.sampling.prefill import prefill
from specrl_jax.sampling.programs import PROGRAMS, STAGE_PROGRAMS
from specrl_jax.sampling.layout import Layout
from specrl_jax.sampling.results import GenerateOutput, fetch_results, raise_if_exhausted, to_output
from specrl_jax.sampling.hooks import RoundHook


def generate_whole(graphdef, params, inputs, rng, *, sampling: SamplingParams, layout: Layout,
                    rounds: RoundHook | None = None, hook_params=None, placement: str | None = None
                    ) -> GenerateOutput:
  """The whole rollout as one compiled program, timed. placement: how the hook's
  weights were placed on a mesh, reported with its stats."""
  if hook_params is None:
    hook_params = rounds.params() if rounds is not None else ()
  if layout.compaction_min_width:
    return _generate_staged(graphdef, params, hook_params, inputs, rng, sampling=sampling,
                            layout=layout, rounds=rounds, placement=placement)
  start = time.perf_counter()
  final = PROGRAMS.call(rollout, (graphdef,), dict(sampling=sampling, layout=layout,
                                                   rounds=rounds),
                        params, hook_params, *inputs, rng)
  final = fetch_results(final)
  seconds = time.perf_counter() - start
  raise_if_exhausted(final, layout, inputs)
  return to_output(final, seconds, rounds, placement=placement)


def init_state(config, layout: Layout, tokens_UxT, lengths_U, prompt_of_request_R,
               rng: jax.Array, rounds: RoundHook | None = None) -> DecodeState:
  num_requests = prompt_of_request_R.shape[0]
  layer_shapes = ((config.num_kv_heads, config.head_dim),) * config.num_layers
  counters = {"target_calls": jnp.int32(0),
              "request_rounds_R": jnp.zeros((num_requests,), jnp.int32),
              "rounds_by_live": jnp.zeros((layout.num_slots + 1,), jnp.int32),
              "rounds_by_width": jnp.zeros((len(widths_of(layout)),), jnp.int32),
              "tokens_by_width": jnp.zeros((len(widths_of(layout)),), jnp.int32)}
  hook_state = ()
  if rounds is not None:
    layer_shapes += rounds.kv_layers()
    hook_state, counters = rounds.init_state(layout.num_slots, counters)
  k_pages, v_pages = init_pages(layer_shapes, layout.num_pages, layout.page_size,
                                jnp.dtype(layout.kv_dtype))
  n = layout.num_slots
  attention = resolve_attention(layout.attention, mesh=layout.tensor_mesh)
  kv = PagedKV(k_pages=k_pages, v_pages=v_pages,
               attention_fn=attention.decode, prefill_attention_fn=attention.prefill,
               page_table_BxM=jnp.zeros((n, layout.max_pages_per_seq), jnp.int32),
               prefix_lengths_B=jnp.zeros((n,), jnp.int32),
               new_mask_BxTxT=jnp.ones((n, 1, 1), bool),
               write_positions_BxT=jnp.full((n, 1), -1, jnp.int32))
  zeros_N = jnp.zeros((n,), jnp.int32)
  return DecodeState(
      pool=page_pool.init_pool(layout.num_pages), kv=kv, num_pages_N=zeros_N,
      cache_lengths_N=zeros_N, last_token_N=zeros_N, slot_request_N=zeros_N - 1,
      generated_N=zeros_N, finished_N=jnp.zeros((n,), bool), next_request=jnp.int32(0),
      out_tokens_RxL=jnp.full((num_requests, layout.max_new_tokens), -1, jnp.int32),
      out_log_probs_RxL=jnp.zeros((num_requests, layout.max_new_tokens), jnp.float32),
      out_lengths_R=jnp.zeros((num_requests,), jnp.int32),
      prompt_tokens_UxT=tokens_UxT, prompt_lengths_U=lengths_U,
      prompt_of_request_R=prompt_of_request_R, history_request_N=zeros_N - 1,
      rng=rng, counters=counters, drafter=hook_state)


def start_rollout(graphdef, params, hook_params, tokens_UxT, lengths_U, prompt_of_request_R,
                  last_request_U, rng, *, sampling: SamplingParams, layout: Layout,
                  rounds: RoundHook | None = None) -> tuple[DecodeState, Prompts]:
  """Prefills the prompts (and the hook's pages): the decode loop's initial state and
  the constant prompt data it admits requests from."""
  model = nnx.merge(graphdef, params)
  state = init_state(model.config, layout, tokens_UxT, lengths_U, prompt_of_request_R, rng,
                     rounds)

  def hook_prefill(prefill_kv, target_output):
    nonlocal state
    state, prefill_kv = rounds.prefill(hook_params, state, prefill_kv, model.config.num_layers,
                                       tokens_UxT, lengths_U, target_output)
    return prefill_kv

  pool, kv, prompts = prefill(model, state.pool, state.kv, tokens_UxT, lengths_U,
                              prompt_of_request_R, last_request_U, sampling,
                              hook_prefill if rounds is not None else None,
                              hidden_layers=rounds.hidden_layers if rounds is not None else ())
  return state.replace(pool=pool, kv=kv), prompts


def continue_rollout(graphdef, params, hook_params, state: DecodeState, prompts: Prompts, *,
                     sampling: SamplingParams, layout: Layout, rounds: RoundHook | None = None,
                     max_rounds: int | jax.Array | None = None,
                     until_live: int | None = None) -> DecodeState:
  """Runs decode rounds until every request has finished (or after ``max_rounds``
  rounds: the adaptive engine re-chooses the draft length between calls; or once at
  most ``until_live`` sequences are live: compaction's stages)."""
  model = nnx.merge(graphdef, params)
  if rounds is None:
    round_fn, on_admit = (lambda s: plain_round(model, s, sampling)), None
  else:
    state, round_fn, on_admit = rounds.loop(model, hook_params, state, sampling)
  return run_loop(state, prompts, round_fn, sampling, continuous=layout.continuous,
                  on_admit=on_admit, max_rounds=max_rounds, until_live=until_live)


def widths_of(layout: Layout) -> tuple[int, ...]:
  """The widths the decode loop runs in (one unless the layout compacts slots)."""
  return stage_widths(layout.num_slots, layout.compaction_min_width)


def run_stage(graphdef, params, hook_params, state: DecodeState, prompts: Prompts, *,
              stage: int, sampling: SamplingParams, layout: Layout, rounds: RoundHook | None = None
              ) -> DecodeState:
  """Stage ``stage`` of the decode loop (``sampling.compaction``): rounds at its width
  until the live sequences fit the next width, then the state narrowed to it (the last
  stage decodes to the end). Counts its rounds in ``rounds_by_width``."""
  widths = widths_of(layout)
  narrower = widths[stage + 1] if stage + 1 < len(widths) else None
  before = state
  state = continue_rollout(graphdef, params, hook_params, state, prompts, sampling=sampling,
                           layout=layout, rounds=rounds, until_live=narrower)
  state = _count_stage(before, state, stage)
  return state if narrower is None else compact(state, narrower, rounds)


def _count_stage(before: DecodeState, after: DecodeState, stage: int) -> DecodeState:
  """Adds the rounds (target calls) and the tokens emitted between ``before`` and
  ``after`` to stage ``stage``'s counters: tokens per second at each width compares
  decoders whose samples (and so whose widths' durations) differ."""
  counters = after.counters
  rounds = counters["target_calls"] - before.counters["target_calls"]
  tokens = jnp.sum(after.out_lengths_R) - jnp.sum(before.out_lengths_R)
  return after.replace(counters=dict(
      counters, rounds_by_width=counters["rounds_by_width"].at[stage].add(rounds),
      tokens_by_width=counters["tokens_by_width"].at[stage].add(tokens)))


def rollout(graphdef, params, hook_params, tokens_UxT, lengths_U, prompt_of_request_R,
            last_request_U, rng, *, sampling: SamplingParams, layout: Layout, rounds: RoundHook | None = None
            ) -> DecodeState:
  """The whole rollout as a traceable function (prefill + decode loop). Returns the
  final DecodeState: ``out_tokens_RxL``, ``out_log_probs_RxL``, ``out_lengths_R``,
  ``counters`` and ``pool.exhausted`` are the results."""
  state, prompts = start_rollout(graphdef, params, hook_params, tokens_UxT, lengths_U,
                                 prompt_of_request_R, last_request_U, rng, sampling=sampling,
                                 layout=layout, rounds=rounds)
  for stage in range(len(widths_of(layout))):
    state = run_stage(graphdef, params, hook_params, state, prompts, stage=stage,
                      sampling=sampling, layout=layout, rounds=rounds)
  return state


def _run_stage_reporting(graphdef, params, hook_params, state, prompts, **static):
  """run_stage, also returning whether every request is done."""
  state = run_stage(graphdef, params, hook_params, state, prompts, **static)
  return state, is_done(state, prompts.prompt_of_request_R.shape[0])


def _generate_staged(graphdef, params, hook_params, inputs, rng, *, sampling: SamplingParams,
                     layout: Layout, rounds: RoundHook | None, placement: str | None) -> GenerateOutput:
  """generate_whole with slot compaction: the prefill, then one compiled program per
  width, each timed from dispatch to its read-back (compiling excluded)."""
  static = dict(sampling=sampling, layout=layout, rounds=rounds)
  start = time.perf_counter()
  state, prompts = PROGRAMS.call(start_rollout, (graphdef,), static, params, hook_params,
                                 *inputs, rng)
  widths = widths_of(layout)
  seconds_by_width = [0.0] * len(widths)
  for stage in range(len(widths)):
    with warnings.catch_warnings():
      # The per-slot rows of the wider state cannot hold the narrower one's; the pages,
      # which are what donation is for, are reused.
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      program = PROGRAMS.compiled(_run_stage_reporting, (graphdef,),
                                  dict(static, stage=stage), params, hook_params, state,
                                  prompts, donate=(2,))
    jax.block_until_ready(state)  # the prefill or the stage before, out of this one's time
    began = time.perf_counter()
    state, done = program(params, hook_params, state, prompts)
    done = bool(done)
    seconds_by_width[stage] = time.perf_counter() - began
    if done:
      break
  final = fetch_results(state)
  seconds = time.perf_counter() - start
  raise_if_exhausted(final, layout, inputs)
  output = to_output(final, seconds, rounds, placement=placement)
  output.stats["compaction"] = compaction_stats(final.counters, widths, seconds_by_width)
  return output


_STATIC = ("graphdef", "sampling", "layout", "rounds")


# The decode program in pieces, for engines that decide between batches of rounds on the
# host (adaptive speculation): each piece is compiled once per static arguments and input
# shapes and kept in ``STAGE_PROGRAMS`` (``programs_compiled`` counts the compiles).

def start(graphdef, params, hook_params, inputs: tuple, rng, *, sampling: SamplingParams,
          layout: Layout, rounds: RoundHook | None = None) -> tuple[DecodeState, Prompts]:
  """``start_rollout`` as a compiled program: the prefilled state and the prompts the
  loop admits requests from. inputs: (tokens_UxT, lengths_U, prompt_of_request_R,
  last_request_U), as ``layout.pack`` makes them."""
  return STAGE_PROGRAMS.call(start_rollout, (graphdef,),
                       dict(sampling=sampling, layout=layout, rounds=rounds),
                       params, hook_params, *inputs, rng)


def continue_stage(graphdef, params, hook_params, state: DecodeState, prompts: Prompts,
                   max_rounds: jax.Array, *, stage: int, sampling: SamplingParams,
                   layout: Layout, rounds: RoundHook | None = None
                   ) -> tuple[DecodeState, tuple]:
  """At most ``max_rounds`` rounds at the width of ``stage`` as a compiled program
  (``state``'s buffers are donated to it): the state and the report the host decides
  on, (counters, whether every request is done, (remaining_N, queued), live sequences).
  ``max_rounds`` is traced (an int32 scalar): batches of any size share one program."""
  program = STAGE_PROGRAMS.compiled(
      _continue_reporting, (graphdef,),
      dict(stage=stage, sampling=sampling, layout=layout, rounds=rounds),
      params, hook_params, state, prompts, max_rounds, donate=(2,))
  return program(params, hook_params, state, prompts, max_rounds)


def compact_slots(state: DecodeState, width: int, hook: RoundHook | None = None
                  ) -> DecodeState:
  """``compaction.compact`` as a compiled program: ``state`` narrowed to ``width`` slots
  (its pages are reused; its per-slot rows, which cannot hold the narrower state's,
  are not)."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
    program = STAGE_PROGRAMS.compiled(compact, (), dict(width=width, hook=hook), state,
                                donate=(0,))
    return program(state)


def _continue_reporting(graphdef, params, hook_params, state, prompts, max_rounds, *,
                        stage: int = 0, **static):
  """Rounds at the width of ``stage`` (``widths_of``) until ``max_rounds`` have run,
  every request is done, or the live sequences fit the next width; returns the state
  and (counters, whether every request is done, the tail report, the live sequences):
  the adaptive engine reads these few numbers between batches of rounds.
  ``max_rounds`` is traced, so batches of any size share one program."""
  widths = widths_of(static["layout"])
  narrower = widths[stage + 1] if stage + 1 < len(widths) else None
  before = state
  state = continue_rollout(graphdef, params, hook_params, state, prompts,
                           max_rounds=max_rounds, until_live=narrower, **static)
  state = _count_stage(before, state, stage)
  num_requests = prompts.prompt_of_request_R.shape[0]
  return state, (state.counters, is_done(state, num_requests), _tail(state, num_requests),
                 live_sequences(state, num_requests))


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


def _sharded_rollout(graphdef, params, hook_params, rng, tokens_QxUxT, lengths_QxU,
                     prompt_of_request_QxR, last_request_QxU, *, mesh: Mesh, **static
                     ) -> DecodeState:
  """``rollout`` on every batch shard of ``mesh`` (its own rng stream), the final
  states stacked on a leading shard axis, without pages."""
  def one_shard(params, hook_params, rng, *inputs):
    rng = jax.random.fold_in(rng, jax.lax.axis_index(sharded.BATCH_AXES))
    final = rollout(graphdef, params, hook_params, *inputs, rng, **static)
    return final.replace(kv=None)
  return sharded.per_shard(one_shard, mesh, num_replicated=3)(
      params, hook_params, rng, tokens_QxUxT, lengths_QxU, prompt_of_request_QxR,
      last_request_QxU)


generate_on_shards = jax.jit(_sharded_rollout, static_argnames=_STATIC + ("mesh",))
