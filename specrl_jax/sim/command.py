"""`specrl simulate`: run a preset, override any assumption, print a table or JSON,
draw k x acceptance heatmaps, or measure the local CPU (`--calibrate`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from specrl_jax.config import ConfigError
from specrl_jax.sim.hardware import DEFAULT_CPU_PROFILE_PATH, calibrate_cpu, get_hardware
from specrl_jax.sim.layout import ParallelLayout
from specrl_jax.sim.lengths import HistogramLengths, LogNormalLengths
from specrl_jax.sim.model_spec import DRAFTER_SPECS, MODELS, drafter_spec, get_model
from specrl_jax.sim.presets import PAPER_FIGURES, PRESETS, get_preset
from specrl_jax.sim.report import breakdown_table, comparison_json, speedup_grid, write_heatmap
from specrl_jax.sim.roofline import SpeculationSpec, acceptance_from_length
from specrl_jax.sim.step import SimulationSetup, simulate


def _floats(text: str) -> tuple[float, ...]:
  try:
    return tuple(float(x) for x in text.split(",") if x.strip())
  except ValueError as error:
    raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from error


def _ints(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError as error:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="specrl simulate",
      description="Roofline simulation of one RL step, plain vs speculative rollouts.")
  parser.add_argument("--preset", default="paper-8b-rl-zero", choices=sorted(PRESETS))
  parser.add_argument("--calibrate", action="store_true",
                      help="measure the local CPU and write its profile JSON, then exit")
  parser.add_argument("--output", default=str(DEFAULT_CPU_PROFILE_PATH),
                      help="where --calibrate writes the profile")
  out = parser.add_argument_group("output")
  out.add_argument("--json", action="store_true", help="print JSON instead of a table")
  out.add_argument("--heatmap", metavar="PATH", help="write a k x acceptance heatmap PNG")
  out.add_argument("--heatmap-k", type=_ints, default=(1, 2, 3, 4, 5, 6, 7, 8))
  out.add_argument("--heatmap-acceptance", type=_floats,
                   default=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95))
  system = parser.add_argument_group("system")
  system.add_argument("--hardware", help="profile name or JSON path (e.g. h100, cpu)")
  system.add_argument("--model", choices=sorted(MODELS))
  system.add_argument("--gpus", type=int, help="total GPUs")
  system.add_argument("--rollout-gpus", type=int, help="GPUs generating (separate pools)")
  system.add_argument("--training-gpus", type=int)
  system.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=None)
  system.add_argument("--rollout-tp", type=int)
  system.add_argument("--rollout-ep", type=int)
  engine = parser.add_argument_group("engine")
  engine.add_argument("--precision", choices=("bf16", "fp8"))
  engine.add_argument("--forward-overhead-ms", type=float,
                      help="fixed cost of every target forward and drafter step")
  engine.add_argument("--compute-efficiency", type=float)
  engine.add_argument("--memory-efficiency", type=float)
  engine.add_argument("--memory-utilization", type=float)
  engine.add_argument("--max-num-seqs", type=int)
  engine.add_argument("--batching", choices=("continuous", "static"))
  work = parser.add_argument_group("workload")
  work.add_argument("--sequences", type=int, help="responses per RL step")
  work.add_argument("--prompt-length", type=int)
  work.add_argument("--median-response", type=float)
  work.add_argument("--length-sigma", type=float)
  work.add_argument("--max-response", type=int)
  work.add_argument("--length-histogram", metavar="JSON",
                    help='measured lengths: {"bin_edges": [...], "counts": [...]} or a list')
  spec = parser.add_argument_group("speculation")
  spec.add_argument("--drafter", help=f"one of {sorted(DRAFTER_SPECS)}; "
                    "draft_model:<model name>, eagle3:<draft vocabulary size>")
  spec.add_argument("--k", type=int, help="draft tokens per round")
  spec.add_argument("--acceptance-length", type=float,
                    help="tokens per target forward (i.i.d. per-position rate solved)")
  spec.add_argument("--acceptance", type=_floats,
                    help="conditional per-position acceptance rates, e.g. 0.8,0.7,0.6")
  step = parser.add_argument_group("RL step")
  step.add_argument("--mode", choices=("sync", "async"))
  step.add_argument("--policy-lag", type=int)
  step.add_argument("--logprob-mfu", type=float)
  step.add_argument("--train-mfu", type=float)
  step.add_argument("--online-drafter", action=argparse.BooleanOptionalAction, default=None)
  return parser


def _replace(obj, **changes):
  changes = {k: v for k, v in changes.items() if v is not None}
  return dataclasses.replace(obj, **changes) if changes else obj


def _lengths(args, current):
  if args.length_histogram:
    data = json.loads(Path(args.length_histogram).read_text())
    if isinstance(data, list):
      return HistogramLengths.from_lengths(data)
    return HistogramLengths(bin_edges=tuple(data["bin_edges"]), counts=tuple(data["counts"]))
  if args.median_response is None and args.length_sigma is None and args.max_response is None:
    return current
  base = current if isinstance(current, LogNormalLengths) else LogNormalLengths(
      median=float(current.mean()), sigma=0.8, max_length=current.max_length)
  return _replace(base, median=args.median_response, sigma=args.length_sigma,
                  max_length=args.max_response)


def _layout(args, layout: ParallelLayout) -> ParallelLayout:
  tp = args.rollout_tp or layout.rollout_tp
  ep = args.rollout_ep or (layout.rollout_ep if layout.rollout_ep == 1 else tp)
  total = args.gpus or layout.total_gpus
  colocated = layout.colocated if args.colocated is None else args.colocated
  if args.rollout_gpus is not None or args.training_gpus is not None:
    colocated = False if args.colocated is None else args.colocated
  if colocated:
    rollout = args.rollout_gpus or total
    training = args.training_gpus or total
  else:
    default_share = layout.rollout_gpus / layout.total_gpus if not layout.colocated else 0.75
    rollout = args.rollout_gpus or max(tp, int(total * default_share) // tp * tp)
    # Leave an impossible rollout count for ParallelLayout to report as such.
    training = args.training_gpus or (total - rollout if total > rollout else total)
  return ParallelLayout(total_gpus=total, rollout_gpus=rollout, training_gpus=training,
                        colocated=colocated, rollout_tp=tp, rollout_ep=ep)


def apply_overrides(setup: SimulationSetup, args) -> SimulationSetup:
  model = get_model(args.model) if args.model else setup.model
  overhead = None if args.forward_overhead_ms is None else args.forward_overhead_ms / 1e3
  engine = _replace(setup.engine, weight_precision=args.precision,
                    kv_bytes_per_element=None if args.precision is None
                    else {"bf16": 2.0, "fp8": 1.0}[args.precision],
                    forward_overhead_s=overhead, draft_step_overhead_s=overhead,
                    compute_efficiency=args.compute_efficiency,
                    memory_efficiency=args.memory_efficiency,
                    memory_utilization=args.memory_utilization,
                    max_num_seqs=args.max_num_seqs)
  workload = _replace(setup.workload, num_sequences=args.sequences,
                      prompt_length=args.prompt_length, batching=args.batching,
                      lengths=_lengths(args, setup.workload.lengths))
  mode = args.mode or setup.step.mode
  lag = args.policy_lag if args.policy_lag is not None else (
      setup.step.policy_lag if mode == setup.step.mode else int(mode == "async"))
  step = _replace(setup.step, mode=mode, policy_lag=lag, logprob_mfu=args.logprob_mfu,
                  train_mfu=args.train_mfu, online_drafter=args.online_drafter)
  speculation = setup.speculation
  if speculation is not None:
    drafter = speculation.drafter
    if args.drafter or args.model:
      kind = args.drafter or {"eagle3": "eagle3", "mtp": "mtp", "ngram": "ngram",
                              "history": "history"}.get(drafter.kind, "eagle3")
      drafter = drafter_spec(kind, model)
    k = args.k or speculation.num_draft_tokens
    acceptance = speculation.acceptance
    if args.acceptance_length is not None:
      acceptance = acceptance_from_length(args.acceptance_length, k)
    if args.acceptance is not None:
      acceptance = args.acceptance
    speculation = SpeculationSpec(drafter=drafter, num_draft_tokens=k,
                                  acceptance=tuple(acceptance))
  return SimulationSetup(
      name=setup.name, model=model,
      hardware=get_hardware(args.hardware) if args.hardware else setup.hardware,
      engine=engine, layout=_layout(args, setup.layout), workload=workload, step=step,
      speculation=speculation)


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    if args.calibrate:
      profile = calibrate_cpu(args.output)
      print(json.dumps({"written": args.output, "profile": profile.to_json()}, indent=2))
      return 0
    setup = apply_overrides(get_preset(args.preset), args)
    comparison = simulate(setup)
    paper = PAPER_FIGURES.get(args.preset) if setup == get_preset(args.preset) else None
    if args.heatmap:
      grid = speedup_grid(setup, args.heatmap_k, args.heatmap_acceptance)
      write_heatmap(grid, args.heatmap, title=f"{setup.name}: {setup.model.name} on "
                    f"{setup.layout.total_gpus} x {setup.hardware.name}")
    if args.json:
      out = comparison_json(comparison, setup, paper)
      if args.heatmap:
        out["heatmap"] = args.heatmap
      print(json.dumps(out, indent=2, default=float))
    else:
      print(breakdown_table(comparison, paper))
      if args.heatmap:
        print(f"heatmap written to {args.heatmap}")
  except (ConfigError, OSError, json.JSONDecodeError, KeyError) as error:
    print(f"specrl simulate: error: {error}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
