"""An analytical, roofline-based performance model of one RL step with speculative
rollouts: hardware profiles, model specs, parallel layouts, response-length
distributions, continuous-batching rollouts, sync/async steps, the paper's presets,
and the cost model an adaptive speculative engine uses to choose its draft length."""

from specrl_jax.sim.cost_model import (LinearCallCost, MeasuredCallCost, RooflineCallCost,
                                       SpeculationCostModel, conditional_acceptance)
from specrl_jax.sim.hardware import (HARDWARE, HardwareProfile, calibrate_cpu, get_hardware,
                                     measure_cpu)
from specrl_jax.sim.layout import ParallelLayout
from specrl_jax.sim.lengths import FixedLengths, HistogramLengths, LogNormalLengths
from specrl_jax.sim.model_spec import (DRAFTER_SPECS, MODELS, DrafterSpec, ModelSpec,
                                       draft_model_drafter, drafter_spec, eagle3_drafter,
                                       get_model, history_drafter, mtp_drafter, ngram_drafter,
                                       register_drafter_spec)
from specrl_jax.sim.presets import PAPER_FIGURES, PRESETS, calibrate_paper_8b, get_preset
from specrl_jax.sim.report import breakdown_table, comparison_json, speedup_grid, write_heatmap
from specrl_jax.sim.roofline import (EngineProfile, ForwardCostModel, SpeculationSpec,
                                     acceptance_from_length, expected_tokens_per_round)
from specrl_jax.sim.rollout import RolloutResult, RolloutWorkload, simulate_rollout
from specrl_jax.sim.step import (Comparison, SimulationSetup, StepBreakdown, StepSpec,
                                 simulate, simulate_step)

__all__ = [
    "DRAFTER_SPECS", "HARDWARE", "MODELS", "PAPER_FIGURES", "PRESETS", "Comparison", "DrafterSpec",
    "EngineProfile", "FixedLengths", "ForwardCostModel", "HardwareProfile",
    "HistogramLengths", "LinearCallCost", "LogNormalLengths", "MeasuredCallCost", "ModelSpec",
    "ParallelLayout", "RolloutResult", "RolloutWorkload", "RooflineCallCost",
    "SimulationSetup", "SpeculationCostModel", "SpeculationSpec", "StepBreakdown",
    "StepSpec", "acceptance_from_length", "breakdown_table", "calibrate_cpu",
    "calibrate_paper_8b", "comparison_json", "conditional_acceptance",
    "draft_model_drafter", "drafter_spec", "eagle3_drafter", "expected_tokens_per_round", "get_hardware",
    "get_model", "get_preset", "history_drafter", "measure_cpu", "mtp_drafter",
    "ngram_drafter", "register_drafter_spec",
    "simulate", "simulate_rollout", "simulate_step", "speedup_grid", "write_heatmap",
]
