"""``make demo``: GRPO with speculative rollouts, end to end, on two CPU cores.

1. Warm start: SFT a ~1.2M-parameter policy on worked 1-2 digit additions until it is
   right some of the time, and distil a 64-wide one-layer draft model from it.
2. Rollout speed, plain vs speculative, measured side by side on the same prompts
   and weights (same engine shape, sampling, seeds), before and after RL.
3. A short GRPO run whose rollouts are speculative (the draft model keeps training
   online on every batch), printing reward and acceptance length as it goes.
Each phase shows a progress bar on stderr (compilation is named as it happens).
Metrics, TensorBoard events, checkpoints and PNG plots land in runs/demo/: the RL
curves (reward, response length, acceptance length against plain decoding's 1, step
time and throughput from step 1 on) and rollout_speed.png (plain vs speculative
rollout time, and a steady RL step split into generation and training).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence

import jax
from flax import nnx

from specrl_jax.compile_cache import cache_directory, persistent_cache
from specrl_jax.rl.app.experiment import ExperimentConfig, experiment_config
from specrl_jax.rl.loop.rollout import make_rollout, rollout_drafter_params
from specrl_jax.rl.loop.sync import prompts_on_mesh
from specrl_jax.rl.app.train_command import Models, Session
from specrl_jax.speculative.rollout import acceptance_length


def rollout_speed(session: Session, models: Models, params, drafter_params, *,
                  repeats: int = 5, label: str = "speed check") -> dict[str, float]:
  """Plain vs speculative rollout of the same batch (the prompts of RL step 0:
  prompts_per_step x group_size samples), same weights and engine shape.

  Both are compiled first; then the two alternate ``repeats`` times and each keeps
  its fastest run, so load from other processes on a shared machine hits both alike.
  """
  from tqdm import tqdm
  drafter, _ = session.drafter_for(models)
  train_mesh, _ = session.meshes()
  prompts = prompts_on_mesh(session.step_prompts(0), train_mesh)
  graphdef = nnx.split(models.policy)[0]
  bar = tqdm(total=2 * (1 + repeats), desc=label, unit="run", dynamic_ncols=True,
             file=sys.stderr, disable=not session.config.output.progress)
  arms = {}
  for name, kwargs in (("plain", {}), ("speculative", dict(drafter=drafter, spec=session.spec))):
    rollout = jax.jit(make_rollout(graphdef, models.policy.config, session.task,
                                   session.rollout_config, train_mesh,
                                   prompt_width=session.prompt_width, engine=session.engine,
                                   **kwargs))
    draft = drafter_params if kwargs else ()
    bar.set_postfix_str(f"compiling the {name} rollout")
    jax.block_until_ready(rollout(params, draft, prompts, jax.random.key(0), 0))
    bar.update(1)
    arms[name] = (rollout, draft, [])
  bar.set_postfix_str("timing plain and speculative in turn")
  outputs = {}
  for repeat in range(repeats):
    for name, (rollout, draft, seconds) in arms.items():
      start = time.perf_counter()
      outputs[name] = jax.block_until_ready(
          rollout(params, draft, prompts, jax.random.key(repeat + 1), 0))
      seconds.append(time.perf_counter() - start)
      bar.update(1)
  bar.close()
  plain, spec = min(arms["plain"][2]), min(arms["speculative"][2])
  counters = {name: jax.device_get(out.counters) for name, out in outputs.items()}
  spec_counters = counters["speculative"]
  return {"plain_seconds": plain, "speculative_seconds": spec, "speedup": plain / spec,
          "acceptance_length": float(acceptance_length(spec_counters["accepted_per_position"],
                                                       spec_counters["draft_rounds"])),
          "target_calls_plain": int(counters["plain"]["target_calls"]),
          "target_calls_speculative": int(spec_counters["target_calls"])}


def _report(label: str, speed: dict[str, float]) -> None:
  print(f"{label}: plain {speed['plain_seconds']:.3f}s vs speculative "
        f"{speed['speculative_seconds']:.3f}s per rollout batch -> speedup "
        f"{speed['speedup']:.2f}x; acceptance length {speed['acceptance_length']:.2f} tokens "
        f"per target call ({speed['target_calls_plain']} -> {speed['target_calls_speculative']} "
        "target forwards)", flush=True)


def plot_rollout_speed(before: dict[str, float], after: dict[str, float],
                       step_seconds: float, path: str) -> str:
  """Rollout time, plain vs speculative, before and after RL; and the steady RL step
  split into generation and training.

  A sync RL step is one compiled program, so the split is estimated: generation is the
  speculative rollout timed alone (mean of the two checks), training the rest of the
  step (log-probs, policy and drafter update). A plain-rollout step is shown alongside.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  labels = ["before RL", "after RL"]
  for offset, (arm, colour) in enumerate((("plain", "tab:grey"), ("speculative", "tab:blue"))):
    values = [before[f"{arm}_seconds"], after[f"{arm}_seconds"]]
    left.bar([i + 0.38 * offset for i in range(2)], values, width=0.38, color=colour,
             label=f"{arm} decoding")
  left.set_xticks([0.19, 1.19], labels)
  left.set_ylabel("seconds per rollout batch (fastest of 5)")
  left.set_title("Rollout time of one RL batch", fontsize=10)
  left.legend(fontsize=8)
  generation = {arm: (before[f"{arm}_seconds"] + after[f"{arm}_seconds"]) / 2
                for arm in ("plain", "speculative")}
  training = max(step_seconds - generation["speculative"], 0.0)
  arms = ["plain rollouts\n(estimated)", "speculative rollouts\n(as run)"]
  gen = [generation["plain"], generation["speculative"]]
  right.bar(arms[:1], gen[:1], color="tab:grey", label="generation, plain")
  right.bar(arms[1:], gen[1:], color="tab:blue", label="generation, speculative")
  right.bar(arms, [training] * 2, bottom=gen, color="tab:orange", label="training")
  right.set_ylabel("seconds per RL step (steady state)")
  right.set_title("RL step: generation vs training", fontsize=10)
  right.legend(fontsize=8)
  for axes in (left, right):
    axes.grid(alpha=0.3, axis="y")
  figure.suptitle("Plain vs speculative rollouts (generation timed alone; training = mean "
                  "step time after step 0 minus generation)", fontsize=9)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def run_demo(config: ExperimentConfig) -> dict:
  started = time.perf_counter()
  directory = config.output.directory
  if os.path.exists(directory):
    shutil.rmtree(directory)
  session = Session(config)
  print(f"task {session.task.name}: e.g. {session.prompt_set.problems[0].prompt!r} -> "
        f"{session.prompt_set.problems[0].solution!r}", flush=True)
  models = session.warm_start()
  drafter, online = session.drafter_for(models)
  params = nnx.split(models.policy)[1]
  before = rollout_speed(session, models, params, online.trainable if online else drafter.params(),
                         label="speed check before RL")
  _report("rollout speed before RL", before)

  summary = session.train(models)
  state = session.state
  after = rollout_speed(session, models, state.compute_params(),
                        rollout_drafter_params(drafter, online)(state),
                        label="speed check after RL")
  _report("rollout speed after RL (online-trained drafter)", after)

  from specrl_jax.rl.app.metrics import read_jsonl
  records = read_jsonl(os.path.join(directory, "metrics.jsonl"))
  print("\nreward by step: " + " ".join(f"{r['reward_mean']:.2f}" for r in records))
  print("acceptance length by step: " + " ".join(f"{r['acceptance_length']:.2f}" for r in records))
  if config.output.plots:
    summary["plots"].append(plot_rollout_speed(
        before, after, summary["step_seconds"],
        os.path.join(directory, "plots", "rollout_speed.png")))
  report = {
      "reward_first_quarter": summary["reward_first_quarter"],
      "reward_last_quarter": summary["reward_last_quarter"],
      "reward_rose": summary["reward_last_quarter"] > summary["reward_first_quarter"],
      "acceptance_length": summary["acceptance_length"],
      "rollout_speedup_before_rl": before["speedup"],
      "rollout_speedup_after_rl": after["speedup"],
      "plots": summary["plots"],
      "total_seconds": time.perf_counter() - started,
  }
  print(json.dumps(report, indent=2))
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
