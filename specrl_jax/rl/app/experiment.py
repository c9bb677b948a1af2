"""Experiment configuration: frozen dataclasses, named presets, command-line overrides.

    config = experiment_config("demo", ["--rl.group_size=8", "--drafter.kind=none"])

Each section validates itself and embeds the configs of the layers it drives
(``rl.engine`` is an ``EngineConfig``, ``learner`` a ``LearnerConfig``,
``drafter.model`` a ``ModelSection``); overrides follow ``rl.app.overrides``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from specrl_jax.config import (ConfigError, SamplingParams, check, check_finite_number,
                               check_non_negative_int, check_positive_int)
from specrl_jax.models import tokenizer
from specrl_jax.rl.app import drafter_registry
from specrl_jax.rl.app.data_section import DataSection
from specrl_jax.rl.app.drafter_section import DrafterSection  # noqa: F401 (re-exported)
from specrl_jax.rl.app.model_section import ModelSection  # noqa: F401 (re-exported)
from specrl_jax.rl.loop.learner import LearnerConfig
from specrl_jax.rl.algo.losses import GRPOConfig
from specrl_jax.rl.app import run_directory
from specrl_jax.rl.app.overrides import apply_overrides, from_dict_of, to_dict  # noqa: F401
from specrl_jax.rl.loop.rollout import RolloutConfig
from specrl_jax.rl.tasks import TASKS, Task, make_task
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.drafters.history_store import HistoryConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSection:
  """The task (by registry name) and its prompt set: ``num_prompts`` problems drawn
  with ``seed``. Options not used by the chosen task are ignored. longtail_arithmetic
  reads min_digits, max_digits and tail_exponent (its long tail needs a wide range:
  ``--task.min_digits=1 --task.max_digits=16``)."""
  name: str = "arithmetic"  # a registered task (rl.tasks.TASKS)
  min_digits: int = 2
  max_digits: int = 3  # operand digits, at most (arithmetic tasks)
  tail_exponent: float = 1.0  # longtail_arithmetic: P(digits d) ~ d^-tail_exponent
  num_numbers: int = 3  # countdown: numbers per puzzle
  max_number: int = 9  # countdown: largest number
  num_prompts: int = 512
  seed: int = 0

  def __post_init__(self):
    check(self.name in TASKS, "TaskSection", "name", self.name, f"one of {sorted(TASKS)}")
    check_positive_int("TaskSection", "num_prompts", self.num_prompts)
    check_non_negative_int("TaskSection", "seed", self.seed)
    self.make()  # the task checks its own options

  def make(self) -> Task:
    options = {"arithmetic": dict(min_digits=self.min_digits, max_digits=self.max_digits),
               "countdown": dict(num_numbers=self.num_numbers, max_number=self.max_number),
               "longtail_arithmetic": dict(min_digits=self.min_digits,
                                           max_digits=self.max_digits,
                                           tail_exponent=self.tail_exponent)}
    return make_task(self.name, **options.get(self.name, {}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartSection:
  """SFT of the policy on worked solutions, then distillation of the draft model."""
  sft_steps: int = 300  # SFT updates of the policy (0 = none: a pretrained policy)
  sft_batch_size: int = 32  # worked solutions per SFT update
  sft_learning_rate: float = 3e-3  # Adam rate of the SFT
  # fraction of SFT targets replaced by random tokens (a weaker policy leaves RL room)
  sft_noise: float = 0.0
  distill_steps: int = 150  # updates distilling the draft model from the policy (0 = none)
  distill_learning_rate: float = 3e-3  # Adam rate of the distillation

  def __post_init__(self):
    owner = "WarmStartSection"
    for name in ("sft_steps", "distill_steps"):
      check_non_negative_int(owner, name, getattr(self, name))
    check_positive_int(owner, "sft_batch_size", self.sft_batch_size)
    for name in ("sft_learning_rate", "distill_learning_rate"):
      check_finite_number(owner, name, getattr(self, name), above=0)
    check_finite_number(owner, "sft_noise", self.sft_noise, at_least=0, at_most=1)


RL_MODES = ("sync", "async")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLSection:
  """GRPO's rollouts and where they run. mode "sync": one jitted step per update on one
  mesh; "async": rollouts on ``rollout_devices`` devices and training on the next
  ``train_devices``, overlapped, trajectories at most ``max_policy_lag`` updates old.

  mesh: (data, fsdp, tensor) of the sync mesh; rollouts split weights and KV heads over
  tensor and requests over data * fsdp. In async mode only (1, 1, T): both meshes
  split heads T ways.

  engine: the rollout engine of each shard (``--rl.engine.num_slots``, ``page_size``,
  ``memory_budget_bytes`` / ``memory_fraction``, ...). With a memory budget and
  num_slots=0 the rollout decodes as many samples at once as fit, and a num_slots that
  cannot fit is refused before anything compiles."""
  mode: str = "sync"  # "sync" or "async" (see above)
  steps: int = 30  # GRPO updates in the run
  group_size: int = 8  # samples per prompt (a GRPO group)
  prompts_per_step: int = 8  # prompts per update
  temperature: float = 1.0  # sampling temperature of the rollouts (> 0)
  engine: EngineConfig = EngineConfig(num_slots=8)
  max_policy_lag: int = 1  # async: updates a trajectory may lag the policy it trains
  mesh: tuple[int, int, int] = (1, 1, 1)
  rollout_devices: int = 1  # async: devices of the rollout mesh
  train_devices: int = 1  # async: devices of the train mesh
  seed: int = 0  # seed of the data order and the rollouts' sampling

  def __post_init__(self):
    owner = "RLSection"
    check(self.mode in RL_MODES, owner, "mode", self.mode, f"one of {RL_MODES}")
    for name in ("steps", "group_size", "prompts_per_step", "rollout_devices", "train_devices"):
      check_positive_int(owner, name, getattr(self, name))
    check(isinstance(self.engine, EngineConfig), owner, "engine", self.engine,
          "an EngineConfig")
    check_non_negative_int(owner, "max_policy_lag", self.max_policy_lag)
    check_finite_number(owner, "temperature", self.temperature, above=0,
                        why="(GRPO needs sampled rollouts)")
    check_non_negative_int(owner, "seed", self.seed)
    check(isinstance(self.mesh, tuple) and len(self.mesh) == 3
          and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.mesh),
          owner, "mesh", self.mesh, "three positive sizes (data, fsdp, tensor)")
    if self.mode == "async":
      tensor = self.mesh[2]
      check(self.mesh[:2] == (1, 1), owner, "mesh", self.mesh,
            "(1, 1, T) in async mode: rollout_devices and train_devices size the two "
            "meshes, and T splits heads over 'tensor' in both")
      for name in ("rollout_devices", "train_devices"):
        check(getattr(self, name) % tensor == 0, owner, name, getattr(self, name),
              f"a multiple of the tensor size {tensor} of RLSection.mesh")
    self.rollout(1)  # the rollout's own checks, now rather than after the warm start

  def samples_per_replica(self) -> int:
    """Rows of one step's batch on each learner replica (data * fsdp of its mesh)."""
    if self.mode == "async":
      replicas = self.train_devices // self.mesh[2]
    else:
      replicas = self.mesh[0] * self.mesh[1]
    return self.group_size * self.prompts_per_step // max(replicas, 1)

  def rollout(self, max_new_tokens: int,
              stop_token_ids: tuple[int, ...] = (tokenizer.EOS_ID,)) -> RolloutConfig:
    """stop_token_ids: the policy tokenizer's eos ids (default the built-in EOS)."""
    sampling = SamplingParams(temperature=self.temperature, max_new_tokens=max_new_tokens,
                              stop_token_ids=tuple(stop_token_ids))
    return RolloutConfig(group_size=self.group_size, prompts_per_step=self.prompts_per_step,
                         sampling=sampling)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputSection:
  """Where a run writes: metrics.jsonl, TensorBoard events, checkpoints/, plots.

  keep_checkpoints: the newest this many are kept (at least 1: the one resume uses).
  collapse_window: steps in a row of zero gradient norm and constant reward after
    which the ``collapse_warning`` metric turns on and the console says so once.
  compilation_cache: JAX's persistent compilation cache for `specrl train` and the
    demo: "auto" (``<parent of directory>/jax_compilation_cache``), "off", or a
    folder; a cache set by JAX_COMPILATION_CACHE_DIR wins (``specrl_jax.compile_cache``).
  """
  directory: str = "runs/train"  # the run directory (re-running with it resumes)
  checkpoint_every: int = 10  # steps between checkpoints (0 = only at the end)
  keep_checkpoints: int = 3
  resume: bool = True  # continue from the directory's latest checkpoint (false: start over)
  tensorboard: bool = True  # write TensorBoard events beside metrics.jsonl
  plots: bool = True  # write PNG plots at the end
  progress: bool = True  # progress bars on stderr
  collapse_window: int = 5
  compilation_cache: str = "auto"

  def __post_init__(self):
    owner = "OutputSection"
    check(isinstance(self.directory, str) and self.directory.strip() != "", owner,
          "directory", self.directory, "a non-empty path")
    check_non_negative_int(owner, "checkpoint_every", self.checkpoint_every,
                  "an integer >= 0 (0 = only at the end)")
    check_positive_int(owner, "keep_checkpoints", self.keep_checkpoints)
    for name in ("resume", "tensorboard", "plots", "progress"):
      check(isinstance(getattr(self, name), bool), owner, name, getattr(self, name),
            "True or False")
    check(isinstance(self.compilation_cache, str), owner, "compilation_cache",
          self.compilation_cache, '"auto", "off" or a folder')
    check_non_negative_int(owner, "collapse_window", self.collapse_window,
                  "an integer >= 0 (steps of zero gradient and constant reward before a "
                  "collapse warning; 0 = never warn)")


