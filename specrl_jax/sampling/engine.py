"""The decode engine: slots, admission, emission and the jitted decode loop.

A fixed number of slots decode in lock step. Requests (one per prompt sample) wait in
order; whenever a slot's sequence ends, its pages are released and the slot takes the
next waiting request (continuous batching), so a long-tailed response length does not
idle the batch. What a "round" does to the active slots is pluggable: plain decoding
emits one token per slot, speculative decoding emits up to k + 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from specrl_jax.config import (SamplingParams, check, is_finite_number, is_integer,
                               normalise_numbers)
from specrl_jax.kernels.dispatch import ATTENTION_CHOICES
from specrl_jax.kv import pool as page_pool
from specrl_jax.kv.paged import PagedKV, page_size_of
from specrl_jax.kv.pool import TRASH_PAGE, PagePool
from specrl_jax.sampling.warp import sample_tokens

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Static shape of the decode engine.

  num_slots: sequences decoded together (0 = one per request, at most 256).
  page_size: tokens per KV page.
  num_pages: pages in the pool (0 = enough for every prompt plus every slot's longest
    sequence, so the pool cannot run out).
  continuous_batching: refill a slot as soon as its sequence ends; when False, wait
    until the whole batch has finished (static batching).
  prompt_bucket: prompts are padded to a multiple of this, bounding recompilation.
  kv_dtype: dtype of the KV page pool ("float32" or "bfloat16"; None = the model's
    activation dtype). Attention reads it in the compute dtype with float32 scores.
  bucket_shapes: also round the number of distinct prompts, of requests, of slots (when
    automatic) and of pages (when automatic) up to the next size in
    ``sampling.programs.BUCKETS`` (1, 2, 3, 4, 6, 8, 12, ...: at most 1.5x), so that calls
    of nearby sizes share one compiled program. The padding is never admitted and does
    not change any request's tokens; it costs at most that much more idle batch rows.
  attention: "auto" (per backend: the Pallas kernels on GPU and TPU, the reference on
    CPU), "reference" (the pure-JAX reference everywhere) or "pallas" (the kernels; on
    CPU in interpret mode, slow); resolved when the engine builds its state.
  memory_fraction: size the pool from the device's memory instead: this share of what
    ``device.memory_stats()`` reports free after the weights (``kv.planner``).
  memory_budget_bytes: or from an explicit budget: bytes per device for the weights and
    the pool together. With either, a batch whose slots cannot fit is refused before
    anything compiles, and num_slots=0 takes as many slots as fit (up to one per request).
  compaction: once the live sequences (and the requests waiting for a slot) fit in half
    the slots or fewer, continue them in a narrower compiled program, in power-of-two
    widths down to ``compaction_min_width`` (``sampling.compaction``): a long-tailed
    rollout's last sequences stop paying for full-width rounds. Each width compiles its
    own loop.
  compaction_min_width: the narrowest width compaction goes to (a power of two).
  """
  num_slots: int = 0
  page_size: int = 16
  num_pages: int = 0
  continuous_batching: bool = True
  prompt_bucket: int = 16
  kv_dtype: str | None = None
  bucket_shapes: bool = True
  attention: str = "auto"
  memory_fraction: float | None = None
  memory_budget_bytes: int | None = None
  compaction: bool = False
  compaction_min_width: int = 1

  def __post_init__(self):
    owner = "EngineConfig"
    check(is_integer(self.num_slots) and self.num_slots >= 0, owner, "num_slots",
          self.num_slots, "an integer >= 0 (0 = one per request)")
    check(is_integer(self.page_size) and self.page_size > 0, owner, "page_size",
          self.page_size, "a positive integer")
    check(is_integer(self.num_pages) and (self.num_pages == 0 or self.num_pages >= 2),
          owner, "num_pages", self.num_pages, "0 (automatic) or an integer >= 2")
    check(is_integer(self.prompt_bucket) and self.prompt_bucket > 0, owner,
          "prompt_bucket", self.prompt_bucket, "a positive integer")
    check(self.kv_dtype in (None, "float32", "bfloat16"), owner, "kv_dtype", self.kv_dtype,
          "None (the model's dtype), 'float32' or 'bfloat16'")
    check(isinstance(self.continuous_batching, bool), owner, "continuous_batching",
          self.continuous_batching, "True or False")
    check(isinstance(self.bucket_shapes, bool), owner, "bucket_shapes", self.bucket_shapes,
          "True or False")
    check(isinstance(self.compaction, bool), owner, "compaction", self.compaction,
          "True or False")
    width = self.compaction_min_width
    check(is_integer(width) and width >= 1 and (int(width) & (int(width) - 1)) == 0, owner,
          "compaction_min_width", width, "a power of two >= 1")
    normalise_numbers(self, ints=("num_slots", "page_size", "num_pages", "prompt_bucket",
                                  "compaction_min_width"))
    check(self.attention in ATTENTION_CHOICES, owner, "attention", self.attention,
          f"one of {ATTENTION_CHOICES}")
    fraction, budget = self.memory_fraction, self.memory_budget_bytes
    check(fraction is None or (is_finite_number(fraction) and 0 < fraction <= 1),
          owner, "memory_fraction", fraction, "None or a number in (0, 1]")
    check(budget is None or (is_integer(budget) and budget > 0),
          owner, "memory_budget_bytes", budget, "None or a positive integer")
    normalise_numbers(self, ints=("memory_budget_bytes",) if budget is not None else (),
                      floats=("memory_fraction",) if fraction is not None else ())
    sizings = {name: getattr(self, name) for name in ("num_pages", "memory_fraction",
                                                      "memory_budget_bytes")
               if getattr(self, name)}
    check(len(sizings) <= 1, owner, next(reversed(sizings), "num_pages"), sizings,
          "at most one of num_pages, memory_fraction and memory_budget_bytes (each sizes "
          "the page pool)")


