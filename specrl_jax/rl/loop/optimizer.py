"""The GRPO learner's configuration: optimizer, learning-rate schedule, micro-batching,
precision and rematerialisation.

Every float field must be a finite number: an infinite learning rate or epsilon would
train NaN weights from the first update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import optax

from specrl_jax.config import (check, check_non_negative_int, check_positive_int, is_finite_number,
                               is_integer)
from specrl_jax.models.transformer import REMAT_POLICIES
from specrl_jax.rl.loop.lora import LoRAConfig
from specrl_jax.rl.algo.losses import GRPOConfig
from specrl_jax.rl.loop.precision import MASTER_DTYPES

Array = jax.Array
Schedule = Callable[[Array], Array]


def _constant(config: "LearnerConfig", peak: float) -> Schedule:
  del config
  return optax.constant_schedule(peak)


def _linear(config: "LearnerConfig", peak: float) -> Schedule:
  return optax.linear_schedule(peak, peak * config.final_learning_rate_ratio,
                               config.decay_steps)


def _cosine(config: "LearnerConfig", peak: float) -> Schedule:
  return optax.cosine_decay_schedule(peak, config.decay_steps,
                                     alpha=config.final_learning_rate_ratio)


# Decay shapes after warmup, by name: peak -> peak * final_learning_rate_ratio over
# decay_steps, then held.
SCHEDULES: dict[str, Callable[["LearnerConfig", float], Schedule]] = {
    "constant": _constant,
    "linear": _linear,
    "cosine": _cosine,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerConfig:
  """Optimizer, schedule, micro-batching and the loss of the GRPO learner.

  num_micro_batches: the per-replica batch is processed in this many sequential
    slices with gradients accumulated (memory, not math: the result is the same).
  max_grad_norm: global-norm clipping threshold, None to disable.
  drafter_learning_rate: peak learning rate of the drafter's optimizer (None: the
    policy's); the drafter shares schedule shape, Adam and clipping settings.
  master_dtype: the dtype of the train state's weights and optimizer moments, "float32"
    (default) or None to keep the model's own; the loss and the rollout read the
    weights cast back to the model's dtype (``rl.loop.precision``).
  remat: what each decoder block keeps for the backward pass, a name in
    ``models.transformer.REMAT_POLICIES`` ("none", "full", "dots_saveable", ...):
    memory, not math.
  skip_log_prob_pass: take the ratio's denominator (``Batch.old_logprobs``) from the
    update's own forward, detached, instead of a separate log-prob pass. Exact here:
    each batch gets one update, so the pass would compute the same values with the
    same weights; it saves one forward over the batch.
  lora: train LoRA adapters on a frozen base instead of every weight (``rl.loop.lora``).
  """

  learning_rate: float = 1e-6  # peak Adam learning rate of the policy
  schedule: str = "cosine"  # a name in SCHEDULES (constant, linear or cosine decay after warmup)
  warmup_steps: int = 0  # linear warmup from 0
  decay_steps: int | None = 1000  # steps of decay after warmup
  final_learning_rate_ratio: float = 0.1  # the decayed rate, as a fraction of the peak
  weight_decay: float = 0.0  # AdamW decoupled weight decay
  adam_b1: float = 0.9  # Adam's first-moment decay
  adam_b2: float = 0.999  # Adam's second-moment decay
  adam_eps: float = 1e-8  # Adam's epsilon
  max_grad_norm: float | None = 1.0
  num_micro_batches: int = 1
  loss: GRPOConfig = GRPOConfig()
  drafter_learning_rate: float | None = None
  master_dtype: str | None = "float32"
  remat: str = "none"
  skip_log_prob_pass: bool = False
  lora: LoRAConfig | None = None

  def __post_init__(self):
    owner = "LearnerConfig"
    number = lambda name, ok, allowed: check(
        is_finite_number(getattr(self, name)) and ok(getattr(self, name)), owner, name,
        getattr(self, name), f"a finite number {allowed}")
    number("learning_rate", lambda v: v >= 0, ">= 0")
    check(self.schedule in SCHEDULES, owner, "schedule", self.schedule,
          f"one of {sorted(SCHEDULES)}")
    check_non_negative_int(owner, "warmup_steps", self.warmup_steps)
    check(self.decay_steps is None or (is_integer(self.decay_steps) and self.decay_steps > 0),
          owner,
          "decay_steps", self.decay_steps,
          "a positive integer, or None for a run to fill in (the steps after warmup)")
    number("final_learning_rate_ratio", lambda v: 0 <= v <= 1, "in [0, 1]")
    number("weight_decay", lambda v: v >= 0, ">= 0")
    number("adam_b1", lambda v: 0 <= v < 1, "in [0, 1)")
    number("adam_b2", lambda v: 0 <= v < 1, "in [0, 1)")
    number("adam_eps", lambda v: v > 0, "> 0")
    check(self.max_grad_norm is None
          or (is_finite_number(self.max_grad_norm) and self.max_grad_norm > 0), owner,
          "max_grad_norm", self.max_grad_norm, "None (no clipping) or a finite number > 0")
    check_positive_int(owner, "num_micro_batches", self.num_micro_batches)
    check(isinstance(self.loss, GRPOConfig), owner, "loss", self.loss, "a GRPOConfig")
    check(self.drafter_learning_rate is None
          or (is_finite_number(self.drafter_learning_rate) and self.drafter_learning_rate >= 0),
          owner, "drafter_learning_rate", self.drafter_learning_rate,
          "None or a finite number >= 0")
    check(self.master_dtype in MASTER_DTYPES, owner, "master_dtype", self.master_dtype,
          f"one of {MASTER_DTYPES} (None: the model's own dtype)")
    check(self.remat in REMAT_POLICIES, owner, "remat", self.remat,
          f"one of {sorted(REMAT_POLICIES)}")
    check(isinstance(self.skip_log_prob_pass, bool), owner, "skip_log_prob_pass",
          self.skip_log_prob_pass, "True or False")
    check(self.lora is None or isinstance(self.lora, LoRAConfig), owner, "lora", self.lora,
          "None (train every weight) or a LoRAConfig")


def learning_rate_schedule(config: LearnerConfig, peak: float | None = None) -> Schedule:
  """Linear warmup from 0 over warmup_steps, then the configured decay from ``peak``."""
  check(config.decay_steps is not None or config.schedule == "constant", "LearnerConfig",
        "decay_steps", None, f"a positive integer for the {config.schedule!r} schedule (None "
        "is for an experiment to fill in with its steps after warmup)")
  peak = config.learning_rate if peak is None else peak
  decay = SCHEDULES[config.schedule](config, peak)
  if config.warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(0.0, peak, config.warmup_steps)
  return optax.join_schedules([warmup, decay], [config.warmup_steps])


def _decays(params):
  # Weight decay on matrices only: shrinking norm scales toward 0 is not regularisation.
  return jax.tree.map(lambda x: x.ndim > 1, params)


def make_optimizer(config: LearnerConfig, peak: float | None = None
                   ) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on the warmup/decay schedule."""
  adamw = optax.adamw(learning_rate_schedule(config, peak), b1=config.adam_b1,
                      b2=config.adam_b2, eps=config.adam_eps,
                      weight_decay=config.weight_decay, mask=_decays)
  if config.max_grad_norm is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)


def drafter_peak(config: LearnerConfig) -> float:
  if config.drafter_learning_rate is None:
    return config.learning_rate
  return config.drafter_learning_rate
