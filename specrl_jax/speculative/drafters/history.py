"""Rollout-history drafting: continue the current response as earlier rollouts of the
same prompt continued it.

GRPO samples G responses per prompt and revisits its prompts every epoch, so the best
guess of what the policy writes next is often what it wrote before for the same
prompt. ``History`` searches three sources for the longest suffix of each sequence and
proposes what followed it (the recency-weighted distribution of continuations, as the
n-gram drafter does over one sequence):

  - the bank: earlier rollouts of the prompt (previous epochs), held host-side in a
    fixed-size ``HistoryStore`` (``history_store.py``) and handed to the compiled
    program through ``params()``;
  - siblings: the other samples of the same prompt in this call, in flight or finished
    (the slot rows the engine keeps, plus a bounded in-loop table of finished rollouts
    whose slots were reused);
  - the sequence itself (prompt lookup).

A prompt is identified by a 32-bit hash of its tokens computed the same way on the host
and inside the loop, so no engine change is needed. A collision only mixes two prompts'
histories: it can lower acceptance, never change what is sampled.

With a ``fallback`` drafter (EAGLE-3, MTP, a draft model) every node of the draft tree
takes its q from the history when a suffix of at least ``min_match`` tokens matched and
from the fallback otherwise. Either way the q a child was drawn from is the q the
verifier sees, so decoding stays exactly lossless.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import ConfigError
from specrl_jax.speculative.drafters.base import Drafter, RoundInputs, TreeLevel
from specrl_jax.speculative.drafters.history_store import (HistoryConfig, HistoryStore,
                                                           prompt_keys, rollout_rows,
                                                           store_layout)
from specrl_jax.speculative.drafters.matching import (
    continuations_log_probs, extend_runs, suffix_runs,
)

Array = jax.Array

# Which drafter the root of a round's tree came from (per slot, for the statistics).
SOURCE_NONE, SOURCE_HISTORY, SOURCE_FALLBACK = 0, 1, 2


# ----------------------------------------------------------------- in-loop state

@flax.struct.dataclass
class FinishedTable:
  """Rollouts finished in this call whose slots were reused (ring of U rows)."""
  rows_UxL: Array
  keys_U: Array
  stamps_U: Array      # insertion order (-1: empty)
  clock: Array


@flax.struct.dataclass
class HistoryState:
  """The history drafter's per-slot state and counters (N slots)."""
  request_N: Array           # the last request each slot served (-1: none yet)
  keys_N: Array              # its prompt's key
  rows_NxL: Array            # its rollout so far (``rollout_rows`` format)
  root_source_N: Array       # SOURCE_* of this round's root q
  finished: FinishedTable
  counters: dict[str, Array]
  fallback: Any = ()


COUNTERS = ("history_rounds", "history_accepted", "fallback_rounds", "fallback_accepted",
            "silent_rounds")


def _retire(table: FinishedTable, retire_N: Array, keys_N: Array, rows_NxL: Array
            ) -> FinishedTable:
  """Appends the rows of ``retire_N`` to the ring, overwriting its oldest rows."""
  size = table.keys_U.shape[0]
  order_N = jnp.cumsum(retire_N) - 1
  index_N = jnp.where(retire_N, (table.clock + order_N) % size, size)
  stamp_N = table.clock + order_N
  return FinishedTable(
      rows_UxL=table.rows_UxL.at[index_N].set(rows_NxL, mode="drop"),
      keys_U=table.keys_U.at[index_N].set(keys_N, mode="drop"),
      stamps_U=table.stamps_U.at[index_N].set(stamp_N, mode="drop"),
      clock=table.clock + jnp.sum(retire_N, dtype=jnp.int32))


def _newest(scores_NxR: Array, count: int) -> tuple[Array, Array]:
  """Indices of the ``count`` highest non-negative scores per row, oldest of them
  first (the matcher weights later positions higher), and their validity."""
  top_NxG, index_NxG = jax.lax.top_k(scores_NxR, count)
  return index_NxG[:, ::-1], top_NxG[:, ::-1] >= 0


# ----------------------------------------------------------------- the drafter

