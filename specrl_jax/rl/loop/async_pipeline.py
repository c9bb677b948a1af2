"""Asynchronous GRPO: rollouts and training on disjoint device meshes, overlapped.

The rollout mesh generates batch b with the newest weights it has while the train
mesh updates on batch b - 1 (or older). Each trajectory batch carries the policy
version (number of updates) of the weights that produced it; an update u may train
on a batch of version v only if u - v <= max_policy_lag. The schedule keeps that
bound by construction: batch b is started only once version b - max_policy_lag has
been pushed to the rollout mesh (until then generation waits), and ``check_lag``
refuses anything older before it reaches the learner.

Everything is dispatched from one host thread; JAX's asynchronous dispatch lets the
two meshes run concurrently, and array dependencies order the work. After each update
the new policy (and online drafter) weights are pushed to the rollout mesh device to
device with ``parallel.distributed.transfer`` (``jax.device_put`` when one process
holds both meshes, a broadcast collective when they belong to different processes);
trajectories and metrics travel the same way, so the two meshes may sit on different
hosts. Every process runs this same loop (multi-controller JAX). The ratio
correction for stale rollouts is the learner's truncated importance sampling
(``GRPOConfig.tis_cap``) between the trainer's log-probs and the rollout's.

Resuming exactly: when update u - 1 is done, batches u .. u + max_policy_lag - 1 are
already generated (or generating) from policy versions older than u, which a
checkpoint of the train state alone no longer holds. ``in_flight()`` hands them back
as host data to checkpoint with the state, and ``run(..., in_flight=...)`` trains on
them instead of generating them anew, so a resumed run takes the uninterrupted run's
steps.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specrl_jax.config import ConfigError, SpecConfig, check
from specrl_jax.parallel import distributed
from specrl_jax.parallel.mesh import batch_sharding, data_parallel_size
from specrl_jax.rl.loop.learn_step import make_learn_step
from specrl_jax.rl.loop.learner import Batch, LearnerConfig, TrainState
from specrl_jax.rl.loop.online_drafters import OnlineDrafter
from specrl_jax.rl.loop.rollout import (
    RolloutConfig, Trajectories, make_rollout, rollout_drafter_params, rollout_metrics,
)
from specrl_jax.rl.loop.shape_control import check_controller, refreshed
from specrl_jax.rl.loop.sync import to_host
from specrl_jax.rl.tasks.base import PromptBatch, Task
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.sharded import rollout_shardings
from specrl_jax.speculative.inloop import InLoopState
from specrl_jax.speculative.drafters.base import Drafter


class StalePolicyError(RuntimeError):
  """A trajectory batch is older than max_policy_lag allows."""


def check_lag(update: int, policy_version: int, max_policy_lag: int) -> int:
  """The lag of training update ``update`` on a batch of ``policy_version``; raises
  StalePolicyError past the bound (or for a batch from the future)."""
  lag = update - policy_version
  if not 0 <= lag <= max_policy_lag:
    raise StalePolicyError(
        f"update {update} was handed trajectories of policy version {policy_version} "
        f"(lag {lag}); allowed lag is 0..max_policy_lag={max_policy_lag}.")
  return lag


def rollout_version(batch: int, max_policy_lag: int, first_version: int = 0) -> int:
  """The oldest policy version batch ``batch`` may be generated with (the schedule
  generates it with exactly this one, as early as possible)."""
  return max(first_version, batch - max_policy_lag)


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """What the pipeline hands back after each update (metrics are host values)."""
  update: int
  state: TrainState
  metrics: dict[str, Any]


_REST = ("rewards_R", "lengths_R", "counters", "exhausted", "policy_version")


def _rest(trajectories: Trajectories) -> dict[str, Any]:
  """The fields beside the rows that travel to the train mesh (the in-loop controller's
  state when rollouts carry one)."""
  rest = {name: getattr(trajectories, name) for name in _REST}
  if trajectories.controller is not None:
    rest["controller"] = trajectories.controller
  return rest


def _host_batch(batch: int, trajectories: Trajectories) -> dict[str, Any]:
  """One in-flight batch as numpy data (Batch fields left None are left out)."""
  rows = {field.name: getattr(trajectories.batch, field.name)
          for field in dataclasses.fields(Batch)
          if getattr(trajectories.batch, field.name) is not None}
  rest = _rest(trajectories)
  if "controller" in rest:  # as a plain dict: checkpoints restore host data as dicts
    rest["controller"] = dataclasses.asdict(rest["controller"])
  return {"batch": np.asarray(batch, np.int64), "rows": rows, **rest}


@dataclasses.dataclass
class _Started:
  """A batch dispatched (or restored) and not trained on yet."""
  batch: int
  version: int
  started: float
  trajectories: Trajectories
  ready: concurrent.futures.Future
  on_train_mesh: bool = False
  seconds: float | None = None  # a restored batch's rollout seconds, as first measured
  compiled: bool = False  # its rollout compiled the program: its seconds time that too

  def rollout_seconds(self, previous_done: float) -> float:
    """Its rollout's seconds: from its start, or from the end of the rollout before it
    (the rollout mesh runs one batch at a time)."""
    if self.seconds is None:
      self.seconds = self.ready.result() - max(self.started, previous_done)
    return self.seconds


def _when_ready(pool: concurrent.futures.Executor, tree) -> concurrent.futures.Future:
  """A future of the wall time at which ``tree``'s arrays are computed."""
  return pool.submit(lambda: (jax.block_until_ready(tree), time.perf_counter())[1])


