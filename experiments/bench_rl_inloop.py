"""RL rollout generation time: the in-loop adaptive draft shape vs every fixed chain vs
plain decoding, interleaved step by step on the same prompts, weights and seeds.

Each arm is the sync RL step's own rollout program (``rl.loop.sync.build_program``),
with slot compaction: "plain" (no drafter), "chain_k<k>" (the draft model at k drafted
tokens, k = 1..K) and "adaptive" (the draft model with ``--drafter.adaptive``: a shape
from plain, chains 1..K [and --trees] chosen per round inside the compiled rollout,
from its round costs measured at the start on this machine and the acceptance it
carries from rollout to rollout). Every step times each arm's rollout of that step's
prompts, the arms in a rotating order, with the same rng; the adaptive arm carries its
controller from step to step, as the RL step does. The weights stay the warm start's
(the policy SFT'd on the task, the draft model distilled from it): this measures
generation, not learning. ``--warmup`` untimed steps first (compiles, and the
controller's first measurements).

  python experiments/bench_rl_inloop.py [--policy tiny|demo|small|medium]
      [--task longtail|arithmetic] [--steps 6] [--warmup 2] [--k 4] [--trees 2x2x1,3x1]
      [--num-slots 4] [--prompts-per-step 16] [--fixed 2,4|none] [--forced 0,3,4]
      [--drafter-data rollouts|solutions] [--step-share] [--refresh 0.5]
      [--recalibrate 1,3,3] [--set=--SECTION.FIELD=VALUE ...]

--policy tiny: the tiny (test) preset's policy and drafter shapes; demo: the demo
preset's 11.5M policy and 128 x 1 drafter (a forward bound by reading the weights at
few rows); small: common.SMALL_DEMO's 1.2M policy (compute-bound on a CPU); these are
warm-started on --task. medium: experiments/spec_pair.py's 38M target (SFT on 2-4
digits) with its draft model distilled on --task: by default further on 512 of the
target's own rollouts of it (spec_pair.load_or_distill_on_rollouts), with
--drafter-data solutions only on the task's worked solutions (both cached under
artifacts/). --forced K runs the adaptive program pinned to chain K (0: plain) as an
extra arm; --step-share also times the adaptive arm's whole sync step. --refresh W adds
"adaptive_refreshed": the adaptive arm's program and calibrated table, the table then
refreshed after each of its rollouts from that rollout's own seconds
(``shape_control.refreshed``, what an async run with --drafter.refresh_weight=W does;
not after the first warm-up step's rollout, which compiles). --recalibrate 1,3,3 adds
one adaptive arm per value, "adaptive_r<N>_<i>", each with its own calibration of N
passes (--drafter.calibration_repeats=N): how often a calibration picks a losing shape,
several samples in one interleaved run.

Prints one JSON object: per arm the median generation seconds, the per-step speed-ups
over plain decoding (median and range), acceptance, rounds and tokens per width and
milliseconds per round; for the adaptive arm the shape that ran most at each width per
step, rounds per shape and width, the round-cost table, the exploration rounds and how
far the table's prediction of each rollout's seconds was from the measured seconds.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import spec_pair  # noqa: E402

from specrl_jax.rl.app.experiment import PRESETS, experiment_config  # noqa: E402
from specrl_jax.rl.app.train_command import Session  # noqa: E402
from specrl_jax.rl.loop.rollout import rollout_metrics  # noqa: E402
from specrl_jax.parallel.mesh import data_parallel_size  # noqa: E402
from specrl_jax.rl.loop.shape_control import (controller_metrics, refreshed,  # noqa: E402
                                              shape_labels, step_counters)
from specrl_jax.rl.loop.sync import build_program, prompts_on_mesh  # noqa: E402


def _parse(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--policy", choices=("tiny", "demo", "small", "medium"), default="demo")
  parser.add_argument("--distill-steps", type=int, default=150,
                      help="--policy medium: draft model steps distilled on the task")
  parser.add_argument("--drafter-data", choices=("rollouts", "solutions"), default="rollouts",
                      help="--policy medium: the draft model further distilled on the "
                      "target's own rollouts of --task (default), or only on its worked "
                      "solutions")
  parser.add_argument("--step-share", action="store_true",
                      help="also time the adaptive arm's whole sync RL step (rollout and "
                      "learner) on a copy of its state, untimed for the ratios: the "
                      "generation share of the step")
  parser.add_argument("--task", choices=("longtail", "arithmetic"), default="longtail")
  parser.add_argument("--tail-exponent", type=float, default=1.0)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--trees", default="", help="adaptive trees, e.g. 2x2x1,3x1")
  parser.add_argument("--num-slots", type=int, default=4)
  parser.add_argument("--prompts-per-step", type=int, default=16)
  parser.add_argument("--out", default="runs/bench_rl_inloop")
  parser.add_argument("--forced", default="",
                      help="chain lengths, e.g. 0,3,4 (0: plain): also the adaptive program "
                      "forced to each every round (what the in-loop machinery costs at a "
                      "fixed shape)")
  parser.add_argument("--fixed", default="",
                      help="the fixed chains to run, e.g. 2,4 (default 1..K; none: no fixed "
                      "chain)")
  parser.add_argument("--refresh", type=float, default=0.0, metavar="WEIGHT",
                      help="also the adaptive arm with its round costs refreshed after "
                      "each rollout from the rollout's own seconds, as an async run with "
                      "--drafter.refresh_weight=WEIGHT does (from the same calibration)")
  parser.add_argument("--recalibrate", default="", metavar="N,N,...",
                      help="extra adaptive arms, one per value, each calibrated anew with "
                      "that many passes (--drafter.calibration_repeats)")
  parser.add_argument("--set", action="append", default=[], metavar="--SECTION.FIELD=VALUE")
  return parser.parse_args(argv)


class Arm:
  """One rollout program and the train state it reads (the adaptive arm's controller
  is carried from rollout to rollout)."""

  refresh_weight = 0.0  # > 0: the table refreshed from each rollout's seconds

  def __init__(self, name: str, base: Session, models, drafter_overrides: dict):
    # A session per arm from the same config but for the drafter: the same prompts,
    # rngs and warm-started models.
    config = dataclasses.replace(base.config, drafter=dataclasses.replace(
        base.config.drafter, **drafter_overrides))
    session = Session(config, log=base.log)
    self.name, self.session = name, session
    started = time.perf_counter()
    drafter, online = session.drafter_for(models)
    self.mesh, _ = session.meshes()
    self.state = session.initial_state(models, online, self.mesh)  # adaptive: calibrates
    self.setup_seconds = time.perf_counter() - started
    self.program = build_program(
        nnx.split(models.policy)[0], models.policy.config, session.task, session.learner,
        session.rollout_config, self.mesh, self.state, prompt_width=session.prompt_width,
        drafter=drafter, online=online, spec=session.spec if drafter is not None else None,
        engine=session.engine)

  def roll_out(self, step: int) -> tuple[dict, float]:
    prompts = prompts_on_mesh(self.session.step_prompts(step), self.mesh)
    before = self.state.controller
    started = time.perf_counter()
    trajectories = jax.block_until_ready(
        self.program.rollout_jit(self.state, prompts, self.session.step_rng(step)))
    seconds = time.perf_counter() - started
    record = {k: np.asarray(v).tolist() for k, v in jax.device_get(rollout_metrics(
        trajectories, self.session.rollout_config.sampling.max_new_tokens)).items()}
    if trajectories.controller is not None:
      counters = step_counters(before, trajectories.controller)
      record.update({k: np.asarray(v).tolist() for k, v in jax.device_get(controller_metrics(
          trajectories.controller, counters)).items()})
      # What the table the rollout chose with predicted for it (one batch shard's share
      # of the rounds: the shards decode side by side), against what it took.
      shards = data_parallel_size(self.mesh)
      rounds_SxW = np.asarray(jax.device_get(counters["shape_rounds_SxW"]))
      table, fixed = jax.device_get((before.cost_SxW, before.fixed_seconds))
      record["predicted_seconds"] = float(fixed + np.sum(rounds_SxW / shards * table))
      controller = trajectories.controller
      if self.refresh_weight and step > 0:  # step 0's first rollout compiled its program
        controller = refreshed(controller, rounds_SxW, seconds, weight=self.refresh_weight,
                               shards=shards)
      self.state = self.state.replace(controller=controller)
    return record, seconds

  def step_seconds(self, step: int) -> float:
    """Seconds of the whole sync RL step on a copy of the state (the step donates it)."""
    prompts = prompts_on_mesh(self.session.step_prompts(step), self.mesh)
    state = jax.tree.map(jnp.copy, self.state)
    started = time.perf_counter()
    jax.block_until_ready(self.program.rl_step(state, prompts, self.session.step_rng(step)))
    return time.perf_counter() - started


def controller_report(records: list[dict], seconds: list[float], labels) -> dict:
  """An adaptive arm's choices over the timed steps, its last round-cost table, and how
  far its table's prediction of each rollout's seconds was from the rollout's own."""
  errors = [abs(r["predicted_seconds"] / s - 1) for r, s in zip(records, seconds)]
  return dict(
      shape_labels=labels,
      shape_by_width_per_step=[[labels[i] if i >= 0 else None for i in r["inloop_shape_by_width"]]
                               for r in records],
      rounds_by_shape_and_width={label: np.sum(
          [r[f"inloop_rounds_{label}"] for r in records], axis=0).tolist() for label in labels},
      exploration_rounds_per_step=[r["inloop_exploration_rounds"] for r in records],
      round_seconds_ms={label: [1e3 * x for x in records[-1][f"inloop_round_seconds_{label}"]]
                        for label in labels},
      acceptance_per_position=records[-1]["inloop_acceptance"],
      predicted_seconds=[r["predicted_seconds"] for r in records],
      prediction_error_median=statistics.median(errors),
      prediction_error_range=[min(errors), max(errors)])