class History(Drafter):
  """``sj.drafters.History(fallback=None, *, config=HistoryConfig(), **overrides)``.

  Training-free drafting from earlier rollouts of the same prompt (see the module
  docstring); ``History(fallback=sj.drafters.Eagle3(...))`` uses the learned drafter
  where the history has no match of ``min_match`` tokens. Call
  ``observe(prompts, output)`` after each ``generate`` to remember its rollouts; the
  store (``.store``) is shared with the bound copies ``generate`` makes.
  """

  def __init__(self, fallback: Drafter | None = None, *, config: HistoryConfig | None = None,
               store: HistoryStore | None = None, vocab_size: int | None = None,
               **overrides):
    if fallback is not None and not isinstance(fallback, Drafter):
      raise TypeError(f"History.fallback must be an sj.drafters.Drafter or None, got "
                      f"{type(fallback).__name__}.")
    if isinstance(fallback, History):
      raise ConfigError("History.fallback=History(...) is invalid: expected a learned or "
                        "n-gram drafter (a history drafter already searches its history).")
    config = config or HistoryConfig()
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(HistoryConfig)})
    if unknown:
      raise ConfigError(f"History got unknown option(s) {unknown}: expected fields of "
                        "HistoryConfig.")
    config = dataclasses.replace(config, **overrides)
    if config.min_match is None:
      config = dataclasses.replace(
          config, min_match=1 if fallback is None else max(1, config.max_match // 2))
    self.config = config
    if store is not None and store_layout(store.config) != store_layout(self.config):
      raise ConfigError(f"History.store holds rollouts laid out as {store_layout(store.config)} "
                        f"(max_prompts, rollouts_per_prompt, rollout_tokens, max_match); this "
                        f"drafter needs {store_layout(self.config)}.")
    self.store = store or HistoryStore(self.config)
    self.fallback = fallback
    self.vocab_size = vocab_size
    self.hidden_layers = fallback.hidden_layers if fallback is not None else ()

  # The store is deliberately left out: its contents travel through params(), so one
  # compiled program serves every epoch.
  def __hash__(self):
    return hash((History, self.config, self.vocab_size, self.fallback))

  def __eq__(self, other):
    return (isinstance(other, History) and other.config == self.config
            and other.vocab_size == self.vocab_size and other.fallback == self.fallback)

  # ----------------------------------------------------------------- host side

  def observe(self, prompts: Sequence[Sequence[int]], output) -> None:
    """Remembers the rollouts of a ``generate`` call (``output.tokens`` / ``lengths``)
    for later calls on the same prompts."""
    tokens, lengths = np.asarray(output.tokens), np.asarray(output.lengths)
    if len(prompts) != tokens.shape[0]:
      raise ValueError(f"observe got {len(prompts)} prompts but {tokens.shape[0]} rollouts.")
    for prompt, row, length in zip(prompts, tokens, lengths):
      self.store.add([int(t) for t in prompt], row[:int(length)].tolist())

  def known_fraction(self, prompts: Sequence[Sequence[int]]) -> float:
    """Fraction of the distinct prompts with earlier rollouts in the store. Sibling
    matches alone rarely pay for a speculative round, so a caller may decode plainly
    (or with the fallback alone) while this is low, e.g. in the first epoch."""
    distinct = {tuple(int(t) for t in prompt) for prompt in prompts}
    return sum(self.store.holds(p) for p in distinct) / max(len(distinct), 1)

  def stats(self, state: HistoryState) -> dict[str, float]:
    """Proposals and acceptance per source, from the final drafter state. Rounds are
    slot-rounds, attributed to the source of the tree's root q."""
    counters = {name: int(np.asarray(state.counters[name])) for name in COUNTERS}
    result: dict[str, float] = dict(counters)
    for source in ("history", "fallback"):
      rounds = counters[f"{source}_rounds"]
      result[f"{source}_acceptance_length"] = (
          1.0 + counters[f"{source}_accepted"] / rounds if rounds else float("nan"))
    total = sum(counters[f"{s}_rounds"] for s in ("history", "fallback", "silent"))
    result["history_share"] = counters["history_rounds"] / total if total else float("nan")
    return result

  # ----------------------------------------------------------------- binding

  def check_target(self, target_config) -> None:
    if self.vocab_size is not None and self.vocab_size != target_config.vocab_size:
      raise ConfigError(f"History vocab_size={self.vocab_size} does not match the target's "
                        f"vocab_size={target_config.vocab_size}.")
    if self.fallback is not None:
      self.fallback.check_target(target_config)

  def bind(self, target_config) -> "History":
    self.check_target(target_config)
    fallback = self.fallback.bind(target_config) if self.fallback is not None else None
    return History(fallback, config=self.config, store=self.store,
                   vocab_size=target_config.vocab_size)

  def kv_layers(self):
    return self.fallback.kv_layers() if self.fallback is not None else ()

  def params(self):
    return {"bank": self.store.device_arrays(),
            "fallback": self.fallback.params() if self.fallback is not None else ()}

  def init_state(self, num_slots: int) -> HistoryState:
    c = self.config
    size, length = c.finished_rollouts, c.rollout_tokens
    zeros_N = jnp.zeros((num_slots,), jnp.int32)
    return HistoryState(
        request_N=zeros_N - 1, keys_N=jnp.zeros((num_slots,), jnp.uint32),
        rows_NxL=jnp.full((num_slots, length), -1, jnp.int32), root_source_N=zeros_N,
        finished=FinishedTable(rows_UxL=jnp.full((size, length), -1, jnp.int32),
                               keys_U=jnp.zeros((size,), jnp.uint32),
                               stamps_U=jnp.full((size,), -1, jnp.int32), clock=jnp.int32(0)),
        counters={name: jnp.int32(0) for name in COUNTERS},
        fallback=self.fallback.init_state(num_slots) if self.fallback is not None else ())

  def prefill(self, params, state, kv, tokens_UxT, lengths_U, target_output):
    if self.fallback is None:
      return state, kv
    fallback_state, kv = self.fallback.prefill(params["fallback"], state.fallback, kv,
                                               tokens_UxT, lengths_U, target_output)
    return state.replace(fallback=fallback_state), kv

  def on_admit(self, params, state, admit_N, prompt_lengths_N):
    if self.fallback is None:
      return state
    return state.replace(fallback=self.fallback.on_admit(params["fallback"], state.fallback,
                                                         admit_N, prompt_lengths_N))

  def compact_state(self, state, slots_W):
    # A dropped slot's last rollout joins the finished table, as when a slot is refilled.
    kept_N = jnp.zeros(state.request_N.shape, bool).at[slots_W].set(True)
    finished = _retire(state.finished, (state.request_N >= 0) & ~kept_N, state.keys_N,
                       state.rows_NxL)
    fallback = (self.fallback.compact_state(state.fallback, slots_W)
                if self.fallback is not None else ())
    return state.replace(request_N=state.request_N[slots_W], keys_N=state.keys_N[slots_W],
                         rows_NxL=state.rows_NxL[slots_W],
                         root_source_N=state.root_source_N[slots_W], finished=finished,
                         fallback=fallback)

  # ----------------------------------------------------------------- matching

  def _sources(self, bank, finished: FinishedTable, inputs: RoundInputs, keys_N: Array,
               request_N: Array) -> Array:
    """int32 [N, C]: everything each slot searches, oldest first (later positions weigh
    more), rollouts separated by -1."""
    c = self.config
    num_slots = keys_N.shape[0]
    segments = []

    hit_NxP = bank["valid_P"][None, :] & (bank["keys_P"][None, :] == keys_N[:, None])
    bank_NxGxL = bank["tokens_PxGxL"][jnp.argmax(hit_NxP, axis=1)]
    segments.append(jnp.where(jnp.any(hit_NxP, axis=1)[:, None],
                              bank_NxGxL.reshape(num_slots, -1), -1))

    count = min(c.siblings, c.finished_rollouts)
    if count:
      same_NxU = (finished.stamps_U[None, :] >= 0) & (finished.keys_U[None, :] == keys_N[:, None])
      index_NxG, valid_NxG = _newest(jnp.where(same_NxU, finished.stamps_U[None, :], -1), count)
      rows_NxGxL = jnp.where(valid_NxG[..., None], finished.rows_UxL[index_NxG], -1)
      segments.append(rows_NxGxL.reshape(num_slots, -1))

    count = min(c.siblings, num_slots - 1)
    if count:
      # Slot rows keep a finished sibling's rollout until the slot takes a new request.
      live_N = inputs.prompt_lengths_N > 0
      same_NxN = ((keys_N[None, :] == keys_N[:, None]) & live_N[None, :]
                  & ~jnp.eye(num_slots, dtype=bool))
      index_NxG, valid_NxG = _newest(jnp.where(same_NxN, request_N[None, :], -1), count)
      rows_NxL = rollout_rows(inputs.history_NxC, inputs.prompt_lengths_N, c)
      segments.append(jnp.where(valid_NxG[..., None], rows_NxL[index_NxG], -1)
                      .reshape(num_slots, -1))

    segments.append(inputs.history_NxC)
    return jnp.concatenate(segments, axis=1)

  def _tail(self, inputs: RoundInputs) -> Array:
    """The last max_match tokens of each slot's sequence [N, n] (-1 before its start)."""
    n = self.config.max_match
    offsets_Nxn = inputs.cache_lengths_N[:, None] + 1 - n + jnp.arange(n)[None, :]
    context = inputs.history_NxC.shape[1]
    tail_Nxn = jnp.take_along_axis(inputs.history_NxC, jnp.clip(offsets_Nxn, 0, context - 1),
                                   axis=1)
    return jnp.where(offsets_Nxn >= 0, tail_Nxn, -1)

  def _history_log_q(self, sources_NxC: Array, run_NxWxC: Array) -> Array:
    return continuations_log_probs(sources_NxC, run_NxWxC, self.vocab_size,
                                   self.config.min_match)

  # ----------------------------------------------------------------- the round

  def start(self, params, state: HistoryState, kv, inputs, sampling, max_pending):
    request_N = inputs.slot_request_N
    # A slot that took a new request has overwritten its row: keep the old rollout.
    retire_N = (state.request_N >= 0) & (request_N >= 0) & (request_N != state.request_N)
    finished = _retire(state.finished, retire_N, state.keys_N, state.rows_NxL)
    keys_N = prompt_keys(inputs.history_NxC, inputs.prompt_lengths_N)
    request_N = jnp.where(request_N >= 0, request_N, state.request_N)

    sources_NxC = self._sources(params["bank"], finished, inputs, keys_N, request_N)
    run_Nx1xC = suffix_runs(sources_NxC, self._tail(inputs)[:, None], self.config.max_match)
    log_q_NxV = self._history_log_q(sources_NxC, run_Nx1xC)[:, 0]
    from_history_N = jnp.any(log_q_NxV > -jnp.inf, axis=-1)

    fallback_state, fallback_scratch = state.fallback, ()
    if self.fallback is not None:
      fallback_log_q_NxV, fallback_state, kv, fallback_scratch = self.fallback.start(
          params["fallback"], state.fallback, kv, inputs, sampling, max_pending)
      log_q_NxV = jnp.where(from_history_N[:, None], log_q_NxV, fallback_log_q_NxV)
      otherwise = SOURCE_FALLBACK
    else:
      otherwise = SOURCE_NONE
    source_N = jnp.where(from_history_N, SOURCE_HISTORY, otherwise)
    state = state.replace(request_N=request_N, keys_N=keys_N, finished=finished,
                          root_source_N=source_N, fallback=fallback_state)
    # Deeper levels extend the root's runs by their tokens (see ``extend_runs``).
    return log_q_NxV, state, kv, (sources_NxC, run_Nx1xC, fallback_scratch)

  def extend(self, params, state: HistoryState, kv, scratch, inputs, level: TreeLevel):
    sources_NxC, parent_runs_NxPxC, fallback_scratch = scratch
    run_NxWxC = extend_runs(sources_NxC, parent_runs_NxPxC, level.tokens_NxW,
                            self.config.max_match)
    log_q_NxWxV = self._history_log_q(sources_NxC, run_NxWxC)
    if self.fallback is not None:
      fallback_log_q_NxWxV, fallback_scratch = self.fallback.extend(
          params["fallback"], state.fallback, kv, fallback_scratch, inputs, level)
      from_history_NxW = jnp.any(log_q_NxWxV > -jnp.inf, axis=-1)
      log_q_NxWxV = jnp.where(from_history_NxW[..., None], log_q_NxWxV, fallback_log_q_NxWxV)
    return log_q_NxWxV, (sources_NxC, run_NxWxC, fallback_scratch)

  def finish(self, params, state: HistoryState, kv, inputs, verdict, target_output):
    if self.fallback is not None:
      fallback_state, kv = self.fallback.finish(params["fallback"], state.fallback, kv,
                                                inputs, verdict, target_output)
      state = state.replace(fallback=fallback_state)
    active_N = inputs.active_N
    accepted_N = jnp.where(active_N, verdict.num_accepted_N, 0)
    counters = dict(state.counters)
    for name, source in (("history", SOURCE_HISTORY), ("fallback", SOURCE_FALLBACK),
                         ("silent", SOURCE_NONE)):
      used_N = active_N & (state.root_source_N == source)
      counters[f"{name}_rounds"] += jnp.sum(used_N, dtype=jnp.int32)
      if name != "silent":
        counters[f"{name}_accepted"] += jnp.sum(jnp.where(used_N, accepted_N, 0), dtype=jnp.int32)

    # Each slot's rollout so far, this round's tokens included (tokens past a stop or
    # the budget may follow; nothing is ever drafted after them), kept for the start of
    # the round that finds the slot's row overwritten by a new request.
    num_emitted = verdict.tokens_NxE.shape[1]
    rows_NxL = rollout_rows(inputs.history_NxC, inputs.prompt_lengths_N, self.config)
    first_N = jnp.maximum(inputs.prompt_lengths_N - self.config.max_match, 0)
    columns_NxE = (inputs.cache_lengths_N + 1 - first_N)[:, None] + jnp.arange(num_emitted)
    write_NxE = ((jnp.arange(num_emitted)[None, :] <= accepted_N[:, None]) & active_N[:, None]
                 & (columns_NxE < self.config.rollout_tokens - 1))
    rows_NxL = rows_NxL.at[jnp.arange(rows_NxL.shape[0])[:, None],
                           jnp.where(write_NxE, columns_NxE, self.config.rollout_tokens)].set(
                               verdict.tokens_NxE, mode="drop")
    return state.replace(rows_NxL=rows_NxL, counters=counters), kv
