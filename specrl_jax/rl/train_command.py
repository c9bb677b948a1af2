"""`specrl train`: warm start, then GRPO (sync or async) with metrics, checkpoints,
resume and plots.

    specrl train [--preset=demo|tiny] [--section.field=value ...]
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
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from specrl_jax import checkpoint
from specrl_jax.config import ConfigError, SpecConfig
from specrl_jax.drafters import DraftModel, NGram
from specrl_jax.models.transformer import Transformer
from specrl_jax.parallel import distributed
from specrl_jax.parallel.distributed import DistributedConfig, DistributedError
from specrl_jax.parallel.mesh import make_mesh
from specrl_jax.rl import sft
from specrl_jax.rl.async_pipeline import AsyncPipeline, StalePolicyError
from specrl_jax.rl.experiment import ExperimentConfig, PRESETS, experiment_config, to_dict
from specrl_jax.rl.learner import TrainState, abstract_train_state, init_train_state
from specrl_jax.rl.metrics import MetricsWriter, plot_run, read_jsonl
from specrl_jax.rl.online_drafters import OnlineDrafter, online_drafter
from specrl_jax.rl.sync import (
    RLProgram, RolloutConfig, build_program, prompts_on_mesh, to_host,
)
from specrl_jax.rl.tasks import (
    PromptSet, RewardFunctionError, Task, make_prompt_set, raise_pending_errors, step_indices,
)
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.generate import PagePoolExhaustedError


class TrainingDivergedError(RuntimeError):
  """A step produced a non-finite loss or reward; its state was not checkpointed."""


def _replicate_on_all_devices(model: nnx.Module) -> None:
  """Replaces ``model``'s arrays by process 0's values replicated on every device of
  every process (a multi-process job's shared copy)."""
  state = multihost_utils.broadcast_one_to_all(jax.device_get(nnx.state(model)))
  sharding = distributed.everywhere()
  nnx.update(model, jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, x, x.shape), state))


@dataclasses.dataclass
class Models:
  """The warm-started policy and (for the draft-model drafter) its draft model."""
  policy: Transformer
  draft: Transformer | None


