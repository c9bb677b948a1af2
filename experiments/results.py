"""`make results`: regenerate every figure and table of the README into results/.

Each study runs one experiment script of this folder with the settings the README
quotes, in its own process (JAX's device count is fixed per process), and leaves
<name>.json and <name>.png in the results folder. Scripts that only print JSON have it
captured from their stdout and plotted here; scripts that write elsewhere have their
files copied in. results/manifest.json records, per study, the exact command, how long
it took, what it wrote, and the machine it ran on.

Studies (in order; later ones reuse what earlier ones trained and cached in artifacts/):
  sim_presets    simulator projections of the paper's presets vs the paper's figures
  train_drafter  MTP / EAGLE-3 trained offline; frozen vs online drafter over RL steps
  k_sweep        acceptance length and speedup vs k: n-gram, draft model, MTP, EAGLE-3
  bench_spec     speculative vs plain wall clock, draft model and n-gram, batch 1 / 8
  bench_spec_longtail  long-tailed responses: slot compaction, per-width adaptive shapes
  sim_vs_measured  the simulator's cost model vs measured decode times (medium pair)
  bench_history  rollout-history drafting over RL epochs
  bench_rl       RL step time: sync vs async, with and without speculation
  reward_curves  GRPO reward with and without speculation over seeds
  bench_decode   plain decode throughput vs transformers, with the bandwidth roofline
  bench_matmul   one layer-sized matmul through XLA, numpy and torch at decoding's row counts

  python experiments/results.py [--only NAME ...] [--quick] [--out results]

--quick runs every study at tiny settings into results/quick/ with its own artifacts
folder (so smoke runs never replace the cached models the real figures reuse): it checks
the wiring, not the numbers. Exits non-zero if any study failed (the others still run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Paths:
  """Where one `results.py` run writes: the results folder and its scratch runs/."""
  out: Path
  runs: Path
  artifacts: Path | None  # None: the scripts' default (artifacts/)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Study:
  """One experiment script, run as the README quotes it (``args``) or tiny (``quick``).

  args / quick: functions of the run's Paths -> command-line arguments.
  outputs: the files the study leaves in the results folder.
  collect: moves or makes those files once the script has exited (given its stdout).
  devices: simulated CPU devices the script's process gets.
  """
  name: str
  script: str
  args: Callable[[Paths], list[str]]
  quick: Callable[[Paths], list[str]]
  outputs: tuple[str, ...]
  collect: Callable[["Study", Paths, str], None] | None = None
  devices: int = 1


# ----------------------------------------------------------------- collecting outputs

def last_json(text: str):
  """The last top-level JSON object printed in ``text`` (logs may precede it)."""
  decoder = json.JSONDecoder()
  for match in reversed(list(re.finditer(r"^\{", text, re.MULTILINE))):
    try:
      return decoder.raw_decode(text, match.start())[0]
    except ValueError:
      continue
  raise ValueError("no JSON object found in the script's output")


def _artifacts(paths: Paths) -> Path:
  return paths.artifacts or ROOT / "artifacts"


def _copy(source: Path, target: Path) -> None:
  if not source.exists():
    raise FileNotFoundError(f"the script did not write {source}")
  shutil.copyfile(source, target)


def collect_train_drafter(study: Study, paths: Paths, stdout: str) -> None:
  folder = _artifacts(paths) / "train_drafter"
  _copy(folder / "result.json", paths.out / "train_drafter.json")
  _copy(folder / "online_vs_frozen.json", paths.out / "online_vs_frozen.json")
  _copy(folder / "online_vs_frozen.png", paths.out / "online_vs_frozen.png")


def collect_reward_curves(study: Study, paths: Paths, stdout: str) -> None:
  folder = paths.runs / "reward_curves"
  _copy(folder / "reward_curves.json", paths.out / "reward_curves.json")
  _copy(folder / "reward_curves.png", paths.out / "reward_curves.png")


def stdout_json(study: Study, paths: Paths, stdout: str) -> dict:
  """Saves the JSON a script printed as <name>.json (and returns it)."""
  payload = last_json(stdout)
  (paths.out / f"{study.name}.json").write_text(json.dumps(payload, indent=2))
  return payload


def stdout_and_plot(plot: Callable[[dict, Path], None]):
  """Collects a script that prints JSON: saves it as <name>.json and plots <name>.png."""
  def collect(study: Study, paths: Paths, stdout: str) -> None:
    plot(stdout_json(study, paths, stdout), paths.out / f"{study.name}.png")
  return collect


# ----------------------------------------------------------------- plots of printed JSON

def plot_bench_spec(payload: dict, path: Path) -> None:
  """Acceptance length and speed vs plain against k, per drafter and batch size."""
  rows = [r for r in payload["results"] if "/chain_k" in r["config"]]
  k_of = lambda r: int(r["config"].split("_k")[1])
  series = []
  for drafter, batch in sorted({(r["config"].split("/")[0], r["batch"]) for r in rows}):
    mine = sorted((r for r in rows if r["config"].startswith(drafter + "/")
                   and r["batch"] == batch), key=k_of)
    series.append((f"{drafter.replace('_', ' ').replace('ngram', 'n-gram')}, batch {batch}",
                   "o-" if drafter == "draft_model" else "s--", None, [k_of(r) for r in mine],
                   [r["acceptance_length"] for r in mine],
                   [r["speedup_vs_plain"] for r in mine]))
  figure, axes = common.plot_against_k(series, {k_of(r) for r in rows})
  for axis in axes:
    axis.legend(fontsize=8)
  figure.suptitle(f"bench_spec: {payload['target']}, temperature {payload['temperature']}")
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  common.pyplot().close(figure)


def plot_bench_rl(payload: dict, path: Path) -> None:
  """Sync stage times plain vs speculative, and samples/s of sync and async arms."""
  plt = common.pyplot()
  figure, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  arms = ("plain", "speculative")
  bottom = [0.0, 0.0]
  for stage, color in (("generation", "tab:blue"), ("log_prob", "tab:purple"),
                       ("train", "tab:orange"), ("drafter", "tab:green")):
    values = [payload[f"sync_{arm}"].get(stage, 0.0) for arm in arms]
    axes[0].bar(arms, values, bottom=bottom, color=color, label=stage)
    bottom = [b + v for b, v in zip(bottom, values)]
  axes[0].set(ylabel="seconds per RL step (median)",
              title=f"sync RL step on {payload['devices']} devices")
  axes[0].legend(fontsize=8)
  groups = [("sync", lambda arm: payload[f"sync_{arm}"])]
  for lag in (1, 2):
    if f"async_plain_lag{lag}" in payload:
      groups.append((f"async, lag {lag}",
                     lambda arm, lag=lag: payload[f"async_{arm}_lag{lag}"]))
  for offset, arm, color in ((-0.2, "plain", "tab:gray"), (0.2, "speculative", "tab:green")):
    axes[1].bar([i + offset for i in range(len(groups))],
                [get(arm)["samples_per_second"] for _, get in groups], 0.4, color=color,
                label=arm)
  axes[1].set_xticks(range(len(groups)), [name for name, _ in groups])
  axes[1].set(ylabel="samples per second",
              title=f"throughput, {payload['samples_per_step']} samples per step")
  axes[1].legend(fontsize=8)
  for axis in axes:
    axis.grid(alpha=0.3, axis="y")
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)


def _grouped_bars(axis, rows: list[dict], series: list[tuple[str, str]],
                  labels: list[str]) -> None:
  """One group of bars per row, one bar per (key, legend label) of ``series``."""
  width = 0.8 / len(series)
  for index, (key, name) in enumerate(series):
    axis.bar([i + (index - (len(series) - 1) / 2) * width for i in range(len(rows))],
             [r[key] for r in rows], width, label=name)
  axis.set_xticks(range(len(rows)), labels)


def plot_bench_decode(payload: dict, path: Path) -> None:
  """Plain decode tokens/s of both engines and the roofline, per batch and temperature."""
  plt = common.pyplot()
  rows = payload["results"]
  labels = [f"batch {r['batch']}\nT={r['temperature']:g}" for r in rows]
  series = [("specrl_jax_tokens_per_second", "specrl_jax"),
            ("transformers_tokens_per_second", "transformers"),
            ("roofline_tokens_per_second", "bandwidth roofline")]
  series = [(key, name) for key, name in series if all(key in r for r in rows)]
  figure, axis = plt.subplots(figsize=(7, 4))
  _grouped_bars(axis, rows, series, labels)
  axis.set(ylabel="generated tokens per second",
           title=f"plain decoding, {payload['model']}, {payload['new_tokens']} new tokens")
  axis.legend(fontsize=8)
  axis.grid(alpha=0.3, axis="y")
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)


def plot_bench_matmul(payload: dict, path: Path) -> None:
  """Weight bytes read per second of one layer-sized matmul per library, against rows."""
  plt = common.pyplot()
  rows = payload["results"]
  series = [(key, key.removesuffix("_GBps").replace("_", " "))
            for key in rows[0] if key.endswith("_GBps")]
  figure, axis = plt.subplots(figsize=(7, 4))
  _grouped_bars(axis, rows, series, [f"M = {r['rows']}" for r in rows])
  axis.axhline(payload["read_bandwidth_GBps"], color="black", linewidth=1,
               label="measured read bandwidth")
  axis.set(ylabel="weight GB/s", title=f"[M, {payload['shape'][0]}] x {payload['shape']} "
           f"{payload['dtype']} matmul on {payload['cpu_count']} cores")
  axis.legend(fontsize=7)
  axis.grid(alpha=0.3, axis="y")
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)


# ----------------------------------------------------------------- the studies

STUDIES: tuple[Study, ...] = (
    Study(name="sim_presets", script="sim_presets.py",
          args=lambda p: ["--out", str(p.out)], quick=lambda p: ["--out", str(p.out)],
          outputs=("sim_presets.json", "sim_presets.png", "sim_235b_heatmap.png")),
    Study(name="train_drafter", script="train_drafter.py",
          args=lambda p: [],
          quick=lambda p: ["--sft-steps", "20", "--rollout-prompts", "32", "--updates", "4",
                           "--weak-updates", "2", "--rl-steps", "2", "--batches", "4",
                           "--repeats", "1"],
          outputs=("train_drafter.json", "online_vs_frozen.json", "online_vs_frozen.png"),
          collect=collect_train_drafter),
    Study(name="k_sweep", script="k_sweep.py",
          args=lambda p: ["--out", str(p.out)],
          quick=lambda p: ["--ks", "1", "2", "--batches", "4", "--repeats", "1",
                           "--distill-steps", "10", "--out", str(p.out)],
          outputs=("k_sweep.json", "k_sweep.png")),
    Study(name="bench_spec", script="bench_spec.py",
          args=lambda p: ["--batches", "1", "8", "--ks", "1", "3", "5", "--samples", "5",
                          "--no-trees"],
          quick=lambda p: ["--batches", "2", "--ks", "1", "2", "--samples", "1", "--no-trees"],
          outputs=("bench_spec.json", "bench_spec.png"),
          collect=stdout_and_plot(plot_bench_spec)),
    Study(name="bench_spec_longtail", script="bench_spec.py",
          args=lambda p: ["--size", "medium", "--lengths", "longtail", "--longtail-digits",
                          "40", "--longtail-exponent", "1.5", "--longtail-straggler",
                          "--batches", "8", "32", "--ks", "3", "--samples", "3", "--no-trees",
                          "--no-ngram", "--adaptive-trees", "2x2x1", "--adaptive-warmup", "6",
                          "--max-new-tokens", "256",
                          "--plot", str(p.out / "bench_spec_longtail.png")],
          quick=lambda p: ["--lengths", "longtail", "--batches", "4", "--ks", "2",
                           "--samples", "1", "--no-trees", "--no-ngram", "--adaptive-trees",
                           "2x1", "--adaptive-warmup", "2", "--max-new-tokens", "32",
                           "--plot", str(p.out / "bench_spec_longtail.png")],
          outputs=("bench_spec_longtail.json", "bench_spec_longtail.png"), collect=stdout_json),
    Study(name="sim_vs_measured", script="sim_vs_measured.py",
          args=lambda p: ["--size", "medium", "--batches", "1", "2", "4", "8",
                          "--ks", "1", "2", "3", "4", "5", "--new-tokens", "32",
                          "--png", str(p.out / "sim_vs_measured.png")],
          quick=lambda p: ["--batches", "1", "2", "--ks", "1", "2", "--new-tokens", "8",
                           "--repeats", "1", "--seeds", "1",
                           "--png", str(p.out / "sim_vs_measured.png")],
          outputs=("sim_vs_measured.json", "sim_vs_measured.png"), collect=stdout_json),
    Study(name="bench_history", script="bench_history.py",
          args=lambda p: ["--out", str(p.out)],
          quick=lambda p: ["--policy", "tiny", "--epochs", "2", "--prompts", "4", "--group",
                           "4", "--slots", "16", "--repeats", "1", "--sft-steps", "10",
                           "--eagle-updates", "4",
                           "--out", str(p.out)],
          outputs=("bench_history.json", "bench_history.png")),
    Study(name="bench_rl", script="bench_rl.py", devices=2,
          args=lambda p: ["--devices=2", "--steps=4", "--warmup=1",
                          f"--out={p.runs / 'bench_rl'}", f"--warm-from={p.runs / 'demo'}"],
          quick=lambda p: ["--devices=2", "--steps=1", "--warmup=1",
                           f"--out={p.runs / 'bench_rl'}", f"--warm-from={p.runs / 'demo'}"],
          outputs=("bench_rl.json", "bench_rl.png"),
          collect=stdout_and_plot(plot_bench_rl)),
    Study(name="reward_curves", script="reward_curves.py",
          args=lambda p: ["--seeds=3", "--steps=20", f"--out={p.runs / 'reward_curves'}"],
          quick=lambda p: ["--seeds=2", "--steps=2", f"--out={p.runs / 'reward_curves'}"],
          outputs=("reward_curves.json", "reward_curves.png"),
          collect=collect_reward_curves),
    Study(name="bench_decode", script="bench_decode.py",
          args=lambda p: ["--batches", "1", "8"],
          quick=lambda p: ["--batches", "1", "--repeats", "1"],
          outputs=("bench_decode.json", "bench_decode.png"),
          collect=stdout_and_plot(plot_bench_decode)),
    Study(name="bench_matmul", script="bench_matmul.py",
          args=lambda p: [], quick=lambda p: ["--rows", "1", "8", "--repeats", "1"],
          outputs=("bench_matmul.json", "bench_matmul.png"),
          collect=stdout_and_plot(plot_bench_matmul)),
)
BY_NAME = {study.name: study for study in STUDIES}


def outputs() -> set[str]:
  """Every file name `make results` writes into the results folder."""
  return {name for study in STUDIES for name in study.outputs} | {"manifest.json"}


# ----------------------------------------------------------------- running

def _environment(study: Study, paths: Paths) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env.update(JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"),
             JAX_NUM_CPU_DEVICES=str(study.devices), MPLBACKEND="Agg")
  if paths.artifacts is not None:
    env["SPECRL_ARTIFACTS"] = str(paths.artifacts)
  return env


def run_study(study: Study, paths: Paths, quick: bool, log=print) -> dict:
  """Runs one study (stderr streams through) and collects its outputs; its record."""
  command = [sys.executable, str(HERE / study.script),
             *(study.quick(paths) if quick else study.args(paths))]
  log(f"[results] {study.name}: {' '.join(command[1:])}")
  started = time.perf_counter()
  completed = subprocess.run(command, cwd=ROOT, env=_environment(study, paths),
                             stdout=subprocess.PIPE, text=True)
  seconds = time.perf_counter() - started
  record = {"command": ["python", *(os.path.relpath(c, ROOT) if c.startswith(str(ROOT))
                                    else c for c in command[1:])],
            "seconds": round(seconds, 1), "returncode": completed.returncode}
  if completed.returncode != 0:
    record["error"] = f"exited with {completed.returncode}"
    (paths.out / f"{study.name}.stdout.txt").write_text(completed.stdout)
    return record
  try:
    if study.collect is not None:
      study.collect(study, paths, completed.stdout)
    missing = [name for name in study.outputs if not (paths.out / name).exists()]
    if missing:
      raise FileNotFoundError(f"missing outputs {missing}")
  except (OSError, ValueError, KeyError) as error:
    record["error"] = f"{type(error).__name__}: {error}"
    (paths.out / f"{study.name}.stdout.txt").write_text(completed.stdout)
    return record
  record["outputs"] = list(study.outputs)
  log(f"[results] {study.name}: done in {seconds:.0f}s -> "
      + ", ".join(str(paths.out / name) for name in study.outputs))
  return record


def _machine() -> dict:
  info = {"platform": platform.platform(), "python": platform.python_version(),
          "cpu_count": os.cpu_count()}
  if hasattr(os, "getloadavg"):
    info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
  try:
    info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True,
                                    capture_output=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    pass
  return info


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", nargs="+", choices=sorted(BY_NAME), metavar="NAME",
                      help=f"run only these studies: {', '.join(BY_NAME)}")
  parser.add_argument("--quick", action="store_true",
                      help="tiny settings into results/quick/ (checks wiring, not numbers)")
  parser.add_argument("--out", type=Path, help="results folder (default results/, or "
                                               "results/quick/ with --quick)")
  args = parser.parse_args(argv)
  out = (args.out or ROOT / "results" / ("quick" if args.quick else "")).resolve()
  paths = Paths(out=out, runs=(out / "runs") if args.quick else ROOT / "runs",
                artifacts=(out / "artifacts") if args.quick else None)
  out.mkdir(parents=True, exist_ok=True)
  studies = [BY_NAME[name] for name in args.only] if args.only else list(STUDIES)

  manifest_path = out / "manifest.json"
  manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
  manifest.setdefault("studies", {})
  manifest["machine"] = _machine()
  manifest["quick"] = args.quick
  failed = []
  for study in studies:
    record = run_study(study, paths, args.quick)
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    manifest["studies"][study.name] = record
    manifest_path.write_text(json.dumps(manifest, indent=2))
    if "error" in record:
      failed.append(study.name)
      print(f"[results] {study.name} FAILED: {record['error']}", file=sys.stderr)
  if failed:
    print(f"[results] failed: {', '.join(failed)}; the other studies' outputs are in {out}",
          file=sys.stderr)
    return 1
  print(f"[results] all {len(studies)} studies written to {out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