@flax.struct.dataclass
class Prompts:
  """Prefilled prompts, constant during the loop (U unique prompts, R requests)."""
  page_table_UxM: Array        # pages holding each prompt's KV
  lengths_U: Array
  first_log_probs_UxV: Array   # warped log-probs of the first response token
  tokens_UxT: Array            # padded prompt tokens (drafters read them)
  prompt_of_request_R: Array   # which prompt each request samples
  last_request_U: Array        # the last request of each prompt (its pages' holder lets go then)


@flax.struct.dataclass
class DecodeState:
  """Everything the decode loop carries. N slots, M pages per slot, R requests, L new tokens,
  U distinct prompts of T tokens (padded)."""
  pool: PagePool
  kv: PagedKV
  num_pages_N: Array
  cache_lengths_N: Array       # tokens whose KV is committed
  last_token_N: Array          # emitted, not yet in the cache: the next round's input
  slot_request_N: Array        # -1 = free slot
  generated_N: Array
  finished_N: Array
  next_request: Array
  out_tokens_RxL: Array
  out_log_probs_RxL: Array
  out_lengths_R: Array
  # The prompts (constant through the decode) and the request each slot last took, kept
  # after the slot is released so a finished sibling's rollout stays readable: what
  # ``history_NxC`` is derived from. Admission writes only the request.
  prompt_tokens_UxT: Array
  prompt_lengths_U: Array
  prompt_of_request_R: Array
  history_request_N: Array
  rng: Array
  counters: dict[str, Array]
  drafter: Any = ()

  @property
  def num_slots(self) -> int:
    return self.slot_request_N.shape[0]

  @property
  def active_N(self) -> Array:
    return (self.slot_request_N >= 0) & ~self.finished_N

  @property
  def prompt_lengths_N(self) -> Array:
    """The prompt length of each slot's last request (0: the slot never took one)."""
    prompt_N = self.prompt_of_request_R[jnp.maximum(self.history_request_N, 0)]
    return jnp.where(self.history_request_N >= 0, self.prompt_lengths_U[prompt_N], 0)

  @property
  def history_NxC(self) -> Array:
    """Prompt + emitted tokens of each slot's last request (-1 beyond), C = the
    context: what drafters read. Derived when read, from the prompts and the output
    buffer, rather than kept per slot: a copy written every round (of the emitted
    tokens, or of the prompt at each admission) cost each plain round beside a drafter
    (the in-loop controller's) work that the plain program, where nothing reads it,
    leaves out."""
    context = self.kv.page_table_BxM.shape[1] * page_size_of(self.kv.k_pages[0])
    max_new, width = self.out_tokens_RxL.shape[1], self.prompt_tokens_UxT.shape[1]
    request_N = jnp.maximum(self.history_request_N, 0)
    lengths_N = self.prompt_lengths_N
    position_C = jnp.arange(context)
    prompt_NxC = self.prompt_tokens_UxT[self.prompt_of_request_R[request_N][:, None],
                                        jnp.minimum(position_C, width - 1)[None, :]]
    offset_NxC = position_C[None, :] - lengths_N[:, None]
    response_NxC = self.out_tokens_RxL[request_N[:, None], jnp.clip(offset_NxC, 0, max_new - 1)]
    emitted_NxC = ((offset_NxC >= 0) & (offset_NxC < self.generated_N[:, None])
                   & (self.history_request_N >= 0)[:, None])
    return jnp.where(offset_NxC < 0, prompt_NxC, jnp.where(emitted_NxC, response_NxC, -1))


