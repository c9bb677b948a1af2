"""Where the GPUs go: the rollout pool (inference instances of ``rollout_tp`` chips
each) and the training pool, either the same chips (colocated: the stages take turns)
or disjoint pools (needed by async RL, where they run at the same time)."""

from __future__ import annotations

import dataclasses

from specrl_jax.config import check, check_positive_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelLayout:
  """rollout_tp: chips per inference instance (tensor parallel; for an MoE the experts
  are split over the same chips, by expert when ``rollout_ep`` equals rollout_tp, by
  tensor when it is 1). Instances are data parallel over the rollout pool."""

  total_gpus: int
  rollout_gpus: int
  training_gpus: int
  colocated: bool
  rollout_tp: int = 1
  rollout_ep: int = 1

  def __post_init__(self):
    owner = "ParallelLayout"
    for field in ("total_gpus", "rollout_gpus", "training_gpus", "rollout_tp", "rollout_ep"):
      check_positive_int(owner, field, getattr(self, field))
    check(isinstance(self.colocated, bool), owner, "colocated", self.colocated, "a bool")
    check(self.rollout_gpus <= self.total_gpus, owner, "rollout_gpus", self.rollout_gpus,
          f"<= total_gpus={self.total_gpus} (more GPUs for rollout than exist)")
    check(self.training_gpus <= self.total_gpus, owner, "training_gpus",
          self.training_gpus, f"<= total_gpus={self.total_gpus}")
    if self.colocated:
      check(self.rollout_gpus == self.training_gpus == self.total_gpus, owner,
            "colocated", self.colocated,
            "False unless rollout_gpus == training_gpus == total_gpus")
    else:
      check(self.rollout_gpus + self.training_gpus <= self.total_gpus, owner,
            "rollout_gpus", self.rollout_gpus,
            f"<= total_gpus - training_gpus = {self.total_gpus - self.training_gpus} "
            "for separate pools")
    check(self.rollout_gpus % self.rollout_tp == 0, owner, "rollout_tp", self.rollout_tp,
          f"a divisor of rollout_gpus={self.rollout_gpus}")
    check(self.rollout_ep in (1, self.rollout_tp), owner, "rollout_ep", self.rollout_ep,
          f"1 or rollout_tp={self.rollout_tp}")

  @property
  def rollout_instances(self) -> int:
    return self.rollout_gpus // self.rollout_tp

  @classmethod
  def colocate(cls, gpus: int, *, rollout_tp: int = 1, rollout_ep: int = 1
               ) -> "ParallelLayout":
    return cls(total_gpus=gpus, rollout_gpus=gpus, training_gpus=gpus, colocated=True,
               rollout_tp=rollout_tp, rollout_ep=rollout_ep)

  @classmethod
  def split(cls, *, rollout_gpus: int, training_gpus: int, rollout_tp: int = 1,
            rollout_ep: int = 1) -> "ParallelLayout":
    return cls(total_gpus=rollout_gpus + training_gpus, rollout_gpus=rollout_gpus,
               training_gpus=training_gpus, colocated=False, rollout_tp=rollout_tp,
               rollout_ep=rollout_ep)
