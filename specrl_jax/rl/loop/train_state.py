"""The learner's data: the train state, a training batch, and a drafter's objective.

Kept apart from ``rl.loop.learner`` (which compiles the update) so that the loss
(``rl.loop.policy_loss``) and the learner can both read them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax

from specrl_jax.config import check, is_integer
from specrl_jax.models.transformer import ForwardOutput
from specrl_jax.rl.loop import lora, precision
from specrl_jax.rl.loop.lora import LoRAConfig
from specrl_jax.speculative.inloop import InLoopState

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  """Everything a training run updates, as one pytree (sharded, checkpointed whole).

  rng holds raw key data (uint32), which checkpoints as a plain array; it is advanced
  once per step for stochastic objectives.
  With ``lora`` set, ``params`` are LoRA adapters and ``frozen_params`` the base policy
  they adapt (``rl.loop.lora``).
  params / drafter_params (and so their optimizer moments) are the master copies
  (``LearnerConfig.master_dtype``); ``compute_dtypes`` / ``drafter_compute_dtypes``
  record the dtypes the model computes in, one per leaf, when they differ (static:
  part of the state's structure, not checkpointed data). ``compute_params()`` is what
  the loss and the rollout read.
  controller: the in-loop draft-shape controller's carried state
  (``speculative.inloop.InLoopState``) when rollouts choose the shape per round
  (``SpecConfig(adaptive=True)``), so a resumed run chooses as the uninterrupted one.
  """
  step: Array
  params: Any
  opt_state: Any
  rng: Array
  ref_params: Any = None
  drafter_params: Any = None
  drafter_opt_state: Any = None
  frozen_params: Any = None
  controller: InLoopState | None = None
  compute_dtypes: precision.Dtypes | None = flax.struct.field(pytree_node=False,
                                                               default=None)
  drafter_compute_dtypes: precision.Dtypes | None = flax.struct.field(pytree_node=False,
                                                                       default=None)
  lora: LoRAConfig | None = flax.struct.field(pytree_node=False, default=None)

  def compute_params(self, params: Any = None) -> Any:
    """The policy weights the model computes with (``params``: a tree shaped like the
    state's, e.g. the one being differentiated; default the state's own): with LoRA
    the frozen base merged with the adapters ``params`` hold."""
    params = self.params if params is None else params
    if self.lora is not None:
      return lora.merge(self.frozen_params, params, self.lora)
    return precision.compute_copy(params, self.compute_dtypes)

  def compute_drafter_params(self, drafter_params: Any = None) -> Any:
    tree = self.drafter_params if drafter_params is None else drafter_params
    return precision.compute_copy(tree, self.drafter_compute_dtypes)


@flax.struct.dataclass
class Batch:
  """One training batch of B right-padded rows of prompt + response tokens.

  tokens: int32 [B, T]; response_mask: [B, T], true on response tokens (never at t=0);
  advantages: float32 [B];
  old_logprobs: float32 [B, T], the denominator of the ratio: the learner's own
    log-probs of the tokens (``rl.loop.learn_step`` sets them; None until then);
  ref_logprobs: optional float32 [B, T] reference log-probs (else computed from the
    state's ref_params when present);
  rollout_logprobs: optional float32 [B, T] the sampler's log-probs, for the truncated
    IS correction (GRPOConfig.tis_cap) and the training-inference mismatch metrics.
  A rollout's batch holds tokens, mask and rollout_logprobs; the learner fills in
  advantages and old_logprobs. The train step needs both.
  """
  tokens: Array
  response_mask: Array
  advantages: Array | None = None
  old_logprobs: Array | None = None
  ref_logprobs: Array | None = None
  rollout_logprobs: Array | None = None


DrafterLossFn = Callable[[Any, ForwardOutput, Batch], tuple[Array, Mapping[str, Array]]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterObjective:
  """How a drafter trains alongside the policy.

  loss_fn(drafter_params, policy_output, batch) -> (loss, metrics): policy_output is
    the policy's ForwardOutput with gradients stopped; its layer_hidden holds the
    layers named in ``hidden_layers``.
  The train step minimises policy loss + loss_weight * drafter loss. With several
  micro-batches the drafter loss and metrics are averaged over them, so a loss that
  is a mean over a micro-batch should divide by a per-row constant to stay exact.
  Drafter params are sharded by the same path rules (an "lm_head" leaf like the
  policy's, anything unmatched replicated).
  """

  loss_fn: DrafterLossFn
  hidden_layers: tuple[int, ...] = ()
  loss_weight: float = 1.0

  def __post_init__(self):
    owner = "DrafterObjective"
    check(callable(self.loss_fn), owner, "loss_fn", self.loss_fn,
          "a function (drafter_params, ForwardOutput, Batch) -> (loss, metrics)")
    check(isinstance(self.hidden_layers, tuple)
          and all(is_integer(i) and i >= 0 for i in self.hidden_layers),
          owner, "hidden_layers", self.hidden_layers, "a tuple of layer indices >= 0")
    check(self.loss_weight >= 0, owner, "loss_weight", self.loss_weight, ">= 0")
