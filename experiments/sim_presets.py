"""Simulator projections for the paper's presets, next to the paper's figures.

For each preset of ``specrl simulate`` (paper-8b-rl-zero, paper-8b-rl-think,
paper-235b-async): the stage breakdown plain vs speculative and the generation and
end-to-end speedups; for the two 8B runs, the generation speedup the simulator projects
for the paper's EAGLE-3 k sweep (k = 3, 5, 7 at the acceptance lengths the paper
measured); and the k x acceptance heatmap of the 235B envelope. Every assumption is in
specrl_jax/sim/presets.py. Purely analytical: runs in seconds.

  python experiments/sim_presets.py [--out results]

Writes sim_presets.json, sim_presets.png and sim_235b_heatmap.png to --out and prints
the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from specrl_jax.sim import (PAPER_FIGURES, PRESETS, acceptance_from_length,  # noqa: E402
                            comparison_json, get_preset, simulate, speedup_grid,
                            write_heatmap)
from specrl_jax.sim.presets import with_speculation  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "results"
STAGES = ("generation", "logprob", "training", "total")
HEATMAP_K = (1, 2, 3, 4, 5, 6, 7, 8)
HEATMAP_ACCEPTANCE = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)


def project(name: str) -> dict:
  setup = get_preset(name)
  comparison = simulate(setup)
  paper = PAPER_FIGURES.get(name, {})
  record = comparison_json(comparison, setup, paper or None)
  summary = {"generation_speedup": comparison.generation_speedup,
             "step_speedup": comparison.step_speedup,
             "paper_generation_speedup": paper.get("generation_speedup"),
             "paper_step_speedup": paper.get("step_speedup"),
             "stages": {stage: {"plain": getattr(comparison.plain, stage),
                                "speculative": getattr(comparison.speculative, stage)}
                        for stage in STAGES}}
  if "plain" in paper:
    for stage in STAGES:
      summary["stages"][stage]["paper_plain"] = paper["plain"][stage]
      summary["stages"][stage]["paper_speculative"] = paper["speculative"][stage]
  if "k_sweep" in paper:
    sweep = []
    for k, (acceptance_length, paper_speedup) in sorted(paper["k_sweep"].items()):
      varied = with_speculation(setup, num_draft_tokens=k,
                                acceptance=acceptance_from_length(acceptance_length, k))
      sweep.append({"k": k, "acceptance_length": acceptance_length,
                    "generation_speedup": simulate(varied).generation_speedup,
                    "paper_generation_speedup": paper_speedup})
    summary["k_sweep"] = sweep
  return {"summary": summary, "detail": record}


def plot(projections: dict, path: Path) -> None:
  plt = common.pyplot()
  import numpy as np

  names = list(projections)
  figure, axes = plt.subplots(1, 3, figsize=(16, 4.4))
  x = np.arange(len(names))
  for offset, (key, label, hatch) in zip(
      (-0.3, -0.1, 0.1, 0.3),
      (("generation_speedup", "generation, simulator", ""),
       ("paper_generation_speedup", "generation, paper", "//"),
       ("step_speedup", "end-to-end, simulator", ""),
       ("paper_step_speedup", "end-to-end, paper", "//"))):
    values = [projections[n]["summary"][key] or 0.0 for n in names]
    axes[0].bar(x + offset, values, 0.2, label=label, hatch=hatch,
                color="tab:blue" if key.endswith("generation_speedup") else "tab:orange",
                alpha=0.55 if "paper" in key else 1.0)
  axes[0].set_xticks(x, [n.replace("paper-", "") for n in names])
  axes[0].axhline(1.0, color="black", lw=0.8)
  axes[0].set(ylabel="speedup vs plain decoding", title="speculative RL step: speedups")
  axes[0].legend(fontsize=8)

  for color, name in zip(("tab:blue", "tab:orange"), names):
    sweep = projections[name]["summary"].get("k_sweep")
    if not sweep:
      continue
    ks = [row["k"] for row in sweep]
    short = name.replace("paper-8b-", "")
    axes[1].plot(ks, [row["generation_speedup"] for row in sweep], "o-", color=color,
                 label=f"{short}, simulator")
    axes[1].plot(ks, [row["paper_generation_speedup"] for row in sweep], "s--", color=color,
                 alpha=0.6, label=f"{short}, paper")
  axes[1].axhline(1.0, color="black", lw=0.8)
  axes[1].set(xlabel="k (EAGLE-3 draft tokens)", ylabel="generation speedup",
              title="8B: k sweep at the paper's acceptance lengths")
  axes[1].set_xticks([3, 5, 7])
  axes[1].legend(fontsize=8)

  stages = projections["paper-8b-rl-zero"]["summary"]["stages"]
  labels = [s for s in STAGES if s != "total"]
  x = np.arange(len(labels))
  for offset, key, label in ((-0.3, "plain", "plain, simulator"),
                             (-0.1, "paper_plain", "plain, paper"),
                             (0.1, "speculative", "speculative, simulator"),
                             (0.3, "paper_speculative", "speculative, paper")):
    axes[2].bar(x + offset, [stages[s][key] for s in labels], 0.2, label=label,
                color="tab:gray" if "plain" in key else "tab:green",
                alpha=0.55 if "paper" in key else 1.0, hatch="//" if "paper" in key else "")
  axes[2].set_xticks(x, labels)
  axes[2].set(ylabel="seconds per RL step", title="8B RL-Zero: stage times")
  axes[2].legend(fontsize=8)
  for axis in axes:
    axis.grid(alpha=0.3, axis="y")
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=Path, default=RESULTS)
  args = parser.parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  projections = {name: project(name) for name in PRESETS}
  heatmap = args.out / "sim_235b_heatmap.png"
  setup = get_preset("paper-235b-async")
  write_heatmap(speedup_grid(setup, HEATMAP_K, HEATMAP_ACCEPTANCE), heatmap,
                title=f"{setup.name}: {setup.model.name} on {setup.layout.total_gpus} x "
                      f"{setup.hardware.name}")
  plot(projections, args.out / "sim_presets.png")
  payload = {"experiment": "sim_presets",
             "summary": {name: p["summary"] for name, p in projections.items()},
             "detail": {name: p["detail"] for name, p in projections.items()},
             "heatmap": str(heatmap)}
  (args.out / "sim_presets.json").write_text(json.dumps(payload, indent=2, default=float))
  common.print_json(json.loads(json.dumps(payload["summary"], default=float)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
