"""Specification of the performance simulator (specrl_jax.sim).

1. It reproduces the paper from assumptions calibrated on plain decoding only.
2. Its pieces obey the physics they claim (closed-form sums, monotone trends, limits).
3. Bad parameters fail at construction with a message naming field, value and range.
4. The CLI and the heatmap produce what they promise.
5. The cost model an adaptive engine uses never picks a k it predicts slower than
   plain decoding.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

from specrl_jax.config import ConfigError, ModelConfig
from specrl_jax.sim import (HARDWARE, MODELS, PAPER_FIGURES, EngineProfile, FixedLengths,
                            HistogramLengths, LinearCallCost, LogNormalLengths,
                            MeasuredCallCost, ModelSpec, ParallelLayout, RolloutWorkload,
                            RooflineCallCost,
                            SimulationSetup, SpeculationCostModel, SpeculationSpec, StepSpec,
                            acceptance_from_length, calibrate_paper_8b,
                            conditional_acceptance, eagle3_drafter,
                            expected_tokens_per_round, get_hardware, get_preset, ngram_drafter,
                            simulate, simulate_rollout, simulate_step, speedup_grid,
                            write_heatmap)
from specrl_jax.sim.command import main as simulate_main
from specrl_jax.sim.presets import PAPER_8B_CALIBRATION, paper_8b_setups, with_speculation
from specrl_jax.sim.roofline import LinearCost

PAPER_8B = ("paper-8b-rl-zero", "paper-8b-rl-think")


def relative_error(value, reference):
  return abs(value - reference) / reference


@pytest.fixture(scope="module")
def paper_results():
  return {name: simulate(get_preset(name)) for name in (*PAPER_8B, "paper-235b-async")}


# --- 1. The paper -------------------------------------------------------------------

def test_preset_calibration_is_what_the_procedure_gives_from_plain_figures():
  calibrated = calibrate_paper_8b()
  for key, stored in PAPER_8B_CALIBRATION.items():
    assert relative_error(calibrated[key], stored) < 0.01, (key, calibrated[key], stored)


@pytest.mark.parametrize("zero_median, overhead_ms, speedup", [(1500.0, 2.4, 1.45),
                                                               (3000.0, 0.6, 2.33)])
def test_the_documented_sensitivity_to_the_assumed_rl_zero_lengths(zero_median, overhead_ms,
                                                                   speedup):
  calibration = calibrate_paper_8b(zero_median_response=zero_median)
  assert calibration["forward_overhead_s"] * 1e3 == pytest.approx(overhead_ms, abs=0.05)
  result = simulate(paper_8b_setups(calibration)["paper-8b-rl-zero"])
  assert result.generation_speedup == pytest.approx(speedup, abs=0.01)


@pytest.mark.parametrize("name", PAPER_8B)
def test_8b_plain_stage_times_match_the_paper(paper_results, name):
  plain, paper = paper_results[name].plain, PAPER_FIGURES[name]["plain"]
  for stage in ("generation", "logprob", "training", "total"):
    assert relative_error(getattr(plain, stage), paper[stage]) < 0.01, stage


@pytest.mark.parametrize("name", PAPER_8B)
def test_8b_eagle3_k3_generation_speedup_within_15_percent(paper_results, name):
  speedup = paper_results[name].generation_speedup
  assert relative_error(speedup, PAPER_FIGURES[name]["generation_speedup"]) < 0.15, speedup


@pytest.mark.parametrize("name", PAPER_8B)
def test_8b_eagle3_k3_end_to_end_speedup_within_10_percent(paper_results, name):
  speedup = paper_results[name].step_speedup
  assert relative_error(speedup, PAPER_FIGURES[name]["step_speedup"]) < 0.10, speedup


@pytest.mark.parametrize("name", PAPER_8B)
def test_8b_speculation_leaves_logprob_and_training_unchanged(paper_results, name):
  result = paper_results[name]
  assert result.speculative.logprob == result.plain.logprob
  assert result.speculative.training == result.plain.training
  assert result.speculative.tokens == result.plain.tokens


@pytest.mark.parametrize("name", PAPER_8B)
def test_8b_longer_drafts_with_the_papers_acceptance_are_slower(name):
  """The paper's lesson: k = 5 and 7 raise acceptance but lose speed (the model
  reproduces the direction; see the report for the magnitudes)."""
  setup = get_preset(name)
  speedups = []
  for k, (acceptance_length, _) in sorted(PAPER_FIGURES[name]["k_sweep"].items()):
    spec = SpeculationSpec.from_acceptance_length(
        drafter=setup.speculation.drafter, num_draft_tokens=k,
        acceptance_length=acceptance_length)
    speedups.append(simulate(setup.replace(speculation=spec)).generation_speedup)
  assert speedups[0] > speedups[1] > speedups[2], speedups


def test_235b_async_envelope_within_20_percent(paper_results):
  result, paper = paper_results["paper-235b-async"], PAPER_FIGURES["paper-235b-async"]
  assert relative_error(result.generation_speedup, paper["generation_speedup"]) < 0.20
  assert relative_error(result.step_speedup, paper["step_speedup"]) < 0.20


def test_235b_with_the_8b_engine_overheads_keeps_far_less_of_the_envelope(paper_results):
  setup = get_preset("paper-235b-async")
  overhead = PAPER_8B_CALIBRATION["forward_overhead_s"]
  engine = dataclasses.replace(setup.engine, forward_overhead_s=overhead,
                               draft_step_overhead_s=overhead)
  measured_like = simulate(setup.replace(engine=engine))
  assert 1.0 < measured_like.generation_speedup < 0.6 * paper_results[
      "paper-235b-async"].generation_speedup


# --- 2. Physics ---------------------------------------------------------------------

@pytest.mark.parametrize("coefficients", [
    (0.5, 1.0, 0.01, 0.2, 0.03),  # lines cross inside the range
    (0.0, 2.0, 0.0, 1.0, 0.0),  # parallel, compute dominates
    (0.1, 0.0, 0.05, 3.0, 0.0),  # memory dominates, then compute overtakes
    (0.0, 5.0, 0.0, 1.0, 0.1),  # memory overtakes compute
])
def test_linear_cost_closed_form_sum_equals_the_loop(coefficients):
  cost = LinearCost(*coefficients)
  for context0, step, n in ((0.0, 1.0, 1), (10.0, 3.0, 57), (2.5, 0.25, 400)):
    brute = sum(cost.at(context0 + j * step) for j in range(n))
    assert cost.sum_over(context0, step, n) == pytest.approx(brute, rel=1e-9)


@pytest.mark.parametrize("depth", [1, 3, 7])
def test_acceptance_length_round_trips_through_iid_rates(depth):
  for rate in (0.0, 0.3, 0.8, 1.0):
    expected = sum(rate**i for i in range(depth + 1))
    assert expected_tokens_per_round((rate,), depth) == pytest.approx(expected)
  for length in (1.0, 1.5, (depth + 2) / 2, depth + 1.0):
    rates = acceptance_from_length(length, depth)
    assert expected_tokens_per_round(rates, depth) == pytest.approx(length, abs=1e-6)


def test_model_specs_have_the_published_parameter_counts():
  assert MODELS["qwen3-8b"].total_params == pytest.approx(8.19e9, rel=0.01)
  assert MODELS["qwen3-32b"].total_params == pytest.approx(32.8e9, rel=0.01)
  assert MODELS["llama-3.1-70b"].total_params == pytest.approx(70.6e9, rel=0.01)
  moe = MODELS["qwen3-235b-a22b"]
  assert moe.total_params == pytest.approx(235e9, rel=0.01)
  assert moe.active_params == pytest.approx(22e9, rel=0.02)


def test_model_spec_from_model_config_counts_what_the_config_counts():
  config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)
  spec = ModelSpec.from_model_config(config)
  norms = 2 * config.num_layers * (config.hidden_size + config.head_dim) + config.hidden_size
  assert spec.total_params == config.num_params() - norms


def test_moe_weights_read_grow_with_tokens_up_to_all_experts():
  moe = MODELS["qwen3-235b-a22b"]
  reads = [moe.weights_read(n) for n in (1, 8, 64, 256, 10**6)]
  assert all(b > a for a, b in zip(reads, reads[1:]))
  assert reads[0] == pytest.approx(moe.active_matmul_params, rel=1e-6)
  assert reads[-1] == pytest.approx(moe.total_params - moe.embedding_params, rel=1e-6)


def _small_setup(**workload_changes) -> SimulationSetup:
  model = MODELS["qwen3-8b"]
  workload = dict(num_sequences=256, prompt_length=128,
                  lengths=LogNormalLengths(median=500.0, sigma=0.8, max_length=4096))
  workload.update(workload_changes)
  return SimulationSetup(
      name="small", model=model, hardware=HARDWARE["h100"],
      engine=EngineProfile(forward_overhead_s=1e-3, draft_step_overhead_s=3e-4),
      layout=ParallelLayout.colocate(8), workload=RolloutWorkload(**workload),
      step=StepSpec(),
      speculation=SpeculationSpec(drafter=eagle3_drafter(model), num_draft_tokens=3,
                                  acceptance=(0.8,)))


def _generation(setup, speculation=None):
  return simulate_rollout(target=setup.model, hardware=setup.hardware, engine=setup.engine,
                          layout=setup.layout, workload=setup.workload,
                          speculation=speculation)


def test_rollout_generates_every_token_of_its_instance():
  setup = _small_setup()
  for speculation in (None, setup.speculation):
    result = _generation(setup, speculation)
    per_round = 1.0 if speculation is None else speculation.tokens_per_round
    assert result.instance_sequences == 256 // 8
    assert result.rounds >= setup.workload.lengths.max_length / per_round - 1
    assert result.mean_live_batch * result.rounds * per_round >= (
        result.instance_generated_tokens - 1e-6)


def test_generation_time_grows_with_work_and_shrinks_with_gpus():
  base = _small_setup()
  more_sequences = _small_setup(num_sequences=1024)
  longer = _small_setup(lengths=LogNormalLengths(median=1000.0, sigma=0.8, max_length=8192))
  more_gpus = base.replace(layout=ParallelLayout.colocate(32))
  t = _generation(base).seconds
  assert _generation(more_sequences).seconds > t
  assert _generation(longer).seconds > t
  assert _generation(more_gpus).seconds < t


def test_speedup_grows_with_acceptance_and_draft_overhead_costs_speed():
  setup = _small_setup()
  plain = _generation(setup).seconds
  speedups = [plain / _generation(setup, dataclasses.replace(setup.speculation,
                                                             acceptance=(a,))).seconds
              for a in (0.05, 0.5, 0.8, 0.95)]
  assert all(b > a for a, b in zip(speedups, speedups[1:]))
  assert speedups[0] < 1.0  # a drafter that is almost never right is pure overhead


def test_free_drafter_at_batch_one_gives_the_acceptance_length():
  """Memory-bound decode of one sequence: verifying k + 1 tokens costs what one does,
  so with a free drafter the speedup is the tokens emitted per round."""
  setup = _small_setup(num_sequences=1, lengths=FixedLengths(length=512))
  engine = dataclasses.replace(setup.engine, forward_overhead_s=0.0,
                               draft_step_overhead_s=0.0, layer_overhead_s=0.0)
  setup = setup.replace(engine=engine, layout=ParallelLayout.colocate(1))
  free = dataclasses.replace(setup.speculation, drafter=ngram_drafter(host_seconds_per_round=0))
  speedup = _generation(setup).decode_seconds / _generation(setup, free).decode_seconds
  assert speedup == pytest.approx(free.tokens_per_round, rel=0.05)


def test_at_large_compute_bound_batches_long_drafts_lose_to_plain_decoding():
  setup = _small_setup(num_sequences=8 * 1024, lengths=FixedLengths(length=64))
  plain = _generation(setup).seconds
  short = _generation(setup, setup.speculation).seconds
  long = _generation(setup, dataclasses.replace(setup.speculation, num_draft_tokens=8,
                                                acceptance=(0.6,))).seconds
  assert long > short
  assert long > plain


def test_tree_rounds_verify_every_node_and_cost_more_than_a_chain_of_the_same_depth():
  setup = _small_setup()
  chain = dataclasses.replace(setup.speculation, num_draft_tokens=3,
                              acceptance=(0.9, 0.8, 0.7))
  tree = dataclasses.replace(chain, tree=(3, 2, 1))
  assert tree.verify_tokens == 1 + 3 + 6 + 6
  assert tree.draft_tokens_per_step == (1, 3, 6)
  assert tree.tokens_per_round == chain.tokens_per_round == pytest.approx(
      1 + 0.9 + 0.9 * 0.8 + 0.9 * 0.8 * 0.7)
  assert _generation(setup, tree).seconds > _generation(setup, chain).seconds


def test_static_batching_is_never_faster_than_continuous():
  for lengths in (LogNormalLengths(median=500.0, sigma=1.0, max_length=4096),
                  FixedLengths(length=300)):
    continuous = _generation(_small_setup(lengths=lengths)).seconds
    static = _generation(_small_setup(lengths=lengths, batching="static")).seconds
    assert static >= continuous * 0.999


def test_small_kv_cache_preempts_and_slows_generation():
  setup = _small_setup(num_sequences=2048,
                       lengths=LogNormalLengths(median=2000.0, sigma=0.5, max_length=8192))
  roomy = _generation(setup)
  tight = _generation(setup.replace(engine=dataclasses.replace(setup.engine,
                                                               memory_utilization=0.25)))
  assert roomy.kv_capacity_tokens > tight.kv_capacity_tokens
  assert tight.preemptions > 0
  assert tight.seconds > roomy.seconds


def test_histogram_lengths_follow_the_measured_sample():
  measured = np.random.default_rng(0).lognormal(np.log(300), 0.7, size=5000).astype(int) + 1
  histogram = HistogramLengths.from_lengths(measured.tolist(), num_bins=40)
  assert histogram.mean() == pytest.approx(measured.mean(), rel=0.03)
  assert histogram.max_length == measured.max()
  assert np.all(np.diff(histogram.sample(100)) >= 0)


def test_async_overlaps_generation_with_training_and_lag_hides_the_tail():
  setup = _small_setup()
  layout = ParallelLayout.split(rollout_gpus=6, training_gpus=2)
  lag1 = simulate_step(setup.replace(layout=layout, step=StepSpec(mode="async",
                                                                   policy_lag=1)), None)
  lag2 = simulate_step(setup.replace(layout=layout, step=StepSpec(mode="async",
                                                                   policy_lag=2)), None)
  sync = simulate_step(setup.replace(layout=layout), None)
  training_side = lag1.data + lag1.logprob + lag1.training + lag1.drafter_training
  assert lag1.exposed_generation == pytest.approx(max(0.0, lag1.generation - training_side))
  assert lag1.total == pytest.approx(lag1.prepare + lag1.weight_sync
                                     + max(lag1.generation, training_side))
  assert lag1.total < sync.total
  assert lag2.generation <= lag1.generation
  assert lag1.weight_sync > simulate_step(setup, None).weight_sync  # network vs HBM copy


def test_online_drafter_training_adds_a_stage_only_with_speculation():
  setup = _small_setup()
  setup = setup.replace(step=dataclasses.replace(setup.step, online_drafter=True))
  result = simulate(setup)
  assert result.plain.drafter_training == 0.0
  assert result.speculative.drafter_training > 0.0


# --- 3. Bad parameters --------------------------------------------------------------

@pytest.mark.parametrize("build, message", [
    (lambda: dataclasses.replace(MODELS["qwen3-8b"], hidden_size=-4096),
     r"hidden_size=-4096 .*positive integer"),
    (lambda: RolloutWorkload(num_sequences=-1, prompt_length=8,
                             lengths=FixedLengths(length=8)),
     r"num_sequences=-1"),
    (lambda: LogNormalLengths(median=-5.0, sigma=1.0, max_length=100), r"median=-5.0"),
    (lambda: SpeculationSpec(drafter=ngram_drafter(), num_draft_tokens=3,
                             acceptance=(0.9, 1.5)),
     r"acceptance\[1\]=1.5 .*\[0, 1\]"),
    (lambda: SpeculationSpec(drafter=ngram_drafter(), num_draft_tokens=3,
                             acceptance=(-0.1,)),
     r"acceptance\[0\]=-0.1"),
    (lambda: ParallelLayout(total_gpus=8, rollout_gpus=16, training_gpus=8,
                            colocated=False),
     r"rollout_gpus=16 .*more GPUs for rollout than exist"),
    (lambda: ParallelLayout.split(rollout_gpus=6, training_gpus=2, rollout_tp=4),
     r"rollout_tp=4 .*divisor of rollout_gpus=6"),
    (lambda: EngineProfile(compute_efficiency=1.5), r"compute_efficiency=1.5 .*\(0, 1\]"),
    (lambda: StepSpec(mode="sync", policy_lag=2), r"policy_lag=2"),
    (lambda: acceptance_from_length(5.0, 3), r"acceptance_length=5.0 .*\[1, depth \+ 1"),
    (lambda: get_hardware("a100"), r"hardware='a100'"),
])
def test_bad_parameters_raise_clear_errors(build, message):
  with pytest.raises(ConfigError, match=message):
    build()


def test_a_model_that_does_not_fit_says_so():
  setup = _small_setup()
  setup = setup.replace(model=MODELS["qwen3-235b-a22b"], layout=ParallelLayout.colocate(8))
  with pytest.raises(ConfigError, match="does not fit"):
    _generation(setup)


def test_async_on_colocated_gpus_is_rejected():
  with pytest.raises(ConfigError, match="step.mode='async'"):
    _small_setup().replace(step=StepSpec(mode="async", policy_lag=1))


# --- 4. Output ----------------------------------------------------------------------

def test_heatmap_png_is_written_and_speedup_rises_with_acceptance(tmp_path):
  setup = _small_setup()
  grid = speedup_grid(setup, draft_lengths=(1, 4), acceptance_rates=(0.3, 0.9))
  assert grid.generation.shape == grid.step.shape == (2, 2)
  assert np.all(grid.generation[:, 1] > grid.generation[:, 0])
  path = write_heatmap(grid, tmp_path / "heat" / "map.png", title="small")
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("preset", ["paper-8b-rl-zero", "paper-8b-rl-think",
                                    "paper-235b-async"])
def test_cli_presets_print_json_with_the_simulated_speedups(capsys, preset):
  assert simulate_main(["--preset", preset, "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  expected = simulate(get_preset(preset))
  assert out["generation_speedup"] == pytest.approx(expected.generation_speedup)
  assert out["step_speedup"] == pytest.approx(expected.step_speedup)
  assert out["paper"]["generation_speedup"] == PAPER_FIGURES[preset]["generation_speedup"]
  assert out["assumptions"]["model"]["name"] == get_preset(preset).model.name


def test_cli_free_parameters_override_the_preset(capsys):
  assert simulate_main(["--preset", "paper-8b-rl-zero", "--json", "--k", "5",
                        "--acceptance-length", "4.35", "--hardware", "h100"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["speculative"]["rollout"]["tokens_per_round"] == pytest.approx(4.35, abs=1e-4)
  assert out["assumptions"]["hardware"]["name"] == "h100"
  assert "paper" not in out  # overridden setups are not the paper's


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "16", "--rollout-gpus", "32"], "more GPUs for rollout than exist"),
    (["--acceptance", "0.9,1.2"], "acceptance[1]=1.2"),
    (["--sequences", "-3"], "num_sequences=-3"),
])
def test_cli_bad_parameters_exit_2_with_the_reason(capsys, argv, message):
  assert simulate_main(argv) == 2
  assert message in capsys.readouterr().err


def test_cli_calibrate_writes_a_loadable_cpu_profile(capsys, tmp_path):
  path = tmp_path / "cpu.json"
  assert simulate_main(["--calibrate", "--output", str(path)]) == 0
  profile = get_hardware(str(path))
  assert profile.peak_flops("fp32") > 1e8
  assert profile.hbm_bandwidth > 1e8
  assert json.loads(capsys.readouterr().out)["written"] == str(path)


# --- 5. Cost model for adaptive speculation ----------------------------------------

def _memory_bound_engine_costs() -> SpeculationCostModel:
  """A target whose forward costs a fixed 10 ms plus 0.05 ms per token (weights
  dominate until ~200 tokens) and a drafter step of 0.5 ms."""
  return SpeculationCostModel(
      target=LinearCallCost(overhead_s=10e-3, per_token_s=5e-5),
      drafter=LinearCallCost(overhead_s=5e-4, per_token_s=1e-6))


def test_best_k_is_off_when_acceptance_is_low_and_on_when_high():
  model = _memory_bound_engine_costs()
  assert model.best_k(8, [0.02], k_max=8) == 0
  assert model.best_k(8, [0.9, 0.85, 0.8], k_max=8) > 0


def test_best_k_is_off_when_verification_costs_a_forward_per_token():
  compute_bound = SpeculationCostModel(target=LinearCallCost(overhead_s=0.0, per_token_s=1e-3),
                                       drafter=LinearCallCost(overhead_s=1e-4, per_token_s=0.0))
  assert compute_bound.best_k(64, [0.95], k_max=8) == 0


def test_best_k_never_predicts_speculation_slower_than_plain():
  model = _memory_bound_engine_costs()
  for batch in (1, 4, 16, 64, 256, 1024):
    for rates in ([0.1], [0.5], [0.7, 0.6], [0.95, 0.9, 0.85, 0.8]):
      k = model.best_k(batch, rates, k_max=8)
      chosen = model.expected_tokens_per_second(batch, k, rates)
      for other in range(9):
        assert chosen >= model.expected_tokens_per_second(batch, other, rates) - 1e-9


def test_best_k_shrinks_as_the_batch_grows():
  model = _memory_bound_engine_costs()
  ks = [model.best_k(batch, [0.8], k_max=8) for batch in (1, 32, 256, 2048)]
  assert all(b <= a for a, b in zip(ks, ks[1:])) and ks[0] > ks[-1]


def test_min_gain_requires_a_margin_before_switching_on():
  model = _memory_bound_engine_costs()
  rates = [0.3]
  k = model.best_k(8, rates, k_max=8)
  gain = (model.expected_tokens_per_second(8, k, rates)
          / model.expected_tokens_per_second(8, 0, rates))
  assert k > 0 and gain > 1
  assert model.best_k(8, rates, k_max=8, min_gain=gain * 1.01) == 0


def test_linear_call_cost_fit_recovers_measured_coefficients():
  truth = LinearCallCost(overhead_s=2e-3, per_token_s=3e-5, per_sequence_s=1e-4)
  points = [(b, q, truth.seconds(b, q)) for b in (1, 4, 16) for q in (1, 4)]
  fitted = LinearCallCost.fit(points)
  for field in ("overhead_s", "per_token_s", "per_sequence_s"):
    assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6)
  model = SpeculationCostModel.from_measurements(target_points=points,
                                                 drafter_points=[(1, 1, 1e-4), (8, 1, 2e-4)])
  assert model.round_seconds(4, 2) == pytest.approx(
      2 * model.drafter.seconds(4, 1) + truth.seconds(4, 3))


def test_measured_call_cost_is_exact_at_measured_token_counts_and_linear_between():
  # A CPU-like kink: one row runs a matrix-vector kernel, two rows a matrix-matrix one.
  points = [(1, 1, 6.6e-3), (2, 1, 8.4e-3), (1, 2, 8.2e-3), (4, 1, 8.1e-3), (4, 4, 16e-3)]
  cost = MeasuredCallCost.fit(points)
  assert cost.tokens == (1, 2, 4, 16)
  assert cost.seconds(1, 1) == pytest.approx(6.6e-3)
  assert cost.seconds(2, 1) == cost.seconds(1, 2) == pytest.approx(8.3e-3)  # averaged
  assert cost.seconds(2, 5) == pytest.approx(8.1e-3 + 6 / 12 * 7.9e-3)
  assert cost.seconds(8, 4) == pytest.approx(16e-3 + 16 * 7.9e-3 / 12)  # last segment
  engine = dataclasses.replace(cost, overhead_s=1e-3, per_sequence_s=1e-4)
  assert engine.seconds(4, 1) == pytest.approx(1e-3 + 4e-4 + 8.1e-3)
  with pytest.raises(ValueError, match="strictly increasing"):
    MeasuredCallCost(tokens=(2, 1), seconds_at=(1e-3, 2e-3))
  with pytest.raises(ValueError, match="seconds_at"):
    MeasuredCallCost(tokens=(1, 2), seconds_at=(1e-3, -2e-3))
  with pytest.raises(ValueError, match="seconds > 0"):
    MeasuredCallCost.fit([(1, 1, 0.0)])


def test_roofline_call_cost_fit_recovers_overhead_and_efficiency():
  cpu = dataclasses.replace(HARDWARE["h100"], name="cpu-like", peak_flops_fp32=5e10,
                            hbm_bandwidth=1e10)
  spec = ModelSpec.from_model_config(ModelConfig(
      vocab_size=32000, hidden_size=256, intermediate_size=704, num_layers=4,
      num_heads=4, num_kv_heads=2, head_dim=64))
  truth = RooflineCallCost(network=spec, hardware=cpu, context_tokens=128,
                           overhead_s=3e-4, scale=2.5)
  points = [(b, q, truth.seconds(b, q)) for b in (1, 8, 64) for q in (1, 4)]
  fitted = RooflineCallCost.fit(points, network=spec, hardware=cpu, context_tokens=128)
  assert fitted.overhead_s == pytest.approx(3e-4, rel=1e-6)
  assert fitted.scale == pytest.approx(2.5, rel=1e-6)
  # The roofline keeps the kink: small batches are memory-bound (flat in tokens).
  assert truth.roofline_seconds(1, 4) == pytest.approx(truth.roofline_seconds(1, 1), rel=0.05)
  assert truth.roofline_seconds(64, 4) > 2 * truth.roofline_seconds(64, 1)


def test_seconds_per_token_is_round_time_over_tokens_per_round():
  model = _memory_bound_engine_costs()
  assert model.seconds_per_token(16, 0, [0.8]) == pytest.approx(model.round_seconds(16, 0))
  assert model.seconds_per_token(16, 3, [0.8]) == pytest.approx(
      model.round_seconds(16, 3) / (1 + 0.8 + 0.64 + 0.512))


def test_conditional_acceptance_undoes_the_running_product():
  assert conditional_acceptance([0.8, 0.56, 0.28]) == pytest.approx((0.8, 0.7, 0.5))
  with pytest.raises(ConfigError, match="non-increasing"):
    conditional_acceptance([0.5, 0.6])


@pytest.mark.parametrize("rates, message", [([1.2], r"per_position_acceptance\[0\]=1.2"),
                                            ([], "non-empty")])
def test_cost_model_rejects_bad_acceptance(rates, message):
  with pytest.raises(ConfigError, match=message):
    _memory_bound_engine_costs().best_k(8, rates, k_max=4)


def test_with_speculation_changes_only_the_draft():
  setup = get_preset("paper-8b-rl-zero")
  changed = with_speculation(setup, num_draft_tokens=5)
  assert changed.speculation.num_draft_tokens == 5
  assert changed.replace(speculation=setup.speculation) == setup
  assert math.isclose(changed.speculation.acceptance[0], setup.speculation.acceptance[0])


def test_a_batch_decodes_until_its_slowest_sequence_has_its_tokens():
  from specrl_jax.sim.cost_model import expected_batch_rounds
  assert expected_batch_rounds(8, 0, [0.5], 40) == 40  # plain: one token per round
  assert expected_batch_rounds(8, 3, [1.0], 40) == 10  # every draft accepted
  assert expected_batch_rounds(8, 3, [0.0], 40) == 40  # none accepted
  one = expected_batch_rounds(1, 3, [0.7], 40)
  # One sequence needs about new_tokens / tokens-per-round rounds; a batch waits for
  # the unluckiest of its sequences.
  assert one == pytest.approx(40 / (1 + 0.7 + 0.49 + 0.343), rel=0.05)
  assert expected_batch_rounds(8, 3, [0.7], 40) > one + 1
  with pytest.raises(ConfigError, match="new_tokens"):
    expected_batch_rounds(8, 3, [0.7], 0)


def simulated_rounds_to_finish(remaining, k, acceptance, samples=20_000, seed=0):
  """Monte Carlo reference: batches of sequences drafting k tokens per round, drafts
  accepted in order at the conditional rates, until each has its remaining tokens."""
  rng = np.random.default_rng(seed)
  remaining = np.asarray(remaining)
  rates = np.array([acceptance[min(i, len(acceptance) - 1)] for i in range(k)])
  emitted = np.zeros((samples, remaining.size), np.int64)
  rounds = np.zeros((samples, remaining.size), np.int64)
  while (emitted < remaining).any():
    live = emitted < remaining
    accepted = np.cumprod(rng.random((samples, remaining.size, k)) < rates, axis=-1).sum(-1)
    emitted += live * (1 + accepted)
    rounds += live
  return rounds.max(axis=1).mean()


@pytest.mark.parametrize("remaining, k, acceptance", [
    ([38] * 8, 3, [0.97, 0.94, 0.89]),
    ([38] * 8, 5, [0.97, 0.95, 0.86, 0.85, 0.83]),
    ([40, 12, 3, 1], 4, [0.6]),
    ([7], 2, [0.5, 0.2]),
])
def test_rounds_to_finish_are_exact_where_a_simulation_only_estimates_them(remaining, k,
                                                                           acceptance):
  from specrl_jax.sim.cost_model import expected_rounds_to_finish
  exact = expected_rounds_to_finish(remaining, k, acceptance)
  assert exact == pytest.approx(simulated_rounds_to_finish(remaining, k, acceptance),
                                rel=0.01)


def test_rounds_to_finish_edge_cases():
  from specrl_jax.sim.cost_model import expected_rounds_to_finish
  assert expected_rounds_to_finish([], 3, [0.5]) == 0.0  # nothing left to decode
  assert expected_rounds_to_finish([0, 0], 3, [0.5]) == 0.0
  assert expected_rounds_to_finish([9, 4], 0, [0.5]) == 9  # plain: a token per round
  assert expected_rounds_to_finish([9], 2, [1.0]) == 3  # every draft accepted
  with pytest.raises(ConfigError, match="remaining_tokens"):
    expected_rounds_to_finish([5, -1], 2, [0.5])
