"""The demo on the tiny preset: its speed checks are interleaved repeats reported as a
median with their spread and plotted, and nothing compiles after RL's first step (the
speed check after RL reuses the rollouts compiled before it, on the same layout).
(The speed-up itself is a measurement: `make demo` prints it; nothing here times.)"""

import os

from specrl_jax import demo
from specrl_jax.rl.app import experiment


def test_the_demo_compiles_nothing_after_rl_step_0_and_reports_medians_of_interleaved_repeats(
    tmp_path):
  config = experiment.experiment_config("tiny", [
      f"--output.directory={tmp_path / 'demo'}", "--output.plots=true",
      "--output.progress=false"])
  report = demo.run_demo(config, repeats=7)

  assert report["compiled_after_first_rl_step"] == 0
  for label in ("before RL", "after RL"):
    check = report["speed_checks"][label]
    assert check["repeats"] == 7 and len(check["speedups"]) == 7
    assert check["speedup_min"] <= check["speedup_quartiles"][0] <= check["speedup_median"]
    assert check["speedup_median"] <= check["speedup_quartiles"][1] <= check["speedup_max"]
    assert check["target_calls_speculative"] < check["target_calls_plain"]
  assert report["rollout_speedup_before_rl"] == report["speed_checks"]["before RL"][
      "speedup_median"]
  assert os.path.isfile(tmp_path / "demo" / "plots" / "rollout_speed.png")
  assert os.path.isfile(tmp_path / "demo" / "demo.json")