class Session:
  """One experiment: task, warm-started models, the RL program, and its outputs."""

  def __init__(self, config: ExperimentConfig, *, task: Task | None = None,
               log: Callable[[str], None] = print):
    self.config = config
    self.log = log
    self.task = task if task is not None else config.task.make()
    self.prompt_set: PromptSet = make_prompt_set(
        self.task, config.task.num_prompts, seed=config.task.seed,
        max_prompt_tokens=self.task.max_prompt_tokens)
    self.learner = config.rl.learner(self.task.max_response_tokens)
    self.rollout_config = RolloutConfig(group_size=config.rl.group_size,
                                        prompts_per_step=config.rl.prompts_per_step)
    self.engine = EngineConfig(num_slots=config.rl.num_slots)
    self.spec = SpecConfig(num_draft_tokens=config.drafter.num_draft_tokens)
    self.timings: dict[str, float] = {}

  @property
  def directory(self) -> str:
    return self.config.output.directory

  # ------------------------------------------------------------ warm start

  @property
  def prompt_width(self) -> int:
    return int(self.prompt_set.tokens_PxT.shape[1])

  def _fresh_models(self) -> Models:
    c = self.config
    policy = Transformer(c.policy.model_config(), rngs=nnx.Rngs(c.policy.seed))
    draft = None
    if c.drafter.kind == "draft_model":
      draft = Transformer(c.drafter.model.model_config(), rngs=nnx.Rngs(c.drafter.model.seed))
    return Models(policy=policy, draft=draft)

  def warm_start(self) -> Models:
    """SFT the policy, distil the draft model; cached in <directory>/warm_start."""
    models = self._fresh_models()
    folder = os.path.abspath(os.path.join(self.directory, "warm_start"))
    names = ["policy"] + (["draft"] if models.draft is not None else [])
    multi = jax.process_count() > 1
    cached = all(os.path.exists(os.path.join(folder, n)) for n in names)
    if multi:  # process 0's view decides, so that every process takes the same branch
      cached = bool(multihost_utils.broadcast_one_to_all(np.asarray(cached)))
    if cached:
      for name in names:
        model = getattr(models, name)
        # Several processes restore one global copy, replicated on every device.
        shardings = (jax.tree.map(lambda _: distributed.everywhere(), nnx.state(model))
                     if multi else None)
        checkpoint.restore_model(os.path.join(folder, name), model, shardings=shardings)
      self.log(f"warm start: loaded from {folder}")
      return models
    c = self.config.warm_start
    started = time.perf_counter()
    if c.sft_steps:
      models.policy, losses = sft.train_sft(
          models.policy, self.task,
          sft.SFTConfig(steps=c.sft_steps, batch_size=c.sft_batch_size,
                        learning_rate=c.sft_learning_rate, noise=c.sft_noise,
                        seed=self.config.task.seed),
          )
      self.log(f"warm start: SFT {c.sft_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if models.draft is not None and c.distill_steps:
      models.draft, losses = sft.train_sft(
          models.draft, self.task,
          sft.SFTConfig(steps=c.distill_steps, batch_size=c.sft_batch_size,
                        learning_rate=c.distill_learning_rate, seed=self.config.task.seed + 1),
          teacher=models.policy)
      self.log(f"warm start: drafter distilled {c.distill_steps} steps, soft CE "
               f"{losses[0]:.3f} -> {losses[-1]:.3f}")
    self.timings["warm_start_seconds"] = time.perf_counter() - started
    if multi:
      # Each process trained its own copy (on its first device); all continue from
      # process 0's, bit for bit, as global arrays that orbax can write together.
      for name in names:
        _replicate_on_all_devices(getattr(models, name))
    if distributed.is_primary() and os.path.exists(folder):
      shutil.rmtree(folder)
    if multi:
      multihost_utils.sync_global_devices("specrl warm start folder cleared")
    for name in names:
      checkpoint.save_model(os.path.join(folder, name), getattr(models, name))
    return models

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
    return drafter, online_drafter(drafter, sampling=self.learner.sampling,
                                   loss_weight=c.loss_weight)

  def meshes(self):
    """(train mesh, rollout mesh or None for sync)."""
    rl = self.config.rl
    devices = jax.devices()
    processes = jax.process_count()
    if rl.mode == "sync":
      size = math.prod(rl.mesh)
      if size > len(devices):
        raise ConfigError(f"RLSection.mesh={rl.mesh} needs {size} devices; {len(devices)} "
                          "are available.")
      if processes > 1 and size != len(devices):
        raise ConfigError(f"RLSection.mesh={rl.mesh} has {size} devices but the {processes} "
                          f"processes have {len(devices)}: a multi-process mesh must use "
                          "every device (each process feeds its own).")
      return make_mesh(rl.mesh, devices=devices[:size]), None
    needed = rl.rollout_devices + rl.train_devices
    if needed > len(devices):
      raise ConfigError(f"async RL with rollout_devices={rl.rollout_devices} and train_devices="
                        f"{rl.train_devices} needs {needed} devices; {len(devices)} are "
                        "available (on CPU set JAX_NUM_CPU_DEVICES).")
    # Async meshes take the tensor size of rl.mesh (checked by RLSection): the rollout
    # and the train mesh each split heads that many ways and their batch the rest.
    tensor = rl.mesh[2]
    rollout = make_mesh((rl.rollout_devices // tensor, 1, tensor),
                        devices=devices[:rl.rollout_devices])
    train = make_mesh((rl.train_devices // tensor, 1, tensor),
                      devices=devices[rl.rollout_devices:needed])
    return train, rollout

  def step_prompts(self, step: int, rows: slice = slice(None)):
    """The prompts of RL step ``step``; ``rows``: only these of them (a process's)."""
    rl = self.config.rl
    indices = step_indices(len(self.prompt_set), step, rl.prompts_per_step, rl.seed)
    return self.prompt_set.take(indices[rows])

  def step_rng(self, step: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(self.config.rl.seed), step)

  def initial_state(self, models: Models, online: OnlineDrafter | None, mesh) -> TrainState:
    # Host copies: the warm start may sit on one device, the mesh spans several.
    params = jax.device_get(nnx.split(models.policy)[1])
    drafter = jax.device_get(online.trainable) if online else None
    return init_train_state(params, self.learner, mesh, rng=jax.random.key(self.config.rl.seed),
                            drafter_params=drafter)

  def _abstract_state(self, models: Models, online: OnlineDrafter | None, mesh) -> TrainState:
    return abstract_train_state(nnx.split(models.policy)[1], self.learner, mesh,
                                rng=jax.random.key(self.config.rl.seed),
                                drafter_params=online.trainable if online else None)

  def checkpoint_mesh(self, train_mesh):
    """The mesh checkpoints are written from and read onto: the train mesh, unless it
    leaves some process out (orbax writes only arrays that span every process; an
    async train mesh may sit on a few hosts), then an FSDP mesh over every device."""
    processes = {device.process_index for device in train_mesh.devices.flat}
    if len(processes) == jax.process_count():
      return train_mesh
    return make_mesh((1, jax.device_count(), 1))

  def restore_or_init(self, manager, models, online, mesh, checkpoint_mesh=None) -> TrainState:
    checkpoint_mesh = mesh if checkpoint_mesh is None else checkpoint_mesh
    if self.config.output.resume and manager.latest_step() is not None:
      state = manager.restore(self._abstract_state(models, online, checkpoint_mesh))
      if checkpoint_mesh is not mesh:
        state = distributed.transfer(state, jax.tree.map(
            lambda leaf: leaf.sharding, self._abstract_state(models, online, mesh)))
      self.log(f"resumed from checkpoint step {manager.latest_step()} in {manager.directory}")
      return state
    return self.initial_state(models, online, mesh)

  # ------------------------------------------------------------ training

  def train(self, models: Models) -> dict[str, Any] | None:
    """Runs GRPO to ``rl.steps`` (resuming if a checkpoint exists); the summary.

    With several processes, all train and checkpoint together; process 0 alone writes
    config, metrics and plots and returns the summary (the others return None).
    """
    config = self.config
    primary = distributed.is_primary()
    os.makedirs(self.directory, exist_ok=True)
    if primary:
      with open(os.path.join(self.directory, "config.json"), "w") as file:
        json.dump(to_dict(config), file, indent=2)
    drafter, online = self.drafter_for(models)
    train_mesh, rollout_mesh = self.meshes()
    ckpt_dir = os.path.join(self.directory, "checkpoints")
    if primary and not config.output.resume and os.path.exists(ckpt_dir):
      shutil.rmtree(ckpt_dir)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("specrl checkpoint folder ready")
    manager = checkpoint.TrainCheckpointManager(ckpt_dir,
                                                max_to_keep=config.output.keep_checkpoints,
                                                async_save=False)
    checkpoint_mesh = self.checkpoint_mesh(train_mesh)
    state = self.restore_or_init(manager, models, online, train_mesh, checkpoint_mesh)
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
            prompts_of=self.step_prompts, rng_of=self.step_rng))
      last_saved = manager.latest_step()
      for step, state, metrics in records:
        metrics = _with_rates(metrics, self.rollout_config)
        if writer is not None:
          writer.write(step, metrics)
        self._check(step, metrics, last_saved)
        if progress is not None:
          progress.update(1)
          progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                               accept=f"{metrics['acceptance_length']:.2f}")
        done = step + 1
        every = config.output.checkpoint_every
        if (every and done % every == 0) or done == config.rl.steps:
          manager.save(done, to_save(state), force=True)
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

  def _check(self, step: int, metrics: dict[str, Any], last_saved: int | None) -> None:
    kept = (f"the last good checkpoint (step {last_saved}) is kept in "
            f"{os.path.join(self.directory, 'checkpoints')}" if last_saved is not None else
            "no checkpoint had been written yet")
    try:
      raise_pending_errors()
    except RewardFunctionError as error:
      raise RewardFunctionError(f"step {step}: {error}; {kept}.") from error.__cause__
    if not metrics["rewards_finite"]:
      raise TrainingDivergedError(f"step {step}: the task's rewards are NaN or infinite "
                                  f"(reward_mean={metrics['reward_mean']}); {kept}.")
    bad = [name for name in ("loss", "grad_norm") if not math.isfinite(metrics[name])]
    if bad:
      raise TrainingDivergedError(
          f"step {step}: non-finite {', '.join(f'{n}={metrics[n]}' for n in bad)}; the "
          f"update was not checkpointed and {kept}.")
    if metrics["pool_exhausted"]:
      raise PagePoolExhaustedError(f"step {step}: the rollout's KV page pool ran out; raise "
                                   f"the engine's num_pages or lower num_slots; {kept}.")