# The experiment's learner: constant rate after a short warmup, clipped gradients, the
# DAPO upper clip and a TIS cap, float32 master weights, and the ratio's denominator from
# the update's own forward (exact: one update per batch).
LEARNER = LearnerConfig(learning_rate=1e-4, schedule="constant", warmup_steps=5,
                        decay_steps=None, max_grad_norm=1.0,
                        loss=GRPOConfig(clip_eps_high=0.28, tis_cap=2.0),
                        skip_log_prob_pass=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
  """learner: ``--learner.learning_rate``, ``--learner.loss.beta`` (KL to the initial
  policy: a frozen reference copy is kept, checkpointed and restored),
  ``--learner.lora.rank`` (LoRA adapters on a frozen base), ``--learner.remat``, ...;
  decay_steps None decays over the rest of the run (rl.steps - warmup_steps)."""
  policy: ModelSection = ModelSection()
  drafter: DrafterSection = DrafterSection()
  task: TaskSection = TaskSection()
  data: DataSection = DataSection()
  warm_start: WarmStartSection = WarmStartSection()
  rl: RLSection = RLSection()
  learner: LearnerConfig = LEARNER
  output: OutputSection = OutputSection()

  def __post_init__(self):
    check(isinstance(self.learner, LearnerConfig), "ExperimentConfig", "learner",
          self.learner, "a LearnerConfig")
    micro, rows = self.learner.num_micro_batches, self.rl.samples_per_replica()
    check(rows % micro == 0, "LearnerConfig", "num_micro_batches", micro,
          f"a divisor of the {rows} samples each learner replica trains on per step "
          f"(rl.group_size * rl.prompts_per_step / data-parallel replicas)")
    # The sync step is one program: its rollout's seconds cannot be told from the
    # learner's, so nothing would refresh the table.
    check(not self.drafter.refresh_weight or self.rl.mode == "async", "DrafterSection",
          "refresh_weight", self.drafter.refresh_weight,
          "0 unless rl.mode='async' (a sync step does not time its rollout apart)")

  def learner_config(self) -> LearnerConfig:
    """The learner with decay_steps resolved (None: over the steps after warmup)."""
    if self.learner.decay_steps is not None:
      return self.learner
    return dataclasses.replace(
        self.learner, decay_steps=max(self.rl.steps - self.learner.warmup_steps, 1))


PRESETS: dict[str, ExperimentConfig] = {
    # `make demo`: an 11.5M-parameter policy (46 MB of float32 weights, beyond a CPU's
    # last-level cache), a 128-wide one-layer drafter at k = 4, 1-2 digit addition, on 4
    # slots. Each forward then reads its weights from memory, and 4 slots x 5 tokens are
    # too few rows to make it compute-bound, so verifying a round costs ~1.5 plain steps:
    # the regime of an accelerator below its roofline's ridge point. The 1.2M policy it
    # replaced fit in cache and was compute-bound at 8 slots: a round cost 2.9-3.7 plain
    # steps and no drafter paid (docs/results.md, "Demo round cost").
    "demo": ExperimentConfig(
        policy=ModelSection(hidden_size=512, intermediate_size=2048, num_layers=3, num_heads=8,
                            num_kv_heads=2, head_dim=64),
        drafter=DrafterSection(num_draft_tokens=4, model=ModelSection(
            hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=1,
            head_dim=32, seed=1)),
        task=TaskSection(min_digits=1, max_digits=2),
        warm_start=WarmStartSection(sft_steps=100, sft_learning_rate=2e-3, distill_steps=200,
                                    distill_learning_rate=5e-3),
        rl=RLSection(steps=30, prompts_per_step=16, engine=EngineConfig(num_slots=4)),
        learner=dataclasses.replace(LEARNER, warmup_steps=3),
        output=OutputSection(directory="runs/demo", checkpoint_every=0)),
    # Tests: a tiny policy and drafter, few short steps.
    "tiny": ExperimentConfig(
        policy=ModelSection(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=16),
        drafter=DrafterSection(model=ModelSection(hidden_size=32, intermediate_size=64,
                                                  num_layers=1, num_heads=1, num_kv_heads=1,
                                                  head_dim=16, seed=1)),
        task=TaskSection(min_digits=1, max_digits=1, num_prompts=64),
        warm_start=WarmStartSection(sft_steps=120, sft_batch_size=16, sft_learning_rate=1e-2,
                                    sft_noise=0.5, distill_steps=10),
        rl=RLSection(steps=4, group_size=4, prompts_per_step=4,
                     engine=EngineConfig(num_slots=0)),
        learner=dataclasses.replace(LEARNER, learning_rate=1e-3, warmup_steps=0),
        output=OutputSection(directory="runs/tiny", checkpoint_every=2, plots=False)),
    # `specrl train --model=PATH --dataset=PATH`: a pretrained policy on a dataset, no
    # warm start, history drafts: no weights to train, and the only drafter whose
    # acceptance grows as the epochs revisit prompts (experiments/bench_own_model.py,
    # docs/drafters.md); rollouts kept up to data.max_response_tokens' default 256.
    "dataset": ExperimentConfig(
        drafter=DrafterSection(kind="history", history=HistoryConfig(rollout_tokens=288)),
        warm_start=WarmStartSection(sft_steps=0, distill_steps=0),
        rl=RLSection(steps=100, group_size=8, prompts_per_step=8,
                     engine=EngineConfig(num_slots=0)),
        learner=dataclasses.replace(LEARNER, learning_rate=1e-6, warmup_steps=10),
        output=OutputSection(directory="runs/dataset")),
}


def experiment_config(preset: str = "demo", overrides: Sequence[str] = ()) -> ExperimentConfig:
  if preset not in PRESETS:
    raise ConfigError(f"preset={preset!r} is invalid: expected one of {sorted(PRESETS)}.")
  config = apply_overrides(PRESETS[preset], overrides)
  # After every override: the drafter's checks read other sections too.
  drafter_registry.check_section(config.drafter, config)
  return config


def from_dict(record: dict[str, Any]) -> ExperimentConfig:
  """The experiment config a run recorded (``to_dict``), retired fields replaced."""
  return from_dict_of(ExperimentConfig, run_directory.upgrade_record(record))
