"""The compiled rollout programs: state set-up, prefill, the decode loop with plain or
speculative rounds, and the jitted entry points (whole rollouts, per batch shard, and
the batches of rounds the adaptive engine runs)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from specrl_jax.config import SamplingParams
from specrl_jax.kernels.dispatch import resolve_attention
from specrl_jax.kv import pool as page_pool
from specrl_jax.kv.paged import LayerOffset, PagedKV, init_pages
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.engine import DecodeState, Prompts, is_done, run_loop
from specrl_jax.sampling.plain import plain_round
from specrl_jax.sampling import sharded
from specrl_jax.sampling.prefill import prefill
from specrl_jax.sampling.programs import PROGRAMS
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.catch_up import catch_up_drafter
from specrl_jax.speculative.round import speculative_round
from specrl_jax.speculative.topology import TreeTopology
from specrl_jax.sampling.layout import Layout
from specrl_jax.sampling.results import GenerateOutput, fetch_results, raise_if_exhausted, to_output


def generate_whole(graphdef, params, drafter: Drafter | None, inputs, rng, *,
                    sampling: SamplingParams, layout: Layout,
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
  final = fetch_results(final)
  seconds = time.perf_counter() - start
  raise_if_exhausted(final, layout, inputs)
  return to_output(final, seconds, drafter)


def init_state(config, layout: Layout, num_requests: int, rng: jax.Array,
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
                  last_request_U, rng, *, sampling: SamplingParams, layout: Layout,
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
                     sampling: SamplingParams, layout: Layout, drafter: Drafter | None,
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
            last_request_U, rng, *, sampling: SamplingParams, layout: Layout,
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