def _with_rates(metrics: dict[str, Any], rollout_config: RolloutConfig) -> dict[str, Any]:
  seconds = metrics["step_seconds"]
  return dict(metrics,
              samples_per_second=rollout_config.group_size * rollout_config.prompts_per_step
              / seconds,
              tokens_per_second=metrics["generated_tokens"] / seconds)


def summarize(records: list[dict[str, Any]], plots: Sequence[str]) -> dict[str, Any]:
  """First/last reward (means over the first and last quarter of steps) and more."""
  if not records:
    return {"steps": 0, "plots": list(plots)}
  quarter = max(1, len(records) // 4)
  mean = lambda rs, key: float(np.mean([r[key] for r in rs]))
  timed = records[1:] or records  # the first step includes compilation
  return {
      "steps": len(records),
      "reward_first_quarter": mean(records[:quarter], "reward_mean"),
      "reward_last_quarter": mean(records[-quarter:], "reward_mean"),
      "acceptance_length": mean(records, "acceptance_length"),
      "response_length": mean(records, "response_length_mean"),
      "step_seconds": mean(timed, "step_seconds"),
      "samples_per_second": mean(timed, "samples_per_second"),
      "plots": list(plots),
  }


def parse_argv(argv: Sequence[str]) -> ExperimentConfig:
  preset, overrides = "demo", []
  for arg in argv:
    if arg.startswith("--preset="):
      preset = arg.split("=", 1)[1]
    else:
      overrides.append(arg)
  config = experiment_config(preset, overrides)
  if preset != "demo" or any(a.startswith("--output.directory=") for a in overrides):
    return config
  return dataclasses.replace(config, output=dataclasses.replace(config.output,
                                                                directory="runs/train"))


# --flag VALUE / --flag=VALUE options of the multi-process launch -> DistributedConfig
# fields (integers, except the coordinator's HOST:PORT).
DISTRIBUTED_FLAGS = {
    "--coordinator": "coordinator",
    "--num-processes": "num_processes",
    "--process-id": "process_id",
    "--init-timeout": "initialization_timeout",
    "--heartbeat-timeout": "heartbeat_timeout",
    "--shutdown-timeout": "shutdown_timeout",
}


def parse_distributed_argv(argv: Sequence[str]) -> tuple[DistributedConfig | None, list[str]]:
  """Splits the launch flags off ``argv``: (how to join a multi-process job, or None
  for a single process; the remaining arguments)."""
  fields: dict[str, Any] = {}
  auto, rest = False, []
  args = list(argv)
  while args:
    arg = args.pop(0)
    flag, has_value, value = arg.partition("=")
    if flag == "--distributed" and not has_value:
      auto = True
      continue
    if flag not in DISTRIBUTED_FLAGS:
      rest.append(arg)
      continue
    if not has_value:
      if not args:
        raise ConfigError(f"{flag} needs a value.")
      value = args.pop(0)
    name = DISTRIBUTED_FLAGS[flag]
    if name != "coordinator":
      try:
        value = int(value)
      except ValueError:
        raise ConfigError(f"{flag}={value!r} is invalid: expected an integer.") from None
    fields[name] = value
  launch = {"coordinator", "num_processes", "process_id"} & set(fields)
  if not auto and not launch:
    if fields:
      raise ConfigError(f"{sorted(fields)} only apply to a multi-process run: add "
                        "--coordinator/--num-processes/--process-id or --distributed.")
    return None, rest
  if auto and launch:
    raise ConfigError("--distributed detects the coordinator, process count and id from the "
                      "environment: give either it or --coordinator/--num-processes/"
                      "--process-id, not both.")
  return DistributedConfig(**fields), rest


def _quiet(message: str) -> None:
  del message


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    print(f"presets: {sorted(PRESETS)}; fields: see specrl_jax/rl/experiment.py")
    return 0
  try:
    launch, argv = parse_distributed_argv(argv)
    if launch is not None:
      distributed.initialize(launch)
    config = parse_argv(argv)
    if jax.process_count() > 1:
      distributed.check_same_on_all_processes(json.dumps(to_dict(config), sort_keys=True),
                                              "the run configuration")
    session = Session(config, log=print if distributed.is_primary() else _quiet)
    session.meshes()  # a mesh that cannot be built fails now, not after the warm start
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