def emit(state: DecodeState, tokens_NxE: Array, log_probs_NxE: Array, counts_N: Array,
         sampling: SamplingParams) -> tuple[DecodeState, Array]:
  """Appends up to counts_N[n] tokens to each slot's response.

  A stop token ends the response after itself; max_new_tokens truncates the run.
  Returns (state, emitted counts). Tokens past a stop or the budget are dropped.
  """
  num_candidates = tokens_NxE.shape[1]
  max_new = state.out_tokens_RxL.shape[1]
  index_E = jnp.arange(num_candidates)
  valid_NxE = index_E[None, :] < counts_N[:, None]
  stops = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)
  is_stop_NxE = jnp.isin(tokens_NxE, stops) & valid_NxE
  any_stop_N = jnp.any(is_stop_NxE, axis=1)
  through_stop_N = jnp.where(any_stop_N, jnp.argmax(is_stop_NxE, axis=1) + 1, counts_N)
  budget_N = max_new - state.generated_N
  emitted_N = jnp.clip(jnp.minimum(through_stop_N, budget_N), 0, None)
  emitted_N = jnp.where(state.slot_request_N >= 0, emitted_N, 0)

  write_NxE = index_E[None, :] < emitted_N[:, None]
  rows = jnp.where(write_NxE, state.slot_request_N[:, None], state.out_tokens_RxL.shape[0])
  cols = state.generated_N[:, None] + index_E[None, :]
  out_tokens = state.out_tokens_RxL.at[rows, cols].set(tokens_NxE, mode="drop")
  out_log_probs = state.out_log_probs_RxL.at[rows, cols].set(log_probs_NxE, mode="drop")
  generated_N = state.generated_N + emitted_N
  out_lengths = state.out_lengths_R.at[
      jnp.where(emitted_N > 0, state.slot_request_N, state.out_lengths_R.shape[0])].set(
          generated_N, mode="drop")
  stopped_N = any_stop_N & (through_stop_N <= emitted_N)
  finished_N = state.finished_N | ((emitted_N > 0) & (stopped_N | (generated_N >= max_new)))
  last_index_N = jnp.maximum(emitted_N - 1, 0)
  last_token_N = jnp.where(emitted_N > 0,
                           jnp.take_along_axis(tokens_NxE, last_index_N[:, None], 1)[:, 0],
                           state.last_token_N)
  state = state.replace(out_tokens_RxL=out_tokens, out_log_probs_RxL=out_log_probs,
                        out_lengths_R=out_lengths, generated_N=generated_N,
                        finished_N=finished_N, last_token_N=last_token_N)
  return state, emitted_N


