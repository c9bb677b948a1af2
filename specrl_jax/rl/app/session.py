"""One `specrl train` experiment: its task and data, the warm start, and GRPO (sync or
async) with metrics, checkpoints and resume (``Session``)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.experimental import multihost_utils

from specrl_jax import checkpoint
from specrl_jax.config import ConfigError
from specrl_jax.parallel import distributed
from specrl_jax.rl.app import data_fingerprint, resume, run_data, run_directory, run_plan
from specrl_jax.rl.app.drafter_registry import build_drafter
from specrl_jax.rl.app.experiment import ExperimentConfig, to_dict
from specrl_jax.rl.app.guards import CollapseDetector, check_step
from specrl_jax.rl.app.inloop_setup import abstract_controller, add_controller, round_cost_table
from specrl_jax.rl.app.meshes import check_layout, checkpoint_mesh, run_meshes
from specrl_jax.rl.app.metrics import MetricsWriter, read_jsonl, with_rates
from specrl_jax.rl.app.run_outputs import RunOutputs, open_run_outputs, run_summary
from specrl_jax.rl.app.warm_start import Models, fresh_models, warm_start
from specrl_jax.rl.loop import numerics
from specrl_jax.rl.loop.async_pipeline import AsyncPipeline
from specrl_jax.rl.loop.learner import TrainState, abstract_train_state, init_train_state
from specrl_jax.rl.loop.online_drafters import OnlineDrafter
from specrl_jax.rl.loop.shape_calibration import rollout_widths
from specrl_jax.rl.loop.sync import RLProgram, build_program, prompts_on_mesh, to_host
from specrl_jax.rl.tasks import PromptSet, Task, make_prompt_set, step_indices

__all__ = ["Models", "Session"]


class Session:
  """One experiment: task, warm-started models, the RL program, and its outputs."""

  def __init__(self, config: ExperimentConfig, *, task: Task | None = None,
               log: Callable[[str], None] = print,
               on_step: Callable[[int, dict[str, Any]], None] | None = None):
    """on_step(step, metrics): called after each RL step's metrics are written (the
    demo marks the end of step 0 with it to count what compiles after)."""
    self.config = config
    self.log = log
    self.on_step = on_step
    self.policy_positions = run_data.policy_positions(config)  # checks the folder first
    # The policy's own tokenizer drives prompts, stop tokens and decoding.
    self.text_tokenizer = run_data.policy_tokenizer(config)
    self.fingerprint = run_data.data_fingerprint(
        config, task, config.output.resume and bool(self.checkpoint_steps()), log)
    self.task, self.eval_task = run_data.run_tasks(config, self.text_tokenizer, task, log=log,
                                                   fingerprint=self.fingerprint)
    self.prompt_set: PromptSet = make_prompt_set(
        self.task, config.task.num_prompts, seed=config.task.seed,
        max_prompt_tokens=self.task.max_prompt_tokens)
    self.learner = config.learner_config()
    self.rollout_config = config.rl.rollout(self.task.max_response_tokens,
                                            self.text_tokenizer.eos_ids)
    self.engine = config.rl.engine
    self.spec = config.drafter.spec()
    self.timings: dict[str, float] = {}

  @property
  def directory(self) -> str:
    return self.config.output.directory

  # ------------------------------------------------------------ warm start

  @property
  def prompt_width(self) -> int:
    return int(self.prompt_set.tokens_PxT.shape[1])

  @property
  def record(self) -> dict[str, Any]:
    """The configuration as it is written to config.json (JSON data)."""
    return json.loads(json.dumps(to_dict(self.config)))

  @property
  def checkpoint_directory(self) -> str:
    return os.path.join(self.directory, "checkpoints")

  def checkpoint_steps(self) -> list[int]:
    """The complete checkpoints on disk (orbax writes each under a temporary name
    and renames it when complete)."""
    folder = self.checkpoint_directory
    if not os.path.isdir(folder):
      return []
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())

  def check_resumable(self) -> None:
    """Refuses, before anything is touched, a config that may not continue the
    checkpoints already in the directory (see ``run_directory.RESUMABLE``)."""
    if self.config.output.resume:
      run_directory.check_resumable(self.directory, self.checkpoint_steps(), self.record,
                                    defaults=to_dict(ExperimentConfig()))

  def check(self) -> None:
    """Raises ConfigError now for what would otherwise fail after the warm start."""
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise ConfigError(f"OutputSection.directory={self.directory!r} is invalid: expected a "
                        "directory (or a path to create one at), not a file.")
    check_layout(self.config.rl, *self.meshes())
    run_data.check_data(self.config)
    run_data.check_lengths(self.config, self.task, self.prompt_set, self.policy_positions)
    self.check_resumable()

  def plan(self) -> list[str]:
    """What this run will do, one line per subject (``rl.app.run_plan``)."""
    data = self.config.data
    held_out = len(self.eval_task.records) if self.eval_task is not None else 0
    rows = run_plan.DataRows(
        source=f"dataset {data.path}" if data.path else f"task {self.task.name}",
        train=len(self.prompt_set), held_out=held_out)
    reward = data.reward if data.path else f"the {self.task.name} task's own (exact answer)"
    return run_plan.plan_lines(self.config, vocab_size=self.text_tokenizer.vocab_size,
                               rows=rows, reward=reward, devices=jax.device_count(),
                               max_new_tokens=self.rollout_config.sampling.max_new_tokens)

  def announce(self) -> None:
    """Logs the plan: called before the warm start, so a run says what it will do."""
    self.log("this run:")
    for line in self.plan():
      self.log(f"  {line}")

  def _fresh_models(self) -> Models:
    return fresh_models(self.config)

  def warm_start(self) -> Models:
    """SFT the policy, distil the draft model; cached in <directory>/warm_start under
    the configuration that made it (``rl.app.warm_start``)."""
    self.check_resumable()
    return warm_start(self.config, self.record, self.task, log=self.log,
                      timings=self.timings)

  # ------------------------------------------------------------ RL pieces

  def drafter_for(self, models: Models):
    """(drafter or None, online drafter or None) as the config asks
    (``rl.app.drafter_registry``)."""
    return build_drafter(self.config, models.policy, models.draft,
                         sampling=self.rollout_config.sampling, log=self.log)

  def meshes(self):
    """(train mesh, rollout mesh or None for sync)."""
    return run_meshes(self.config.rl)

  def step_prompts(self, step: int, rows: slice = slice(None)):
    """The prompts of RL step ``step``; ``rows``: only these of them (a process's)."""
    return self.prompt_set.take(self.step_indices(step)[rows])

  def step_indices(self, step: int):
    """Indices into the prompt set of step ``step``'s prompts: a pure function of
    the step, so a resumed run continues the data order where it stopped."""
    rl = self.config.rl
    return step_indices(len(self.prompt_set), step, rl.prompts_per_step, rl.seed)

  def step_rng(self, step: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(self.config.rl.seed), step)

  def initial_state(self, models: Models, online: OnlineDrafter | None, mesh) -> TrainState:
    # Host copies: the warm start may sit on one device, the mesh spans several.
    params = jax.device_get(nnx.split(models.policy)[1])
    drafter = jax.device_get(online.trainable) if online else None
    state = init_train_state(params, self.learner, mesh, rng=jax.random.key(self.config.rl.seed),
                             with_reference=self.with_reference, drafter_params=drafter)
    if not self.spec.adaptive:
      return state
    # A fresh adaptive run measures its round costs now (a resumed one restores them).
    return add_controller(state, self.config.drafter, round_cost_table(
        self.config.drafter, models.policy, self.drafter_for(models)[0], self.rollout_config,
        self.rollout_mesh(mesh), prompts=self.step_prompts(0), prompt_width=self.prompt_width,
        engine=self.engine, rng=jax.random.key(self.config.rl.seed + 1), log=self.log), mesh)

  def _abstract_state(self, models: Models, online: OnlineDrafter | None, mesh) -> TrainState:
    abstract = abstract_train_state(nnx.split(models.policy)[1], self.learner, mesh,
                                    rng=jax.random.key(self.config.rl.seed),
                                    with_reference=self.with_reference,
                                    drafter_params=online.trainable if online else None)
    if not self.spec.adaptive:
      return abstract
    widths = rollout_widths(models.policy.config, self.rollout_config, self.rollout_mesh(mesh),
                            prompt_width=self.prompt_width, drafter=self.drafter_for(models)[0],
                            spec=self.spec, engine=self.engine)
    return abstract_controller(abstract, self.config.drafter, len(widths), mesh)

  def rollout_mesh(self, train_mesh):
    """The mesh rollouts decode on (async: its own; sync: the train mesh)."""
    rollout_mesh = self.meshes()[1]
    return train_mesh if rollout_mesh is None else rollout_mesh

  @property
  def with_reference(self) -> bool:
    """A KL term needs the frozen initial policy in the train state."""
    return self.learner.loss.beta > 0

  def checkpoint_mesh(self, train_mesh):
    return checkpoint_mesh(train_mesh)

  def restore_or_init(self, manager, models, online, mesh, checkpoint_mesh=None
                      ) -> tuple[TrainState, dict[str, Any] | None]:
    """(state, in_flight): the latest good checkpoint's state and the async batches
    saved with it (resuming, ``rl.app.resume``), else a fresh state and None."""
    checkpoint_mesh = mesh if checkpoint_mesh is None else checkpoint_mesh
    restored = None
    if self.config.output.resume and manager.all_steps():
      restored = resume.restore_latest(
          manager, self._abstract_state(models, online, checkpoint_mesh), log=self.log)
    if restored is None:
      return self.initial_state(models, online, mesh), None
    state, in_flight, step = restored
    if checkpoint_mesh is not mesh:
      state = distributed.transfer(state, jax.tree.map(
          lambda leaf: leaf.sharding, self._abstract_state(models, online, mesh)))
    self.log(f"resumed from checkpoint step {step} in {manager.directory}")
    if in_flight is None and self.config.rl.mode == "async" and step < self.config.rl.steps:
      self.log(f"warning: checkpoint step {step} holds no in-flight batches (written by an "
               "older version): they are generated anew from its weights, so this run "
               "departs from an uninterrupted one")
    return state, in_flight

  # ------------------------------------------------------------ training

  def train(self, models: Models) -> dict[str, Any] | None:
    """Runs GRPO to ``rl.steps`` (resuming if a checkpoint exists); the summary.

    With several processes, all train and checkpoint together; process 0 alone writes
    config, metrics and plots and returns the summary (the others return None).
    """
    self.check_resumable()
    os.makedirs(self.directory, exist_ok=True)
    drafter, online = self.drafter_for(models)
    train_mesh, rollout_mesh = self.meshes()
    manager = self.open_checkpoints()
    try:
      state, in_flight = self.restore_or_init(manager, models, online, train_mesh,
                                              self.checkpoint_mesh(train_mesh))
    except BaseException:
      manager.close()
      raise
    if distributed.is_primary():  # only now: the state it describes exists, restored or new
      run_directory.write_json(os.path.join(self.directory, run_directory.CONFIG), self.record)
      if self.fingerprint is not None:
        data_fingerprint.write(self.directory, self.fingerprint)
    start = int(distributed.fetch(state.step))  # the train mesh may be on other processes
    outputs = open_run_outputs(self.config, manager, start, primary=distributed.is_primary())
    try:
      if self.config.rl.mode == "sync":
        program = self.sync_program(models, state, drafter, online, train_mesh)
        records = self._sync_steps(program, state, range(start, self.config.rl.steps))
        in_flight_now = lambda: None  # sync: nothing outlives a step
      else:
        pipeline = self.async_pipeline(models, state, drafter, online, train_mesh, rollout_mesh)
        records = ((r.update, r.state, r.metrics) for r in pipeline.run(
            state, first_update=start, num_updates=self.config.rl.steps - start,
            prompts_of=self.step_prompts, rng_of=self.step_rng, in_flight=in_flight,
            refresh_weight=self.config.drafter.refresh_weight))
        in_flight_now = pipeline.in_flight  # saved with each checkpoint: resume trains on them
      state = self.run_steps(state, records, outputs, self.saver(models, online, train_mesh),
                             in_flight_now, nnx.split(models.policy)[0])
    finally:
      outputs.close()
    self.state = state
    return run_summary(self.config, outputs.writer)

  def open_checkpoints(self) -> checkpoint.TrainCheckpointManager:
    """The checkpoint manager of the run directory, emptied first when not resuming."""
    if distributed.is_primary() and not self.config.output.resume and os.path.exists(
        self.checkpoint_directory):
      shutil.rmtree(self.checkpoint_directory)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("specrl checkpoint folder ready")
    return checkpoint.TrainCheckpointManager(self.checkpoint_directory,
                                             max_to_keep=self.config.output.keep_checkpoints,
                                             async_save=False)

  def saver(self, models: Models, online: OnlineDrafter | None,
            train_mesh) -> Callable[[TrainState], TrainState]:
    """The state as it is checkpointed: moved to the checkpoint mesh where that differs."""
    checkpoint_mesh = self.checkpoint_mesh(train_mesh)
    if checkpoint_mesh is train_mesh:
      return lambda state: state
    layout = jax.tree.map(lambda leaf: leaf.sharding,
                          self._abstract_state(models, online, checkpoint_mesh))
    return lambda state: distributed.transfer(state, layout)

  def sync_program(self, models: Models, state: TrainState, drafter, online, train_mesh
                   ) -> RLProgram:
    """The compiled sync RL step, reused across train() calls of this session while the
    policy object and everything the program depends on (all but steps and seed) stay."""
    config = self.config
    key = (id(models.policy), dataclasses.replace(config.rl, steps=1, seed=0), config.drafter)
    if getattr(self, "_program_key", None) != key:
      self._program = build_program(
          nnx.split(models.policy)[0], models.policy.config, self.task, self.learner,
          self.rollout_config, train_mesh, state, prompt_width=self.prompt_width,
          drafter=drafter, online=online, spec=self.spec if drafter is not None else None,
          engine=self.engine)
      self._program_key = key
    return self._program

  def async_pipeline(self, models: Models, state: TrainState, drafter, online, train_mesh,
                     rollout_mesh) -> AsyncPipeline:
    return AsyncPipeline(
        nnx.split(models.policy)[0], models.policy.config, self.task, self.learner,
        self.rollout_config, rollout_mesh=rollout_mesh, train_mesh=train_mesh, state=state,
        prompt_width=self.prompt_width, max_policy_lag=self.config.rl.max_policy_lag,
        drafter=drafter, online=online, spec=self.spec if drafter is not None else None,
        engine=self.engine)

  def run_steps(self, state: TrainState, records, outputs: RunOutputs,
                save: Callable[[TrainState], TrainState], in_flight_now, graphdef) -> TrainState:
    """Consumes the (step, state, metrics) records: metrics written, the step checked,
    checkpoints saved every ``output.checkpoint_every`` steps and at the last; the last
    state."""
    last_saved = outputs.manager.latest_step()
    collapse = self.collapse_detector(outputs.writer)
    for step, state, metrics in records:
      metrics = self.step_metrics(step, state, metrics, collapse, graphdef)
      if outputs.writer is not None:
        outputs.writer.write(step, metrics)
      self._check(step, metrics, last_saved, state)
      outputs.advance(metrics)
      if self.on_step is not None:
        self.on_step(step, metrics)
      done = step + 1
      every = self.config.output.checkpoint_every
      if (every and done % every == 0) or done == self.config.rl.steps:
        outputs.manager.save(done, save(state), force=True, in_flight=in_flight_now())
        last_saved = done
        self.log(f"checkpoint saved step={done}")
    return state

  def collapse_detector(self, writer: MetricsWriter | None) -> CollapseDetector:
    collapse = CollapseDetector(self.config.output.collapse_window)
    if writer is not None:  # the steps kept from before a resume count too
      for record in read_jsonl(writer.path):
        collapse.update(record)
    return collapse

  def step_metrics(self, step: int, state: TrainState, metrics: dict[str, Any],
                   collapse: CollapseDetector, graphdef) -> dict[str, Any]:
    """A step's metrics as written: rates, collapse flags, data records and samples."""
    metrics = with_rates(metrics, self.rollout_config.group_size
                         * self.rollout_config.prompts_per_step)
    metrics.update(collapse.update(metrics))
    if metrics["collapse_warning"] and collapse.run == collapse.window:
      self.log(f"warning: step {step}: zero gradient norm and constant reward "
               f"{metrics['reward_mean']} for {collapse.run} steps: the run has no "
               "learning signal left (collapsed, or every sample scores the same)")
    metrics.update(run_data.step_records(self.config, self.task, self.eval_task,
                                         self.prompt_set, self.step_indices(step), step,
                                         graphdef, state))
    return metrics

  def _sync_steps(self, program: RLProgram, state: TrainState, steps):
    num_prompts = self.config.rl.prompts_per_step
    rows = distributed.process_rows(program.rows, num_prompts)
    # Made on the mesh, replicated: a host key cannot be put on other processes' devices.
    step_rng = jax.jit(self.step_rng, out_shardings=program.replicated)
    for step in steps:
      started = time.perf_counter()
      if jax.process_count() > 1:  # each process loads only the prompts its devices take
        prompts = distributed.local_batch_to_global(self.step_prompts(step, rows),
                                                    program.rows, num_prompts)
      else:
        prompts = prompts_on_mesh(self.step_prompts(step), program.mesh)
      rng = step_rng(step)
      state, metrics = program.rl_step(state, prompts, rng)
      metrics = to_host(metrics)
      metrics["step_seconds"] = time.perf_counter() - started
      yield step, state, metrics

  def _check(self, step: int, metrics: dict[str, Any], last_saved: int | None,
             state: Any = None) -> None:
    kept = (f"the last good checkpoint (step {last_saved}) is kept in "
            f"{self.checkpoint_directory}" if last_saved is not None else
            "no checkpoint had been written yet")
    check_step(step, metrics, kept=kept,
               leaf_name_of=lambda index: numerics.leaf_name(state, index))
