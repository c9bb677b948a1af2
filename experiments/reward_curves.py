"""Reward curves with and without speculative rollouts, on the same seeds budget.

Speculative decoding is lossless: rollouts come from exactly the policy's
distribution, so GRPO should learn the same way with or without it. This runs the
demo's GRPO from one shared warm start for each seed, once with plain rollouts and
once with speculative ones (online-trained draft model), and compares:
  * per-run mean reward over the second half of training (Welch's t-test, plain vs
    speculative; a large p-value = no detectable difference),
  * reward gain (second half minus first quarter) per arm,
and plots the mean curve of each arm with a +-1 standard error band.

  python experiments/reward_curves.py [--seeds=4] [--steps=20] [--out=runs/reward_curves]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from specrl_jax.rl.app.experiment import experiment_config  # noqa: E402
from specrl_jax.rl.app.metrics import read_jsonl  # noqa: E402
from specrl_jax.rl.app.train_command import Session  # noqa: E402


def run(seeds: int, steps: int, out: str) -> dict:
  base = experiment_config("demo", common.SMALL_DEMO + [f"--rl.steps={steps}", "--output.progress=false",
                                    "--output.plots=false", "--output.tensorboard=false",
                                    "--output.resume=false", f"--output.directory={out}/warm"])
  log = lambda message: print(message, file=sys.stderr, flush=True)
  models = Session(base, log=log).warm_start()
  curves = {}
  for arm, kind in (("plain", "none"), ("speculative", "draft_model")):
    config = dataclasses.replace(base, drafter=dataclasses.replace(base.drafter, kind=kind))
    session = Session(config, log=log)
    curves[arm] = []
    for seed in range(seeds):
      session.config = dataclasses.replace(
          config, rl=dataclasses.replace(config.rl, seed=seed),
          output=dataclasses.replace(config.output, directory=f"{out}/{arm}_{seed}"))
      started = time.perf_counter()
      session.train(models)
      records = read_jsonl(os.path.join(session.directory, "metrics.jsonl"))
      curves[arm].append([r["reward_mean"] for r in records])
      log(f"{arm} seed {seed}: {time.perf_counter() - started:.0f}s, rewards "
          + " ".join(f"{r:.2f}" for r in curves[arm][-1]))
  return summarize(curves, out)


def summarize(curves: dict[str, list[list[float]]], out: str) -> dict:
  from scipy import stats

  arrays = {arm: np.asarray(c) for arm, c in curves.items()}
  steps = next(iter(arrays.values())).shape[1]
  late = {arm: a[:, steps // 2:].mean(axis=1) for arm, a in arrays.items()}
  early = {arm: a[:, :max(1, steps // 4)].mean(axis=1) for arm, a in arrays.items()}
  test = stats.ttest_ind(late["plain"], late["speculative"], equal_var=False)
  pooled = np.concatenate([late[a] - early[a] for a in arrays])
  rise = stats.ttest_1samp(pooled, 0.0, alternative="greater")
  result = {
      "seeds": len(curves["plain"]), "steps": steps,
      "late_reward": {arm: float(v.mean()) for arm, v in late.items()},
      "late_reward_per_seed": {arm: v.round(4).tolist() for arm, v in late.items()},
      "welch_t_pvalue_plain_vs_speculative": float(test.pvalue),
      "indistinguishable_at_0.05": bool(test.pvalue > 0.05),
      "reward_gain": {arm: float((late[arm] - early[arm]).mean()) for arm in arrays},
      "reward_increase_pvalue": float(rise.pvalue),
      "plot": plot(arrays, out),
  }
  with open(os.path.join(out, "reward_curves.json"), "w") as file:
    json.dump({"curves": curves, **result}, file, indent=2)
  return result


def plot(arrays: dict[str, np.ndarray], out: str) -> str:
  plt = common.pyplot()

  figure, axes = plt.subplots(figsize=(6, 3.5))
  for arm, values in arrays.items():
    steps = np.arange(values.shape[1])
    mean = values.mean(axis=0)
    error = values.std(axis=0, ddof=1) / np.sqrt(values.shape[0]) if len(values) > 1 else 0 * mean
    axes.plot(steps, mean, label=f"{arm} ({len(values)} seeds)")
    axes.fill_between(steps, mean - error, mean + error, alpha=0.25)
  axes.set_xlabel("RL step")
  axes.set_ylabel("mean reward")
  axes.set_title("GRPO reward, plain vs speculative rollouts (mean +- s.e.)")
  axes.legend()
  axes.grid(alpha=0.3)
  figure.tight_layout()
  path = os.path.join(out, "reward_curves.png")
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seeds", type=int, default=4)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--out", default="runs/reward_curves")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  print(json.dumps(run(args.seeds, args.steps, args.out), indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
