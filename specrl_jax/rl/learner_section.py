"""The `learner` section of an experiment config (``specrl train --learner.*``): the
learner's schedule, batching, KL, precision, remat and LoRA, beyond the learning rate
and warmup that ``rl`` holds."""

from __future__ import annotations

import dataclasses

from specrl_jax.config import check
from specrl_jax.rl.lora import PROJECTIONS, LoRAConfig
from specrl_jax.rl.losses import GRPOConfig
from specrl_jax.rl.optimizer import LearnerConfig, non_negative_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerSection:
  """The learner, beyond ``rl.learning_rate`` and ``rl.warmup_steps``.

  schedule: the decay after warmup, one of ``rl.optimizer.SCHEDULES`` (constant,
    linear, cosine), from the peak to peak * final_learning_rate_ratio over
    decay_steps (None: the rest of the run, rl.steps - rl.warmup_steps; give it
    explicitly to resume a linear or cosine run with more rl.steps on the same curve).
  num_micro_batches: gradient accumulation, the per-replica batch in this many slices
    (memory, not math).
  kl_beta: weight of the KL term to the initial policy; > 0 keeps a frozen reference
    copy in the train state (checkpointed, restored on resume).
  master_dtype: "float32" weights and Adam moments whatever the model computes in, or
    None for the model's own dtype. remat: what each decoder block keeps for the
    backward pass (``models.transformer.REMAT_POLICIES``).
  skip_log_prob_pass: take the ratio's denominator from the update's own forward
    (exact: one update per batch; see ``LearnerConfig``), saving one forward a step.
  lora_rank: > 0 trains rank-r LoRA adapters (scaled by lora_alpha / r) on the
    projections named in lora_targets, the base policy frozen (``rl.lora``); 0 trains
    every weight.
  """
  schedule: str = "constant"
  decay_steps: int | None = None
  final_learning_rate_ratio: float = 0.1
  num_micro_batches: int = 1
  kl_beta: float = 0.0
  weight_decay: float = 0.0
  max_grad_norm: float | None = 1.0
  master_dtype: str | None = "float32"
  remat: str = "none"
  skip_log_prob_pass: bool = True
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = PROJECTIONS

  def __post_init__(self):
    check(self.decay_steps is None or (isinstance(self.decay_steps, int)
                                       and not isinstance(self.decay_steps, bool)
                                       and self.decay_steps > 0),
          "LearnerSection", "decay_steps", self.decay_steps,
          "None (the rest of the run) or a positive integer")
    self.config(learning_rate=0.0, steps=1, warmup_steps=0)  # LearnerConfig's own checks

  def config(self, *, learning_rate: float, steps: int, warmup_steps: int,
             loss: GRPOConfig = GRPOConfig()) -> LearnerConfig:
    decay = self.decay_steps or max(steps - warmup_steps, 1)
    return LearnerConfig(
        learning_rate=learning_rate, schedule=self.schedule, warmup_steps=warmup_steps,
        decay_steps=decay, final_learning_rate_ratio=self.final_learning_rate_ratio,
        weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm,
        num_micro_batches=self.num_micro_batches, master_dtype=self.master_dtype,
        remat=self.remat, skip_log_prob_pass=self.skip_log_prob_pass,
        loss=dataclasses.replace(loss, beta=self.kl_beta), lora=self.lora())

  def lora(self) -> LoRAConfig | None:
    check(non_negative_int(self.lora_rank), "LearnerSection", "lora_rank", self.lora_rank,
          "an integer >= 0 (0: train every weight)")
    if self.lora_rank == 0:
      return None
    return LoRAConfig(rank=self.lora_rank, alpha=self.lora_alpha, targets=self.lora_targets)