class AsyncPipeline:
  """Overlapped rollouts (``rollout_mesh``) and updates (``train_mesh``)."""

  def __init__(self, graphdef: nnx.GraphDef, model_config, task: Task, learner: LearnerConfig,
               rollout_config: RolloutConfig, *, rollout_mesh: Mesh, train_mesh: Mesh,
               state: TrainState, prompt_width: int, max_policy_lag: int,
               drafter: Drafter | None = None, online: OnlineDrafter | None = None,
               spec: SpecConfig | None = None, engine: EngineConfig = EngineConfig()):
    check(isinstance(max_policy_lag, int) and max_policy_lag >= 0, "AsyncPipeline",
          "max_policy_lag", max_policy_lag, "an integer >= 0")
    shared = set(rollout_mesh.devices.flat) & set(train_mesh.devices.flat)
    if shared:
      raise ConfigError(f"rollout and train meshes share devices {sorted(d.id for d in shared)}: "
                        "async RL needs disjoint device sets.")
    if online is not None:
      drafter = online.drafter
    check_controller(state, spec)
    self.max_policy_lag = max_policy_lag
    self.rollout_mesh, self.train_mesh = rollout_mesh, train_mesh
    self.online, self.drafter = online, drafter
    self.max_new_tokens = rollout_config.sampling.max_new_tokens
    learn = make_learn_step(graphdef, learner, train_mesh, state, rollout=rollout_config,
                            drafter=online.objective if online else None)
    self.train_step = learn.train_step
    rollout = make_rollout(graphdef, model_config, task, rollout_config, rollout_mesh,
                           prompt_width=prompt_width, drafter=drafter, spec=spec, engine=engine)
    self._drafter_params = rollout_drafter_params(drafter, online)
    self._rollout = jax.jit(rollout)
    shardings = self.train_step.state_shardings
    self._train = jax.jit(learn, in_shardings=(shardings, None),
                          out_shardings=(shardings, NamedSharding(train_mesh, P())),
                          donate_argnums=0)
    self._rollout_rows = batch_sharding(rollout_mesh)
    self._train_rows = batch_sharding(train_mesh)
    # (update, policy version) of every batch trained on: the lag record tests read.
    self.trained_on: list[tuple[int, int]] = []
    self._in_flight: collections.deque[_Started] = collections.deque()
    self._last_rollout_ready = time.perf_counter()
    self._rollouts = 0  # dispatched by this pipeline: the first compiles its program

  @property
  def rollout_program(self):
    """The jitted rollout on the rollout mesh: ``(params, drafter_params, prompts, rng,
    version) -> Trajectories`` (e.g. to lower it for another platform)."""
    return self._rollout

  @property
  def train_program(self):
    """The jitted learn step on the train mesh: ``(state, trajectories) -> (state,
    metrics)``, the state donated."""
    return self._train

  # -------------------------------------------------------------- weights and data

  def push_weights(self, state: TrainState):
    """The rollout's copy of the policy (and drafter) weights: a reshard onto the
    rollout mesh, split over its "tensor" axis and whole along its batch axes (each
    rollout shard decodes with the whole of its tensor slice); a small drafter is
    replicated there. The weights go in the model's compute dtype (cast from the master
    copies before the transfer: half the bytes of float32 for a bfloat16 model)."""
    drafter = self._drafter_params(state)
    params = state.compute_params()
    return distributed.transfer((params, drafter), self._rollout_layout(params, drafter))

  def push_controller(self, state: TrainState) -> InLoopState | None:
    """The in-loop controller's state on the rollout mesh (None without one): what
    the updates so far measured reaches the next rollout with the weights."""
    if state.controller is None:
      return None
    replicated = NamedSharding(self.rollout_mesh, P())
    return distributed.transfer(state.controller, jax.tree.map(
        lambda _: replicated, state.controller))

  def _refreshed(self, trajectories: Trajectories, seconds: float, weight: float
                 ) -> InLoopState:
    """The controller the rollout handed back, its round costs refreshed from the
    rollout's ``seconds`` when ``weight`` > 0 (process 0's seconds on every process:
    all must choose alike)."""
    if weight <= 0:
      return trajectories.controller
    if jax.process_count() > 1:
      seconds = float(multihost_utils.broadcast_one_to_all(np.float64(seconds)))
    rounds_SxW = distributed.fetch(trajectories.counters["shape_rounds_SxW"])
    return refreshed(trajectories.controller, rounds_SxW, seconds, weight=weight,
                     shards=data_parallel_size(self.rollout_mesh))

  def _rollout_layout(self, params, drafter_params):
    layout, drafter_layout, _ = rollout_shardings(params, drafter_params, self.rollout_mesh)
    return layout, drafter_layout

  def _to_train_mesh(self, trajectories: Trajectories) -> Trajectories:
    parts = (trajectories.batch, _rest(trajectories))
    batch, moved = distributed.transfer(parts, self._train_layout(parts))
    return trajectories.replace(batch=batch, **moved)

  def _train_layout(self, parts):
    """Where (batch, the rest) of trajectories go on the train mesh: rows split as
    the learner takes them, the rest replicated."""
    batch, rest = parts
    replicated = NamedSharding(self.train_mesh, P())
    return (jax.tree.map(lambda x: self._train_rows, batch),
            jax.tree.map(lambda x: replicated, rest))

  def in_flight(self) -> dict[str, Any]:
    """The batches started and not trained on yet, with the policy version each
    came from, as numpy data (the same on every process; every process must call
    it): what a checkpoint of the state after the last update yielded needs for
    ``run(..., in_flight=...)``. Waits for their rollouts."""
    started = list(self._in_flight)
    host = distributed.fetch([s.trajectories for s in started])
    previous_done, seconds = self._last_rollout_ready, []
    for batch in started:
      seconds.append(batch.rollout_seconds(previous_done))
      previous_done = batch.ready.result()
    return {"count": np.asarray(len(started), np.int32),
            **{str(index): {**_host_batch(s.batch, trajectories),
                            "rollout_seconds": np.asarray(t, np.float64),
                            "rollout_compiled": np.asarray(s.compiled)}
               for index, (s, trajectories, t) in enumerate(zip(started, host, seconds))}}

  def _restore(self, in_flight: dict[str, Any], first_update: int, end: int,
               pool: concurrent.futures.Executor) -> list[_Started]:
    """``in_flight()``'s batches (those before ``end``) on the train mesh."""
    restored = []
    for index in range(int(in_flight["count"])):
      host = in_flight[str(index)]
      batch = int(host["batch"])
      if batch != first_update + index:
        raise ConfigError(f"in-flight batch {index} is batch {batch}; resuming at update "
                         f"{first_update} expects batch {first_update + index}.")
      if batch >= end:
        break
      rest = {name: host[name] for name in _REST}
      if "controller" in host:
        rest["controller"] = InLoopState(**host["controller"])
      parts = (Batch(**host["rows"]), rest)
      # Each process supplies its own devices' slices of the host copy it holds.
      rows, rest = jax.tree.map(
          lambda x, sharding: jax.make_array_from_callback(
              np.shape(x), sharding, lambda where, x=np.asarray(x): x[where]),
          parts, self._train_layout(parts))
      trajectories = Trajectories(batch=rows, **rest)
      seconds = host.get("rollout_seconds")  # absent from checkpoints before refresh
      restored.append(_Started(batch, int(host["policy_version"]), time.perf_counter(),
                               trajectories, _when_ready(pool, trajectories),
                               on_train_mesh=True,
                               seconds=None if seconds is None else float(seconds),
                               compiled=bool(host.get("rollout_compiled", True))))
    return restored

  # -------------------------------------------------------------- the loop

  def run(self, state: TrainState, *, first_update: int, num_updates: int,
          prompts_of: Callable[[int], PromptBatch], rng_of: Callable[[int], jax.Array],
          max_policy_lag: int | None = None, in_flight: dict[str, Any] | None = None,
          refresh_weight: float = 0.0) -> Iterator[StepRecord]:
    """Yields one StepRecord per update in [first_update, first_update + num_updates).

    prompts_of(b) / rng_of(b): the host prompts and the rollout key of batch b (batch
    b is the one update b trains on). max_policy_lag overrides the pipeline's bound
    for this run (the compiled programs do not depend on it). in_flight: what
    ``in_flight()`` returned right after update first_update - 1 (resuming): those
    batches are trained on as they are, the rest generated as the schedule says.
    refresh_weight > 0: each rollout's own seconds refresh the in-loop controller's
    round costs before the next rollout gets it (``shape_control.refreshed``), but for
    the first rollout this pipeline dispatches, whose seconds include compiling it.
    """
    lag = self.max_policy_lag if max_policy_lag is None else max_policy_lag
    check(isinstance(lag, int) and lag >= 0, "AsyncPipeline.run", "max_policy_lag", lag,
          "an integer >= 0")
    end = first_update + num_updates
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)
    pushed, pushed_version = self.push_weights(state) + (self.push_controller(state),), first_update
    self._in_flight = started_batches = collections.deque(
        [] if in_flight is None else self._restore(in_flight, first_update, end, pool))
    next_batch = first_update + len(started_batches)
    self._last_rollout_ready = last_train_ready = time.perf_counter()
    previous_yield = time.perf_counter()
    try:
      for update in range(first_update, end):
        # Start every batch whose policy would still be fresh enough when trained on.
        while next_batch < end and next_batch <= update + lag:
          if pushed_version < rollout_version(next_batch, lag, first_update):
            break  # wait for newer weights
          prompts = jax.device_put(prompts_of(next_batch), self._rollout_rows)
          started = time.perf_counter()
          trajectories = self._rollout(pushed[0], pushed[1], prompts, rng_of(next_batch),
                                       pushed_version, pushed[2])
          started_batches.append(_Started(next_batch, pushed_version, started, trajectories,
                                          _when_ready(pool, trajectories),
                                          compiled=self._rollouts == 0))
          self._rollouts += 1
          next_batch += 1
        batch = started_batches.popleft()
        assert batch.batch == update
        version = batch.version
        check_lag(update, version, lag)
        self.trained_on.append((update, version))
        trajectories = (batch.trajectories if batch.on_train_mesh
                        else self._to_train_mesh(batch.trajectories))
        rollout_stats = rollout_metrics(trajectories, self.max_new_tokens)
        train_started = time.perf_counter()
        state, metrics = self._train(state, trajectories)
        # Waiting for the rollout here delays nothing: the update just dispatched
        # waits for it too, and the next rollout for the update's weights.
        rollout_seconds = batch.rollout_seconds(self._last_rollout_ready)
        self._last_rollout_ready = rollout_done = batch.ready.result()
        if trajectories.controller is not None:
          state = state.replace(controller=self._refreshed(
              trajectories, rollout_seconds, 0.0 if batch.compiled else refresh_weight))
        train_ready = _when_ready(pool, (state.params, metrics))
        push_started = time.perf_counter()
        pushed = self.push_weights(state) + (self.push_controller(state),)
        pushed_version = update + 1
        push_ready = _when_ready(pool, pushed)

        # Read on every process, wherever the train mesh lives.
        host = to_host(distributed.fetch({**metrics, **rollout_stats}))
        train_done, push_done = train_ready.result(), push_ready.result()
        train_seconds = train_done - max(train_started, rollout_done, last_train_ready)
        exposed = max(0.0, rollout_done - last_train_ready)
        last_train_ready = train_done
        now = time.perf_counter()
        host.update(policy_lag=update - version, rollout_seconds=rollout_seconds,
                    train_seconds=train_seconds, exposed_rollout_seconds=exposed,
                    sync_seconds=max(0.0, push_done - max(push_started, train_done)),
                    step_seconds=now - previous_yield)
        previous_yield = now
        yield StepRecord(update=update, state=state, metrics=host)
    finally:
      self._in_flight = collections.deque()
      pool.shutdown(wait=True)
