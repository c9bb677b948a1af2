"""One RL step: generation, log-probs, training, drafter training and weight sync,
synchronous (stages take turns on the same GPUs) or asynchronous (rollout and training
pools run concurrently, the rollout working ``policy_lag`` steps ahead).

Speculation changes only generation (it is lossless: the same tokens, so the same
log-prob and training work), plus online drafter training and the drafter's weights
in the sync when those are enabled.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specrl_jax.config import check, check_finite_number, check_non_negative_int
from specrl_jax.sim import validation
from specrl_jax.sim.hardware import HardwareProfile
from specrl_jax.sim.layout import ParallelLayout
from specrl_jax.sim.model_spec import DrafterSpec, ModelSpec
from specrl_jax.sim.roofline import EngineProfile, SpeculationSpec
from specrl_jax.sim.rollout import RolloutResult, RolloutWorkload, simulate_rollout

# EAGLE-3's training-time test unrolls the drafter on its own outputs this many steps.
_DRAFTER_TRAINING_UNROLL = 7


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSpec:
  """The parts of an RL step outside the rollout engine.

  data_seconds / prepare_seconds: host-side stages (batch loading; switching the
  GPUs from training to generation) that no roofline models, taken as measured.
  logprob_mfu / train_mfu: achieved fraction of peak bf16 FLOP/s of the policy
  forward (log-probs of the rollout) and of forward + backward. online_drafter:
  train the drafter each step on the policy's hidden states (costs ~7 unrolled drafter
  steps per token at drafter_train_mfu) and sync its weights too.
  """

  mode: str = "sync"
  policy_lag: int = 0
  data_seconds: float = 0.0
  prepare_seconds: float = 0.0
  logprob_mfu: float = 0.3
  train_mfu: float = 0.3
  online_drafter: bool = False
  drafter_train_mfu: float = 0.1
  weight_bytes_per_param: float = 2.0  # what the trainer sends: bf16

  def __post_init__(self):
    owner = "StepSpec"
    validation.one_of(owner, "mode", self.mode, ("sync", "async"))
    check_non_negative_int(owner, "policy_lag", self.policy_lag)
    if self.mode == "sync":
      check(self.policy_lag == 0, owner, "policy_lag", self.policy_lag,
            "0 in sync mode (use mode='async' for a lag)")
    else:
      check(self.policy_lag >= 1, owner, "policy_lag", self.policy_lag,
            ">= 1 in async mode")
    check_finite_number(owner, "data_seconds", self.data_seconds, at_least=0)
    check_finite_number(owner, "prepare_seconds", self.prepare_seconds, at_least=0)
    validation.unit_interval(owner, "logprob_mfu", self.logprob_mfu, open_low=True)
    validation.unit_interval(owner, "train_mfu", self.train_mfu, open_low=True)
    check(isinstance(self.online_drafter, bool), owner, "online_drafter",
          self.online_drafter, "a bool")
    validation.unit_interval(owner, "drafter_train_mfu", self.drafter_train_mfu, open_low=True)
    check_finite_number(owner, "weight_bytes_per_param", self.weight_bytes_per_param, above=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimulationSetup:
  """Everything one simulated RL step depends on. ``speculation`` is the speculative
  configuration compared against plain decoding (None: plain only)."""

  name: str
  model: ModelSpec
  hardware: HardwareProfile
  engine: EngineProfile
  layout: ParallelLayout
  workload: RolloutWorkload
  step: StepSpec
  speculation: SpeculationSpec | None = None

  def __post_init__(self):
    owner = f"SimulationSetup({self.name!r})"
    check(self.step.mode == "sync" or not self.layout.colocated, owner, "step.mode",
          self.step.mode, "'sync' when rollout and training share GPUs (colocated)")

  def replace(self, **changes) -> "SimulationSetup":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBreakdown:
  """Seconds per RL step by stage. In async mode ``total`` is the steady-state step
  time: max(generation, training side) plus what cannot overlap."""

  data: float
  prepare: float
  weight_sync: float
  generation: float
  exposed_generation: float
  logprob: float
  training: float
  drafter_training: float
  total: float
  tokens: int
  rollout: RolloutResult

  def to_json(self) -> dict:
    out = dataclasses.asdict(self)
    out["rollout"] = self.rollout.to_json()
    return out


def _sequence_lengths(setup: SimulationSetup) -> np.ndarray:
  workload = setup.workload
  return workload.prompt_length + workload.lengths.sample(workload.num_sequences)


def _policy_flops(model: ModelSpec, lengths: np.ndarray) -> float:
  """Forward FLOPs over whole sequences: matmuls per token plus causal attention,
  2 * layers * heads * head_dim * S^2 per sequence of S tokens."""
  tokens = float(lengths.sum())
  attention = 2.0 * model.num_layers * model.num_heads * model.head_dim * float(
      (lengths.astype(np.float64)**2).sum())
  return model.forward_matmul_flops(tokens) + attention


def _weight_sync_seconds(setup: SimulationSetup, drafter: DrafterSpec | None) -> float:
  """Pushing new weights to every rollout instance.

  Colocated: a reshard copy in HBM. Separate pools: each rollout chip receives its
  shard over the scale-out network while the training chips send one copy per
  instance; the slower side sets the time.
  """
  layout, hardware = setup.layout, setup.hardware
  params = setup.model.total_params
  if drafter is not None and setup.step.online_drafter:
    params += drafter.params
  shard_bytes = params * setup.step.weight_bytes_per_param / layout.rollout_tp
  if layout.colocated:
    return shard_bytes / (hardware.hbm_bandwidth * setup.engine.memory_efficiency)
  receive = shard_bytes / hardware.scale_out_bandwidth
  send = (params * setup.step.weight_bytes_per_param * layout.rollout_instances
          / (layout.training_gpus * hardware.scale_out_bandwidth))
  return max(receive, send)


def simulate_step(setup: SimulationSetup, speculation: SpeculationSpec | None
                  ) -> StepBreakdown:
  """The step breakdown with ``speculation`` (None: plain decoding)."""
  step, hardware, layout = setup.step, setup.hardware, setup.layout
  rollout = simulate_rollout(target=setup.model, hardware=hardware, engine=setup.engine,
                             layout=layout, workload=setup.workload,
                             speculation=speculation,
                             batches_in_flight=max(1, step.policy_lag))
  lengths = _sequence_lengths(setup)
  training_flops_per_s = layout.training_gpus * hardware.peak_flops_bf16
  forward = _policy_flops(setup.model, lengths)
  logprob = forward / (training_flops_per_s * step.logprob_mfu)
  training = 3.0 * forward / (training_flops_per_s * step.train_mfu)
  drafter = speculation.drafter if speculation is not None else None
  drafter_training = 0.0
  if step.online_drafter and drafter is not None and drafter.step_network is not None:
    drafter_forward = _DRAFTER_TRAINING_UNROLL * drafter.step_network.forward_matmul_flops(
        float(lengths.sum()))
    drafter_training = 3.0 * drafter_forward / (training_flops_per_s
                                                * step.drafter_train_mfu)
  sync = _weight_sync_seconds(setup, drafter)
  generation = rollout.seconds
  if step.mode == "sync":
    exposed = generation
    total = (step.data_seconds + step.prepare_seconds + sync + generation + logprob
             + training + drafter_training)
  else:
    training_side = step.data_seconds + logprob + training + drafter_training
    exposed = max(0.0, generation - training_side)
    total = step.prepare_seconds + sync + training_side + exposed
  return StepBreakdown(data=step.data_seconds, prepare=step.prepare_seconds,
                       weight_sync=sync, generation=generation, exposed_generation=exposed,
                       logprob=logprob, training=training,
                       drafter_training=drafter_training, total=total,
                       tokens=int(lengths.sum()), rollout=rollout)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
  """Plain decoding against the setup's speculative configuration."""

  setup_name: str
  plain: StepBreakdown
  speculative: StepBreakdown | None

  @property
  def generation_speedup(self) -> float | None:
    if self.speculative is None:
      return None
    return self.plain.generation / self.speculative.generation

  @property
  def step_speedup(self) -> float | None:
    if self.speculative is None:
      return None
    return self.plain.total / self.speculative.total

  def to_json(self) -> dict:
    return {
        "setup": self.setup_name,
        "plain": self.plain.to_json(),
        "speculative": None if self.speculative is None else self.speculative.to_json(),
        "generation_speedup": self.generation_speedup,
        "step_speedup": self.step_speedup,
    }


def simulate(setup: SimulationSetup) -> Comparison:
  plain = simulate_step(setup, None)
  speculative = (None if setup.speculation is None
                 else simulate_step(setup, setup.speculation))
  return Comparison(setup_name=setup.name, plain=plain, speculative=speculative)
