"""Experiment configuration: frozen dataclasses, named presets, command-line overrides.

    config = experiment_config("demo", ["--rl.group_size=8", "--drafter.kind=none"])

Each section validates itself; an override names a field by its dotted path and is
parsed to that field's type, so `--rl.steps=ten` fails with the field and the value.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from specrl_jax.config import ConfigError, ModelConfig, SamplingParams, check, is_finite_number
from specrl_jax.models import tokenizer
from specrl_jax.rl.learner import LearnerConfig
from specrl_jax.rl.losses import GRPOConfig
from specrl_jax.rl.rollout import RolloutConfig
from specrl_jax.rl.tasks import TASKS, Task, make_task
from specrl_jax.sampling.engine import EngineConfig


def _positive(owner, name, value):
  check(isinstance(value, int) and not isinstance(value, bool) and value > 0, owner, name,
        value, "a positive integer")


def _non_negative(owner, name, value, allowed="an integer >= 0"):
  check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, owner, name,
        value, allowed)


def _number(owner, name, value, ok, allowed):
  """A finite number for which ``ok`` holds (every float field is checked so: an
  infinite learning rate trains NaN weights, an infinite cap caps nothing)."""
  check(is_finite_number(value) and ok(value), owner, name, value, f"a finite number {allowed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
  """A built-in-vocabulary decoder (the policy, or a draft model)."""
  hidden_size: int = 192
  intermediate_size: int = 512
  num_layers: int = 3
  num_heads: int = 6
  num_kv_heads: int = 2
  head_dim: int = 32
  seed: int = 0

  def __post_init__(self):
    _non_negative("ModelSection", "seed", self.seed)
    self.model_config()  # its own checks name the bad size

  def model_config(self) -> ModelConfig:
    return ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=self.hidden_size,
                       intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       head_dim=self.head_dim, max_position_embeddings=512)


DRAFTER_KINDS = ("none", "draft_model", "ngram")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterSection:
  """kind: "none" (plain rollouts), "draft_model" (a small model distilled from the
  warm-started policy) or "ngram"; online: keep training the draft model during RL."""
  kind: str = "draft_model"
  num_draft_tokens: int = 3
  online: bool = True
  loss_weight: float = 1.0
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 1
  num_heads: int = 2
  num_kv_heads: int = 1
  head_dim: int = 32
  ngram_n: int = 3

  def __post_init__(self):
    owner = "DrafterSection"
    check(self.kind in DRAFTER_KINDS, owner, "kind", self.kind, f"one of {DRAFTER_KINDS}")
    _positive(owner, "num_draft_tokens", self.num_draft_tokens)
    _number(owner, "loss_weight", self.loss_weight, lambda v: v >= 0, ">= 0")
    check(isinstance(self.online, bool), owner, "online", self.online, "True or False")
    _positive(owner, "ngram_n", self.ngram_n)
    if self.kind == "draft_model":
      self.model.model_config()

  @property
  def model(self) -> ModelSection:
    return ModelSection(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                        num_layers=self.num_layers, num_heads=self.num_heads,
                        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, seed=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSection:
  """The task (by registry name) and its prompt set: ``num_prompts`` problems drawn
  with ``seed``. Options not used by the chosen task are ignored."""
  name: str = "arithmetic"
  min_digits: int = 2
  max_digits: int = 3
  num_numbers: int = 3
  max_number: int = 9
  num_prompts: int = 512
  seed: int = 0

  def __post_init__(self):
    check(self.name in TASKS, "TaskSection", "name", self.name, f"one of {sorted(TASKS)}")
    _positive("TaskSection", "num_prompts", self.num_prompts)
    _non_negative("TaskSection", "seed", self.seed)
    self.make()  # the task checks its own options

  def make(self) -> Task:
    options = {"arithmetic": dict(min_digits=self.min_digits, max_digits=self.max_digits),
               "countdown": dict(num_numbers=self.num_numbers, max_number=self.max_number)}
    return make_task(self.name, **options.get(self.name, {}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartSection:
  """SFT of the policy on worked solutions, then distillation of the draft model."""
  sft_steps: int = 300
  sft_batch_size: int = 32
  sft_learning_rate: float = 3e-3
  sft_noise: float = 0.0
  distill_steps: int = 150
  distill_learning_rate: float = 3e-3

  def __post_init__(self):
    owner = "WarmStartSection"
    for name in ("sft_steps", "distill_steps"):
      _non_negative(owner, name, getattr(self, name))
    _positive(owner, "sft_batch_size", self.sft_batch_size)
    for name in ("sft_learning_rate", "distill_learning_rate"):
      _number(owner, name, getattr(self, name), lambda v: v > 0, "> 0")
    _number(owner, "sft_noise", self.sft_noise, lambda v: 0 <= v <= 1, "in [0, 1]")


RL_MODES = ("sync", "async")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLSection:
  """GRPO. mode "sync": one jitted step per update on one mesh; "async": rollouts on
  ``rollout_devices`` devices and training on the next ``train_devices``, overlapped,
  trajectories at most ``max_policy_lag`` updates old.

  mesh: (data, fsdp, tensor) of the sync mesh; rollouts split weights and KV heads over
  tensor and requests over data * fsdp. In async mode only (1, 1, T): both meshes
  split heads T ways.

  memory_budget_bytes / memory_fraction: size each rollout shard's KV page pool from a
  byte budget per device (weights included) or a share of the device's free memory, as
  ``EngineConfig`` does; with num_slots=0 the rollout then decodes as many samples at
  once as fit, and a num_slots that cannot fit is refused before anything compiles.

  compaction: continue a rollout's last live samples in narrower decode programs
  (``EngineConfig.compaction``)."""
  mode: str = "sync"
  steps: int = 30
  group_size: int = 8
  prompts_per_step: int = 8
  temperature: float = 1.0
  learning_rate: float = 1e-4
  warmup_steps: int = 5
  clip_eps_high: float = 0.28
  tis_cap: float = 2.0
  num_slots: int = 8
  memory_budget_bytes: int | None = None
  memory_fraction: float | None = None
  compaction: bool = False
  max_policy_lag: int = 1
  mesh: tuple[int, int, int] = (1, 1, 1)
  rollout_devices: int = 1
  train_devices: int = 1
  seed: int = 0

  def __post_init__(self):
    owner = "RLSection"
    check(self.mode in RL_MODES, owner, "mode", self.mode, f"one of {RL_MODES}")
    for name in ("steps", "group_size", "prompts_per_step", "rollout_devices", "train_devices"):
      _positive(owner, name, getattr(self, name))
    check(isinstance(self.num_slots, int) and self.num_slots >= 0, owner, "num_slots",
          self.num_slots, "an integer >= 0 (0 = one slot per sample)")
    self.engine()  # the engine's own checks of the memory settings
    check(isinstance(self.max_policy_lag, int) and self.max_policy_lag >= 0, owner,
          "max_policy_lag", self.max_policy_lag, "an integer >= 0")
    _number(owner, "temperature", self.temperature, lambda v: v > 0,
            "> 0 (GRPO needs sampled rollouts)")
    _number(owner, "learning_rate", self.learning_rate, lambda v: v >= 0, ">= 0")
    _number(owner, "clip_eps_high", self.clip_eps_high, lambda v: v >= 0, ">= 0")
    _number(owner, "tis_cap", self.tis_cap, lambda v: v > 0, "> 0")
    _non_negative(owner, "warmup_steps", self.warmup_steps)
    _non_negative(owner, "seed", self.seed)
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
    # The learner's and the rollout's own checks, now rather than after the warm start.
    self.learner()
    self.rollout(1)

  def engine(self) -> EngineConfig:
    return EngineConfig(num_slots=self.num_slots, memory_budget_bytes=self.memory_budget_bytes,
                        memory_fraction=self.memory_fraction, compaction=self.compaction)

  def learner(self) -> LearnerConfig:
    return LearnerConfig(learning_rate=self.learning_rate, schedule="constant",
                         warmup_steps=self.warmup_steps, max_grad_norm=1.0,
                         loss=GRPOConfig(clip_eps_high=self.clip_eps_high, tis_cap=self.tis_cap))

  def rollout(self, max_new_tokens: int) -> RolloutConfig:
    sampling = SamplingParams(temperature=self.temperature, max_new_tokens=max_new_tokens,
                              stop_token_ids=(tokenizer.EOS_ID,))
    return RolloutConfig(group_size=self.group_size, prompts_per_step=self.prompts_per_step,
                         sampling=sampling)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputSection:
  """Where a run writes: metrics.jsonl, TensorBoard events, checkpoints/, plots.

  keep_checkpoints: the newest this many are kept (at least 1: the one resume uses).
  collapse_window: steps in a row of zero gradient norm and constant reward after
    which the ``collapse_warning`` metric turns on and the console says so once.
  """
  directory: str = "runs/train"
  checkpoint_every: int = 10
  keep_checkpoints: int = 3
  resume: bool = True
  tensorboard: bool = True
  plots: bool = True
  progress: bool = True
  collapse_window: int = 5

  def __post_init__(self):
    owner = "OutputSection"
    check(isinstance(self.directory, str) and self.directory.strip() != "", owner,
          "directory", self.directory, "a non-empty path")
    _non_negative(owner, "checkpoint_every", self.checkpoint_every,
                  "an integer >= 0 (0 = only at the end)")
    _positive(owner, "keep_checkpoints", self.keep_checkpoints)
    for name in ("resume", "tensorboard", "plots", "progress"):
      check(isinstance(getattr(self, name), bool), owner, name, getattr(self, name),
            "True or False")
    _non_negative(owner, "collapse_window", self.collapse_window,
                  "an integer >= 0 (steps of zero gradient and constant reward before a "
                  "collapse warning; 0 = never warn)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
  policy: ModelSection = ModelSection()
  drafter: DrafterSection = DrafterSection()
  task: TaskSection = TaskSection()
  warm_start: WarmStartSection = WarmStartSection()
  rl: RLSection = RLSection()
  output: OutputSection = OutputSection()


PRESETS: dict[str, ExperimentConfig] = {
    # `make demo`: ~1.2M-parameter policy, 64-wide one-layer drafter, 1-2 digit addition.
    "demo": ExperimentConfig(
        task=TaskSection(min_digits=1, max_digits=2),
        warm_start=WarmStartSection(sft_steps=150, sft_learning_rate=5e-3, distill_steps=100,
                                    distill_learning_rate=5e-3),
        rl=RLSection(steps=30, prompts_per_step=16, warmup_steps=3),
        output=OutputSection(directory="runs/demo", checkpoint_every=0)),
    # Tests: a tiny policy and drafter, few short steps.
    "tiny": ExperimentConfig(
        policy=ModelSection(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=16),
        drafter=DrafterSection(hidden_size=32, intermediate_size=64, num_heads=1, head_dim=16),
        task=TaskSection(min_digits=1, max_digits=1, num_prompts=64),
        warm_start=WarmStartSection(sft_steps=120, sft_batch_size=16, sft_learning_rate=1e-2,
                                    sft_noise=0.5, distill_steps=10),
        rl=RLSection(steps=4, group_size=4, prompts_per_step=4, num_slots=0,
                     learning_rate=1e-3, warmup_steps=0),
        output=OutputSection(directory="runs/tiny", checkpoint_every=2, plots=False)),
}


# ----------------------------------------------------------------- overrides

def _parse(text: str, current: Any, annotation: Any, path: str) -> Any:
  """``text`` as a value of the field's type (the annotation, else the default's)."""
  origin = typing.get_origin(annotation)
  args = typing.get_args(annotation)
  if text.lower() == "none" and (current is None or type(None) in args):
    return None
  kind = type(current) if current is not None else next(a for a in args if a is not type(None))
  try:
    if kind is bool:
      lowered = text.lower()
      if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(text)
      return lowered in ("true", "1", "yes")
    if kind is tuple or origin is tuple:
      element = (args[0] if args else type(current[0]) if current else int)
      return tuple(element(part) for part in text.strip("()").split(",") if part.strip())
    return kind(text)
  except (ValueError, TypeError, StopIteration):
    raise ConfigError(f"--{path}={text!r} is invalid: expected a value of type "
                      f"{getattr(kind, '__name__', kind)}.") from None


def _replace(config: Any, names: Sequence[str], text: str, path: str) -> Any:
  fields = {f.name: f for f in dataclasses.fields(config)}
  if names[0] not in fields:
    raise ConfigError(f"--{path} is not a config field: {type(config).__name__} has "
                      f"{sorted(fields)}.")
  current = getattr(config, names[0])
  if len(names) > 1:
    if not dataclasses.is_dataclass(current):
      raise ConfigError(f"--{path}: {names[0]} is a value, not a section.")
    value = _replace(current, names[1:], text, path)
  else:
    if dataclasses.is_dataclass(current):
      raise ConfigError(f"--{path} names a section; set one of its fields, e.g. "
                        f"--{path}.{dataclasses.fields(current)[0].name}=...")
    hints = typing.get_type_hints(type(config))
    value = _parse(text, current, hints.get(names[0]), path)
  return dataclasses.replace(config, **{names[0]: value})


def apply_overrides(config: ExperimentConfig, overrides: Sequence[str]) -> ExperimentConfig:
  """Applies ``--section.field=value`` overrides in order."""
  for override in overrides:
    if not override.startswith("--") or "=" not in override:
      raise ConfigError(f"override {override!r} is invalid: expected --section.field=value.")
    path, text = override[2:].split("=", 1)
    config = _replace(config, path.split("."), text, path)
  return config


def experiment_config(preset: str = "demo", overrides: Sequence[str] = ()) -> ExperimentConfig:
  if preset not in PRESETS:
    raise ConfigError(f"preset={preset!r} is invalid: expected one of {sorted(PRESETS)}.")
  return apply_overrides(PRESETS[preset], overrides)


def to_dict(config: ExperimentConfig) -> dict[str, Any]:
  return dataclasses.asdict(config)