def reserve_pages(state: DecodeState, needed_lengths_N: Array, max_new_pages: int) -> DecodeState:
  """Makes sure each slot owns pages for positions [0, needed_lengths_N)."""
  page_size = page_size_of(state.kv.k_pages[0])
  max_pages = state.kv.page_table_BxM.shape[1]
  wanted_N = jnp.minimum(-(-needed_lengths_N // page_size), max_pages)
  counts_N = jnp.clip(wanted_N - state.num_pages_N, 0, max_new_pages)
  pool, pages_NxA, ok = page_pool.allocate(state.pool, counts_N, max_new_pages)
  index_A = jnp.arange(max_new_pages)
  cols = jnp.where((index_A[None, :] < counts_N[:, None]) & ok,
                   state.num_pages_N[:, None] + index_A[None, :], max_pages)
  rows = jnp.broadcast_to(jnp.arange(state.num_slots)[:, None], cols.shape)
  table = state.kv.page_table_BxM.at[rows, cols].set(pages_NxA, mode="drop")
  return state.replace(pool=pool, kv=state.kv.replace(page_table_BxM=table),
                       num_pages_N=state.num_pages_N + jnp.where(ok, counts_N, 0))


def release_finished(state: DecodeState) -> DecodeState:
  """Frees the slots whose sequence ended and gives their pages back."""
  done_N = (state.slot_request_N >= 0) & state.finished_N
  max_pages = state.kv.page_table_BxM.shape[1]
  owned_NxM = (jnp.arange(max_pages)[None, :] < state.num_pages_N[:, None]) & done_N[:, None]
  pool = page_pool.release(state.pool, state.kv.page_table_BxM, owned_NxM)
  table = jnp.where(done_N[:, None], TRASH_PAGE, state.kv.page_table_BxM)
  return state.replace(pool=pool, kv=state.kv.replace(page_table_BxM=table),
                       num_pages_N=jnp.where(done_N, 0, state.num_pages_N),
                       slot_request_N=jnp.where(done_N, -1, state.slot_request_N),
                       finished_N=jnp.where(done_N, False, state.finished_N))


AdmitHook = Callable[[DecodeState, Array, Array, "Prompts"], DecodeState]


def admit(state: DecodeState, prompts: Prompts, sampling: SamplingParams, *,
          continuous: bool, on_admit: AdmitHook | None = None,
          tail_layers: int | None = None) -> DecodeState:
  """Puts waiting requests into free slots and emits their first token.

  The admitted sample references its prompt's full pages (no copy) and gets a private
  copy of the prompt's partly filled last page, which it will keep writing into: of
  the first ``tail_layers`` KV layers (None: all). A round hook whose drafter re-feeds
  the prompt's tail itself before drafting leaves its own layers out.
  """
  num_requests = count_requests(prompts)
  page_size = page_size_of(state.kv.k_pages[0])
  max_pages = state.kv.page_table_BxM.shape[1]
  free_N = state.slot_request_N < 0
  if not continuous:
    free_N = free_N & ~jnp.any(state.slot_request_N >= 0)
  request_N = state.next_request + jnp.cumsum(free_N) - 1
  admit_N = free_N & (request_N < num_requests)
  request_N = jnp.where(admit_N, request_N, 0)
  prompt_N = prompts.prompt_of_request_R[request_N]
  length_N = prompts.lengths_U[prompt_N]
  full_N = length_N // page_size
  has_tail_N = admit_N & (length_N % page_size > 0)

  column_M = jnp.arange(max_pages)
  prompt_pages = prompts.page_table_UxM[prompt_N]
  prompt_pages_NxM = jnp.pad(prompt_pages, ((0, 0), (0, max_pages - prompt_pages.shape[1])))
  shared_NxM = admit_N[:, None] & (column_M[None, :] < full_N[:, None])
  pool = page_pool.add_references(state.pool, prompt_pages_NxM, shared_NxM)
  pool, tail_Nx1, _ = page_pool.allocate(pool, has_tail_N.astype(jnp.int32), 1)
  row_NxM = jnp.where(shared_NxM, prompt_pages_NxM, TRASH_PAGE)
  row_NxM = jnp.where((column_M[None, :] == full_N[:, None]) & has_tail_N[:, None],
                      tail_Nx1, row_NxM)
  source_N = jnp.where(has_tail_N,
                       jnp.take_along_axis(prompt_pages_NxM, full_N[:, None], 1)[:, 0],
                       TRASH_PAGE)
  destination_N = jnp.where(has_tail_N, tail_Nx1[:, 0], TRASH_PAGE)
  # The barrier keeps the gather and the scatter in separate fusions; fused, XLA copies
  # the whole page array to read and write it in one pass.
  copied = slice(None, tail_layers)
  k_tails, v_tails = jax.lax.optimization_barrier(
      ([k[source_N] for k in state.kv.k_pages[copied]],
       [v[source_N] for v in state.kv.v_pages[copied]]))
  # One more destination, out of range and dropped: a scatter of a single page (one
  # slot) would become a dynamic-update-slice, which XLA fused with the round's page
  # gathers and then copied every layer's whole page array each round to update.
  destination_D = jnp.append(destination_N, state.kv.k_pages[0].shape[0])
  pad = lambda t: jnp.concatenate([t, jnp.zeros_like(t[:1])])
  k_pages = tuple(k.at[destination_D].set(pad(t), mode="drop")
                  for k, t in zip(state.kv.k_pages, k_tails)) + state.kv.k_pages[len(k_tails):]
  v_pages = tuple(v.at[destination_D].set(pad(t), mode="drop")
                  for v, t in zip(state.kv.v_pages, v_tails)) + state.kv.v_pages[len(v_tails):]
  table = jnp.where(admit_N[:, None], row_NxM, state.kv.page_table_BxM)

  # The prompt's own reference (held since prefill) goes once its last sample is in.
  next_request = state.next_request + jnp.sum(admit_N, dtype=jnp.int32)
  newly_complete_U = ((prompts.last_request_U >= state.next_request)
                      & (prompts.last_request_U < next_request))
  prompt_page_count_U = -(-prompts.lengths_U // page_size)
  held_UxM = newly_complete_U[:, None] & (
      jnp.arange(prompts.page_table_UxM.shape[1])[None, :] < prompt_page_count_U[:, None])
  pool = page_pool.release(pool, prompts.page_table_UxM, held_UxM)

  rng, key = jax.random.split(state.rng)

  def sample_first(_):
    first_log_probs_NxV = prompts.first_log_probs_UxV[prompt_N]
    first_N = sample_tokens(key, first_log_probs_NxV, sampling)
    return first_N, jnp.take_along_axis(first_log_probs_NxV, first_N[:, None], 1)

  # Most rounds admit nobody: skip drawing N x V Gumbel noise then (the operands are
  # small, so this cond copies nothing large).
  first_N, first_log_prob_N = jax.lax.cond(
      jnp.any(admit_N), sample_first,
      lambda _: (jnp.zeros_like(admit_N, jnp.int32),
                 jnp.zeros((admit_N.shape[0], 1), jnp.float32)), None)
  state = state.replace(
      pool=pool,
      kv=state.kv.replace(k_pages=k_pages, v_pages=v_pages, page_table_BxM=table),
      num_pages_N=jnp.where(admit_N, full_N + has_tail_N, state.num_pages_N),
      cache_lengths_N=jnp.where(admit_N, length_N, state.cache_lengths_N),
      slot_request_N=jnp.where(admit_N, request_N, state.slot_request_N),
      generated_N=jnp.where(admit_N, 0, state.generated_N),
      finished_N=jnp.where(admit_N, False, state.finished_N),
      next_request=next_request, rng=rng,
      history_request_N=jnp.where(admit_N, request_N, state.history_request_N))
  if on_admit is not None:
    state = on_admit(state, admit_N, prompt_N, prompts)
  state, _ = emit(state, first_N[:, None], first_log_prob_N, admit_N.astype(jnp.int32),
                  sampling)
  return state


def count_requests(prompts: Prompts) -> Array:
  """Requests to decode: the first ones of ``prompt_of_request_R``, whose padding rows
  (-1, after every real request) are never admitted. Padding lets calls with nearby
  request counts share one compiled program (``sampling.programs``)."""
  return jnp.sum(prompts.prompt_of_request_R >= 0, dtype=jnp.int32)


def live_sequences(state: DecodeState, num_requests: int | Array) -> Array:
  """Sequences still decoding plus requests still waiting for a slot."""
  return (jnp.sum(state.active_N, dtype=jnp.int32)
          + jnp.maximum(num_requests - state.next_request, 0))


def is_done(state: DecodeState, num_requests: int | Array) -> Array:
  """True once every request has finished (or the page pool ran out)."""
  busy = jnp.any(state.active_N) | (state.next_request < num_requests)
  return ~busy | state.pool.exhausted
