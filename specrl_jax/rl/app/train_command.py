"""`specrl train`: warm start, then GRPO (sync or async) with metrics, checkpoints,
resume and plots.

    specrl train [--preset=demo|tiny|dataset] [--section.field=value ...]
    specrl train --model=HF_FOLDER --dataset=FILE --reward=module:function [...]
                 [--coordinator HOST:PORT --num-processes N --process-id I | --distributed]
                 [--init-timeout SECONDS] [--heartbeat-timeout SECONDS]
                 [--shutdown-timeout SECONDS]

e.g. ``specrl train --preset=demo --rl.mode=async --rl.rollout_devices=4
--rl.train_devices=4 --output.directory=runs/async``. Re-running with the same
directory resumes from its latest checkpoint (``--output.resume=false`` starts over).

Multi-process: start the same command once per process (host) with
``--coordinator HOST:PORT --num-processes N --process-id I`` (the address of process
0), or with ``--distributed`` where jax.distributed detects them (Cloud TPU VMs, SLURM,
Open MPI, Kubernetes indexed jobs). The mesh then spans every process's devices, each
process loads only its prompts, all write the checkpoints together (the output
directory must be shared: NFS, gcsfuse, ...), and process 0 alone writes metrics and
plots. See docs/multihost.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.experimental import multihost_utils

from specrl_jax import checkpoint
from specrl_jax.compile_cache import cache_directory, persistent_cache
from specrl_jax.config import ConfigError, SpecConfig
from specrl_jax.drafters import DraftModel, NGram
from specrl_jax.parallel import distributed
from specrl_jax.parallel.distributed import DistributedError
from specrl_jax.parallel.launch import DISTRIBUTED_FLAGS, parse_distributed_argv  # noqa: F401
from specrl_jax.rl.loop import numerics
from specrl_jax.rl.app import run_data, run_directory
from specrl_jax.rl.loop.async_pipeline import AsyncPipeline, StalePolicyError
from specrl_jax.rl.app.experiment import ExperimentConfig, PRESETS, to_dict
from specrl_jax.rl.app.guards import CollapseDetector, TrainingDivergedError, check_step
from specrl_jax.rl.loop.learner import TrainState, abstract_train_state, init_train_state
from specrl_jax.rl.app.metrics import MetricsWriter, plot_run, read_jsonl, summarize, with_rates
from specrl_jax.rl.app.meshes import check_layout, checkpoint_mesh, run_meshes
from specrl_jax.rl.loop.online_drafters import OnlineDrafter, online_drafter
from specrl_jax.rl.loop.sync import RLProgram, build_program, prompts_on_mesh, to_host
from specrl_jax.rl.tasks import PromptSet, RewardFunctionError, Task, make_prompt_set, step_indices
from specrl_jax.rl.app.train_argv import parse_argv
from specrl_jax.rl.app.warm_start import Models, fresh_models, warm_start
from specrl_jax.sampling.results import PagePoolExhaustedError

__all__ = ["Models", "Session", "TrainingDivergedError", "main", "parse_argv"]


class Session:
  """One experiment: task, warm-started models, the RL program, and its outputs."""

  def __init__(self, config: ExperimentConfig, *, task: Task | None = None,
               log: Callable[[str], None] = print):
    self.config = config
    self.log = log
    # The policy's own tokenizer drives prompts, stop tokens and decoding.
    self.text_tokenizer = run_data.policy_tokenizer(config)
    self.task, self.eval_task = run_data.run_tasks(config, self.text_tokenizer, task)
    self.prompt_set: PromptSet = make_prompt_set(
        self.task, config.task.num_prompts, seed=config.task.seed,
        max_prompt_tokens=self.task.max_prompt_tokens)
    self.learner = config.learner_config()
    self.rollout_config = config.rl.rollout(self.task.max_response_tokens,
                                            self.text_tokenizer.eos_ids)
    self.engine = config.rl.engine
    self.spec = SpecConfig(num_draft_tokens=config.drafter.num_draft_tokens)
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
    self.check_resumable()

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
    """(drafter or None, online drafter or None) as the config asks."""
    c = self.config.drafter
    if c.kind == "none":
      return None, None
    if c.kind == "ngram":
      return NGram(n=c.ngram_n), None
    drafter = DraftModel(models.draft)
    if not c.online:
      return drafter, None
    return drafter, online_drafter(drafter, sampling=self.rollout_config.sampling,
                                   loss_weight=c.loss_weight)

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
    return init_train_state(params, self.learner, mesh, rng=jax.random.key(self.config.rl.seed),
                            with_reference=self.with_reference, drafter_params=drafter)

  def _abstract_state(self, models: Models, online: OnlineDrafter | None, mesh) -> TrainState:
    return abstract_train_state(nnx.split(models.policy)[1], self.learner, mesh,
                                rng=jax.random.key(self.config.rl.seed),
                                with_reference=self.with_reference,
                                drafter_params=online.trainable if online else None)

  @property
  def with_reference(self) -> bool:
    """A KL term needs the frozen initial policy in the train state."""
    return self.learner.loss.beta > 0

  def checkpoint_mesh(self, train_mesh):
    return checkpoint_mesh(train_mesh)

  def restore_or_init(self, manager, models, online, mesh, checkpoint_mesh=None
                      ) -> tuple[TrainState, dict[str, Any] | None]:
    """(state, in_flight): the latest finite checkpoint's state and the async batches
    saved with it (resuming), else a fresh state and None. A checkpoint holding a NaN
    or infinity (written before the finite-update guard existed) is deleted with a
    warning and the one before it is tried."""
    checkpoint_mesh = mesh if checkpoint_mesh is None else checkpoint_mesh
    if not (self.config.output.resume and manager.all_steps()):
      return self.initial_state(models, online, mesh), None
    abstract = self._abstract_state(models, online, checkpoint_mesh)
    first_bad = jax.jit(numerics.first_nonfinite_leaf)
    for step in reversed(manager.all_steps()):
      try:
        state, in_flight = manager.restore_with_in_flight(abstract, step=step)
      except Exception as error:  # orbax raises whatever its reader hit
        raise ConfigError(
            f"checkpoint step {step} in {manager.directory} does not fit this "
            f"configuration's train state ({type(error).__name__}: {str(error)[:300]}); "
            "resume with the configuration that wrote it, or --output.resume=false."
        ) from error
      bad = int(distributed.fetch(first_bad(state)))
      if bad < 0:
        break
      self.log(f"warning: checkpoint step {step} holds a non-finite "
               f"{numerics.leaf_name(state, bad)}: deleted, trying the one before")
      manager.delete(step)
    else:
      return self.initial_state(models, online, mesh), None
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
    config = self.config
    primary = distributed.is_primary()
    self.check_resumable()
    os.makedirs(self.directory, exist_ok=True)
    drafter, online = self.drafter_for(models)
    train_mesh, rollout_mesh = self.meshes()
    ckpt_dir = self.checkpoint_directory
    if primary and not config.output.resume and os.path.exists(ckpt_dir):
      shutil.rmtree(ckpt_dir)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("specrl checkpoint folder ready")
    manager = checkpoint.TrainCheckpointManager(ckpt_dir,
                                                max_to_keep=config.output.keep_checkpoints,
                                                async_save=False)
    checkpoint_mesh = self.checkpoint_mesh(train_mesh)
    try:
      state, in_flight = self.restore_or_init(manager, models, online, train_mesh,
                                              checkpoint_mesh)
    except BaseException:
      manager.close()
      raise
    if primary:  # only now: the state it describes exists, restored or new
      run_directory.write_json(os.path.join(self.directory, run_directory.CONFIG), self.record)
    to_save = lambda state: state
    if checkpoint_mesh is not train_mesh:
      checkpoint_layout = jax.tree.map(lambda leaf: leaf.sharding,
                                       self._abstract_state(models, online, checkpoint_mesh))
      to_save = lambda state: distributed.transfer(state, checkpoint_layout)
    start = int(distributed.fetch(state.step))  # the train mesh may be on other processes
    spec = self.spec if drafter is not None else None
    graphdef = nnx.split(models.policy)[0]
    writer = (MetricsWriter(self.directory, tensorboard=config.output.tensorboard,
                            start_step=start) if primary else None)
    steps = range(start, config.rl.steps)
    progress = None
    if config.output.progress and primary:
      from tqdm import tqdm
      progress = tqdm(total=config.rl.steps, initial=start, desc="GRPO", unit="step",
                      dynamic_ncols=True, file=sys.stderr)
      # It moves when a step ends; the first of a session also traces and compiles.
      progress.set_postfix_str(f"step {start}: compiling the RL step")
    in_flight_now = lambda: None  # sync: nothing outlives a step
    try:
      if config.rl.mode == "sync":
        # Reused across train() calls of this session when nothing it compiled changed.
        key = (id(models.policy), dataclasses.replace(config.rl, steps=1, seed=0),
               config.drafter)
        if getattr(self, "_program_key", None) != key:
          self._program = build_program(
              graphdef, models.policy.config, self.task, self.learner, self.rollout_config,
              train_mesh, state, prompt_width=self.prompt_width, drafter=drafter,
              online=online, spec=spec, engine=self.engine)
          self._program_key = key
        records = self._sync_steps(self._program, state, steps)
      else:
        pipeline = AsyncPipeline(graphdef, models.policy.config, self.task, self.learner,
                                 self.rollout_config, rollout_mesh=rollout_mesh,
                                 train_mesh=train_mesh, state=state,
                                 prompt_width=self.prompt_width,
                                 max_policy_lag=config.rl.max_policy_lag, drafter=drafter,
                                 online=online, spec=spec, engine=self.engine)
        records = ((r.update, r.state, r.metrics) for r in pipeline.run(
            state, first_update=start, num_updates=len(steps),
            prompts_of=self.step_prompts, rng_of=self.step_rng, in_flight=in_flight))
        # Saved with each checkpoint: resuming trains on exactly these batches.
        in_flight_now = pipeline.in_flight
      last_saved = manager.latest_step()
      collapse = CollapseDetector(config.output.collapse_window)
      if writer is not None:  # the steps kept from before a resume count too
        for record in read_jsonl(writer.path):
          collapse.update(record)
      for step, state, metrics in records:
        metrics = with_rates(metrics, self.rollout_config.group_size
                             * self.rollout_config.prompts_per_step)
        metrics.update(collapse.update(metrics))
        if metrics["collapse_warning"] and collapse.run == collapse.window:
          self.log(f"warning: step {step}: zero gradient norm and constant reward "
                   f"{metrics['reward_mean']} for {collapse.run} steps: the run has no "
                   "learning signal left (collapsed, or every sample scores the same)")
        metrics.update(run_data.step_records(config, self.task, self.eval_task,
                                             self.prompt_set, self.step_indices(step), step,
                                             graphdef, state))
        if writer is not None:
          writer.write(step, metrics)
        self._check(step, metrics, last_saved, state)
        if progress is not None:
          progress.update(1)
          progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                               accept=f"{metrics['acceptance_length']:.2f}")
        done = step + 1
        every = config.output.checkpoint_every
        if (every and done % every == 0) or done == config.rl.steps:
          manager.save(done, to_save(state), force=True,
                       in_flight=in_flight_now())
          last_saved = done
          self.log(f"checkpoint saved step={done}")
    finally:
      if progress is not None:
        progress.close()
      if writer is not None:
        writer.close()
      manager.close()
    self.state = state
    if writer is None:
      return None
    records = read_jsonl(writer.path)
    plots = plot_run(records, os.path.join(self.directory, "plots")) if config.output.plots else []
    return summarize(records, plots)

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


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    print(f"presets: {sorted(PRESETS)}; fields: see specrl_jax/rl/app/experiment.py")
    return 0
  try:
    launch, argv = parse_distributed_argv(argv)
    if launch is not None:
      distributed.initialize(launch)
    config = parse_argv(argv)
    if jax.process_count() > 1:
      distributed.check_same_on_all_processes(json.dumps(to_dict(config), sort_keys=True),
                                              "the run configuration")
    session = Session(config, log=print if distributed.is_primary() else (lambda _: None))
    session.check()  # what cannot work fails now, not after the warm start
    with persistent_cache(cache_directory(config.output.compilation_cache,
                                          config.output.directory)):
      models = session.warm_start()
      summary = session.train(models)
  except (ConfigError, TrainingDivergedError, RewardFunctionError, StalePolicyError,
          PagePoolExhaustedError, DistributedError) as error:
    print(f"specrl train: {type(error).__name__}: {error}", file=sys.stderr)
    return 1
  if summary is not None:
    print(json.dumps(summary, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
