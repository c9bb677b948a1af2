"""``make demo``: GRPO with speculative rollouts, end to end, on two CPU cores.

1. Warm start: SFT an 11.5M-parameter policy on worked 1-2 digit additions until it is
   right about half of the time, and distil a 128-wide one-layer draft model from it.
   The sizes are chosen so that speculation can pay on a CPU: the policy's weights do
   not fit in cache, and 4 slots keep a verification's rows few enough that its cost is
   reading them (``rl.app.experiment``'s demo preset says more).
2. Rollout speed, plain vs speculative, measured side by side on the same prompts
   and weights (same engine shape, sampling, seeds), before and after RL.
3. A short GRPO run whose rollouts are speculative (the draft model keeps training
   online on every batch), printing reward and acceptance length as it goes.
Each phase shows a progress bar on stderr (compilation is named as it happens).
Metrics, TensorBoard events, checkpoints and PNG plots land in runs/demo/: the RL
curves (reward, response length, acceptance length against plain decoding's 1, step
time and throughput from step 1 on) and rollout_speed.png (plain vs speculative
rollout time of every repeat, and the per-repeat speed-up with its median and quartiles);
demo.json holds every figure. Nothing compiles after RL's first step: the speed check
after RL reuses the rollouts compiled before it (the weights keep the train mesh's
layout throughout), and the demo prints the count to show it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence

from specrl_jax.compile_cache import CompileCounter, cache_directory, persistent_cache
from specrl_jax.rl.app.experiment import ExperimentConfig, experiment_config
from specrl_jax.rl.app.metrics import read_jsonl
from specrl_jax.rl.app.rollout_speed import RolloutArms, plot_speed_checks
from specrl_jax.rl.app.session import Session
from specrl_jax.rl.loop.rollout import rollout_drafter_params


SPEED_REPEATS = 9  # interleaved pairs per speed check: the median of 9 ratios


def run_demo(config: ExperimentConfig, *, repeats: int = SPEED_REPEATS) -> dict:
  started = time.perf_counter()
  directory = config.output.directory
  if os.path.exists(directory):
    shutil.rmtree(directory)
  # programs built (compiled, or loaded from the persistent cache) by the end of RL step 0
  built_by_step_0: list[int] = []

  def on_step(step: int, _metrics) -> None:
    if step == 0:
      built_by_step_0.append(compiled.built)

  with CompileCounter() as compiled:
    session = Session(config, on_step=on_step)
    session.announce()
    print(f"task {session.task.name}: e.g. {session.prompt_set.problems[0].prompt!r} -> "
          f"{session.prompt_set.problems[0].solution!r}", flush=True)
    models = session.warm_start()
    drafter, online = session.drafter_for(models)
    # The weights as RL lays them out (the train mesh), before and after: the same
    # compiled rollouts then serve both speed checks.
    initial = session.initial_state(models, online, session.meshes()[0])
    drafter_params = rollout_drafter_params(drafter, online)
    arms = RolloutArms(session, models)
    before = arms.measure(initial.compute_params(), drafter_params(initial), repeats=repeats,
                          label="speed check before RL")
    print(before.line("rollout speed before RL"), flush=True)
    del initial
    summary = session.train(models)
    state = session.state
    after = arms.measure(state.compute_params(), drafter_params(state), repeats=repeats,
                         label="speed check after RL")
    print(after.line("rollout speed after RL (online-trained drafter)"), flush=True)
  built_after_step_0 = compiled.built - built_by_step_0[0]

  records = read_jsonl(os.path.join(directory, "metrics.jsonl"))
  print("\nreward by step: " + " ".join(f"{r['reward_mean']:.2f}" for r in records))
  print("acceptance length by step: " + " ".join(f"{r['acceptance_length']:.2f}" for r in records))
  print(f"programs compiled (or loaded from the cache) after RL's first step: "
        f"{built_after_step_0}")
  checks = {"before RL": before, "after RL": after}
  if config.output.plots:
    summary["plots"].append(plot_speed_checks(
        checks, os.path.join(directory, "plots", "rollout_speed.png")))
  report = {
      "reward_first_quarter": summary["reward_first_quarter"],
      "reward_last_quarter": summary["reward_last_quarter"],
      "reward_rose": summary["reward_last_quarter"] > summary["reward_first_quarter"],
      "acceptance_length": summary["acceptance_length"],
      "rollout_speedup_before_rl": before.speedup,
      "rollout_speedup_after_rl": after.speedup,
      "speed_checks": {label: check.as_dict() for label, check in checks.items()},
      "compiled_after_first_rl_step": built_after_step_0,
      "compile_seconds": compiled.seconds,
      "plots": summary["plots"],
      "total_seconds": time.perf_counter() - started,
  }
  with open(os.path.join(directory, "demo.json"), "w") as f:
    json.dump(report, f, indent=2)
  print(json.dumps({k: v for k, v in report.items() if k != "speed_checks"}, indent=2))
  return report


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  config = experiment_config("demo", argv)
  with persistent_cache(cache_directory(config.output.compilation_cache,
                                        config.output.directory)):
    report = run_demo(config)
  print("reward rose over the run" if report["reward_rose"] else
        "reward did not rise over this run (RL on a tiny policy is noisy; see the plots)")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