def preset_shapes(name: str) -> list[str]:
  """Overrides giving the demo preset the policy and draft model shapes of ``name``."""
  preset = PRESETS[name]
  shape = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
           "head_dim")
  return ([f"--policy.{f}={getattr(preset.policy, f)}" for f in shape]
          + [f"--drafter.model.{f}={getattr(preset.drafter.model, f)}" for f in shape])


def main(argv=None) -> int:
  args = _parse(argv)
  sizes = {"tiny": preset_shapes("tiny"), "demo": [], "small": common.SMALL_DEMO,
           "medium": spec_pair.experiment_overrides("medium", own_task=False)}
  overrides = sizes[args.policy] + [
      "--output.progress=false", "--output.plots=false", f"--output.directory={args.out}",
      f"--rl.prompts_per_step={args.prompts_per_step}", "--rl.engine.compaction=true",
      f"--rl.engine.num_slots={args.num_slots}", f"--drafter.num_draft_tokens={args.k}"]
  if args.task == "longtail":
    overrides += ["--task.name=longtail_arithmetic", "--task.min_digits=1",
                  "--task.max_digits=16", f"--task.tail_exponent={args.tail_exponent}"]
  log = lambda message: print(message, file=sys.stderr, flush=True)
  base = Session(experiment_config("demo", overrides + args.set), log=log)
  if args.policy == "medium" and args.drafter_data == "rollouts":
    # The pair's target; its drafter distilled on the target's own rollouts of this task.
    spec_pair.use_as_warm_start(base, *spec_pair.load_or_distill_on_rollouts(
        base.task, "medium", sampling=base.rollout_config.sampling))
  elif args.policy == "medium":  # its drafter distilled on this task's worked solutions
    spec_pair.use_as_warm_start(base, *spec_pair.load_or_distill_for_task(
        base.task, "medium", steps=args.distill_steps))
  models = base.warm_start()
  trees = tuple(t for t in args.trees.split(",") if t)
  specs = {"plain": dict(kind="none")}
  fixed = (range(1, args.k + 1) if not args.fixed else []
           if args.fixed == "none" else [int(k) for k in args.fixed.split(",")])
  specs.update({f"chain_k{k}": dict(num_draft_tokens=k) for k in fixed})
  for i, passes in enumerate(int(n) for n in args.recalibrate.split(",") if n):
    specs[f"adaptive_r{passes}_{i}"] = dict(adaptive=True, adaptive_trees=trees,
                                            calibration_repeats=passes)
  specs["adaptive"] = dict(adaptive=True, adaptive_trees=trees)
  arms = [Arm(name, base, models, spec) for name, spec in specs.items()]
  forced_ks = [int(k) for k in args.forced.split(",") if k]
  for k in forced_ks:  # the adaptive arm's program and controller, its shape pinned
    forced = copy.copy(arms[-1])
    labels = shape_labels(forced.state.controller)
    label = f"chain_k{k}" if k else "plain"
    forced.name = f"adaptive_forced_{label}"
    forced.state = forced.state.replace(controller=forced.state.controller.replace(
        force=jnp.int32(labels.index(label))))
    arms.insert(len(arms) - 1, forced)
  if args.refresh:  # the adaptive arm's program and calibration, its table refreshed
    fresh = copy.copy(arms[-1])
    fresh.name, fresh.refresh_weight = "adaptive_refreshed", args.refresh
    arms.insert(len(arms) - 1, fresh)
  for step in range(args.warmup):
    for arm in arms:
      arm.roll_out(step)
    if args.step_share:
      arms[-1].step_seconds(step)  # compiles the whole step
  seconds = {arm.name: [] for arm in arms}
  records = {arm.name: [] for arm in arms}
  step_seconds = []
  for step in range(args.warmup, args.warmup + args.steps):
    shift = step % len(arms)  # a rotating order: drifting load hits every arm alike
    for arm in arms[shift:] + arms[:shift]:
      record, took = arm.roll_out(step)
      log(f"step {step} {arm.name}: {took:.2f} s")
      seconds[arm.name].append(took)
      records[arm.name].append(record)
    if args.step_share:  # after the timed rollouts: it advances nothing the arms carry
      step_seconds.append(arms[-1].step_seconds(step))
  report = {"benchmark": "bench_rl_inloop", "args": vars(args),
            "policy_params": models.policy.config.num_params(), "load": os.getloadavg(),
            "arms": {}}
  for arm in arms:
    speedups = [p / s for p, s in zip(seconds["plain"], seconds[arm.name])]
    report["arms"][arm.name] = {
        "generation_seconds_median": statistics.median(seconds[arm.name]),
        # The arm's train state built (the adaptive arm's: its calibration, compiles
        # and all), before its first rollout; the forced and refreshed arms are copies
        # of the adaptive one and report its figure.
        "setup_seconds": arm.setup_seconds,
        "generation_seconds": seconds[arm.name],
        "speedup_vs_plain_median": statistics.median(speedups),
        "speedup_vs_plain_range": [min(speedups), max(speedups)],
        "acceptance_length": statistics.median(
            r["acceptance_length"] for r in records[arm.name]),
        "response_length_mean": statistics.median(
            r["response_length_mean"] for r in records[arm.name]),
        # The round-cost breakdown: rounds and tokens per width (summed over the timed
        # steps) and seconds per round, to tell a shape's cost from how many rounds ran.
        "rounds_by_width": np.sum([r["rounds_by_width"] for r in records[arm.name]],
                                  axis=0).tolist(),
        "tokens_by_width": np.sum([r["tokens_by_width"] for r in records[arm.name]],
                                  axis=0).tolist(),
        "ms_per_round": 1e3 * sum(seconds[arm.name]) / max(
            1, sum(sum(r["rounds_by_width"]) for r in records[arm.name]))}
  adaptive = arms[-1]
  # The in-loop program pinned to a shape over that shape's own program (plain: the
  # plain rollout), step by step: what choosing inside the loop costs at a fixed shape.
  pairs = {f"chain_k{k}" if k else "plain": f"adaptive_forced_{f'chain_k{k}' if k else 'plain'}"
           for k in forced_ks}
  report["inloop_over_fixed"] = {
      own: statistics.median([a / b for a, b in zip(seconds[forced], seconds[own])])
      for own, forced in pairs.items() if own in seconds}
  labels = shape_labels(adaptive.state.controller)
  controlled = [arm for arm in arms if arm.state.controller is not None
                and not arm.name.startswith("adaptive_forced")]
  for arm in controlled:
    report["arms"][arm.name].update(controller_report(records[arm.name], seconds[arm.name],
                                                      labels))
    report["arms"][arm.name]["calibration_repeats"] = (
        arm.session.config.drafter.calibration_repeats)
  if "adaptive_refreshed" in seconds:
    ratios = [a / r for a, r in zip(seconds["adaptive"], seconds["adaptive_refreshed"])]
    report["refreshed_vs_adaptive"] = statistics.median(ratios)
    report["refreshed_vs_adaptive_range"] = [min(ratios), max(ratios)]
  if step_seconds:
    report["adaptive_step_seconds"] = step_seconds
    report["generation_share_of_step"] = statistics.median(
        [r / s for r, s in zip(seconds["adaptive"], step_seconds)])
  fixed = [name for name in seconds if name.startswith("chain_")]
  if fixed:
    best = min(fixed, key=lambda name: statistics.median(seconds[name]))
    report["best_fixed"] = best
    vs_best = {arm.name: statistics.median([b / a for a, b in zip(seconds[arm.name],
                                                                  seconds[best])])
               for arm in controlled}
    report["adaptive_vs_best_fixed"] = vs_best["adaptive"]
    report["vs_best_fixed_by_arm"] = vs_best
  report["adaptive_vs_plain"] = report["arms"]["adaptive"]["speedup_vs_plain_median"]
  print(json.dumps(report, indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
