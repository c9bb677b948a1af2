"""`specrl train`: warm start, then GRPO (sync or async) with metrics, checkpoints,
resume and plots.

    specrl train [--preset=demo|tiny] [--section.field=value ...]

e.g. ``specrl train --preset=demo --rl.mode=async --rl.rollout_devices=4
--rl.train_devices=4 --output.directory=runs/async``. Re-running with the same
directory resumes from its latest checkpoint (``--output.resume=false`` starts over).
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

from specrl_jax import checkpoint
from specrl_jax.config import ConfigError, SpecConfig
from specrl_jax.drafters import DraftModel, NGram
from specrl_jax.models.transformer import Transformer
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
    if all(os.path.exists(os.path.join(folder, n)) for n in names):
      for name in names:
        checkpoint.restore_model(os.path.join(folder, name), getattr(models, name))
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
    if os.path.exists(folder):
      shutil.rmtree(folder)
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
    if rl.mode == "sync":
      size = math.prod(rl.mesh)
      if size > len(devices):
        raise ConfigError(f"RLSection.mesh={rl.mesh} needs {size} devices; {len(devices)} "
                          "are available.")
      return make_mesh(rl.mesh, devices=devices[:size]), None
    needed = rl.rollout_devices + rl.train_devices
    if needed > len(devices):
      raise ConfigError(f"async RL with rollout_devices={rl.rollout_devices} and train_devices="
                        f"{rl.train_devices} needs {needed} devices; {len(devices)} are "
                        "available (on CPU set JAX_NUM_CPU_DEVICES).")
    rollout = make_mesh((rl.rollout_devices, 1, 1), devices=devices[:rl.rollout_devices])
    train = make_mesh((rl.train_devices, 1, 1), devices=devices[rl.rollout_devices:needed])
    return train, rollout

  def step_prompts(self, step: int):
    rl = self.config.rl
    return self.prompt_set.take(step_indices(len(self.prompt_set), step, rl.prompts_per_step,
                                             rl.seed))

  def step_rng(self, step: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(self.config.rl.seed), step)

  def initial_state(self, models: Models, online: OnlineDrafter | None, mesh) -> TrainState:
    # Host copies: the warm start may sit on one device, the mesh spans several.
    params = jax.device_get(nnx.split(models.policy)[1])
    drafter = jax.device_get(online.trainable) if online else None
    return init_train_state(params, self.learner, mesh, rng=jax.random.key(self.config.rl.seed),
                            drafter_params=drafter)

  def restore_or_init(self, manager, models, online, mesh) -> TrainState:
    params = nnx.split(models.policy)[1]
    drafter = online.trainable if online else None
    if self.config.output.resume and manager.latest_step() is not None:
      target = abstract_train_state(params, self.learner, mesh,
                                    rng=jax.random.key(self.config.rl.seed),
                                    drafter_params=drafter)
      state = manager.restore(target)
      self.log(f"resumed from checkpoint step {manager.latest_step()} in {manager.directory}")
      return state
    return self.initial_state(models, online, mesh)

  # ------------------------------------------------------------ training

  def train(self, models: Models) -> dict[str, Any]:
    """Runs GRPO to ``rl.steps`` (resuming if a checkpoint exists); the summary."""
    config = self.config
    os.makedirs(self.directory, exist_ok=True)
    with open(os.path.join(self.directory, "config.json"), "w") as file:
      json.dump(to_dict(config), file, indent=2)
    drafter, online = self.drafter_for(models)
    train_mesh, rollout_mesh = self.meshes()
    ckpt_dir = os.path.join(self.directory, "checkpoints")
    if not config.output.resume and os.path.exists(ckpt_dir):
      shutil.rmtree(ckpt_dir)
    manager = checkpoint.TrainCheckpointManager(ckpt_dir,
                                                max_to_keep=config.output.keep_checkpoints,
                                                async_save=False)
    state = self.restore_or_init(manager, models, online, train_mesh)
    start = int(jax.device_get(state.step))
    spec = self.spec if drafter is not None else None
    graphdef = nnx.split(models.policy)[0]
    writer = MetricsWriter(self.directory, tensorboard=config.output.tensorboard,
                           start_step=start)
    steps = range(start, config.rl.steps)
    progress = None
    if config.output.progress:
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
        writer.write(step, metrics)
        self._check(step, metrics, last_saved)
        if progress is not None:
          progress.update(1)
          progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                               accept=f"{metrics['acceptance_length']:.2f}")
        done = step + 1
        every = config.output.checkpoint_every
        if (every and done % every == 0) or done == config.rl.steps:
          manager.save(done, state, force=True)
          last_saved = done
          self.log(f"checkpoint saved step={done}")
    finally:
      if progress is not None:
        progress.close()
      writer.close()
      manager.close()
    records = read_jsonl(writer.path)
    plots = plot_run(records, os.path.join(self.directory, "plots")) if config.output.plots else []
    self.state = state
    return summarize(records, plots)

  def _sync_steps(self, program: RLProgram, state: TrainState, steps):
    for step in steps:
      started = time.perf_counter()
      prompts = prompts_on_mesh(self.step_prompts(step), program.mesh)
      rng = jax.device_put(self.step_rng(step), program.replicated)
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


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    print(f"presets: {sorted(PRESETS)}; fields: see specrl_jax/rl/experiment.py")
    return 0
  try:
    config = parse_argv(argv)
    session = Session(config)
    models = session.warm_start()
    summary = session.train(models)
  except (ConfigError, TrainingDivergedError, RewardFunctionError, StalePolicyError,
          PagePoolExhaustedError) as error:
    print(f"specrl train: {type(error).__name__}: {error}", file=sys.stderr)
    return 1
  print(json.dumps(summary, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
