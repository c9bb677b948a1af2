"""The RL rollout's cost of carrying the in-loop controller when it is pinned to plain
decoding, split into a part per round and a part per rollout.

``bench_rl_inloop.py --forced 0`` gives the whole ratio over a run whose steps differ
in length, so a cost per round and a cost per rollout mix. Here one short and one long
step (the fewest and the most rounds among the first 38 steps' plain rollouts) are each
rolled out ``--repeats`` times by both arms, interleaved (the order alternating): the
medians of the two steps give each arm a slope (seconds per round) and an intercept
(seconds a rollout spends apart from its rounds: prefill, stage changes, the loop's
setup). The arms are ``bench_rl_inloop``'s: the sync RL step's rollout program without
a drafter ("plain"), and the in-loop adaptive program (menu plain + chains 1..K) with
its controller forced to plain ("pinned"); same warm-started weights, prompts and rngs,
slot compaction on (widths 4 / 2 / 1).

  python experiments/bench_rl_plain_overhead_split.py [--policy tiny] [--k 4]
      [--repeats 25] [--set=--drafter.kind=ngram ...]

Prints one JSON object: the two steps' rounds; per arm the two medians, the slope and
the intercept; pinned seconds over plain per repeat at each step (median, min, max).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rl_inloop as rl  # noqa: E402
import common  # noqa: E402


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--policy", choices=("tiny", "demo", "small"), default="tiny")
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=25)
  parser.add_argument("--out", default="runs/bench_rl_plain_overhead_split")
  parser.add_argument("--set", action="append", default=[], metavar="--SECTION.FIELD=VALUE")
  args = parser.parse_args(argv)
  sizes = {"tiny": rl.preset_shapes("tiny"), "demo": [], "small": common.SMALL_DEMO}
  overrides = sizes[args.policy] + [
      "--output.progress=false", "--output.plots=false", f"--output.directory={args.out}",
      "--rl.prompts_per_step=8", "--rl.engine.compaction=true", "--rl.engine.num_slots=4",
      f"--drafter.num_draft_tokens={args.k}", "--task.name=longtail_arithmetic",
      "--task.min_digits=1", "--task.max_digits=16", "--task.tail_exponent=1.0"]
  log = lambda message: print(message, file=sys.stderr, flush=True)
  base = rl.Session(rl.experiment_config("demo", overrides + args.set), log=log)
  models = base.warm_start()
  plain = rl.Arm("plain", base, models, dict(kind="none"))
  pinned = rl.Arm("pinned", base, models, dict(adaptive=True))
  labels = rl.shape_labels(pinned.state.controller)
  pinned.state = pinned.state.replace(controller=pinned.state.controller.replace(
      force=jnp.int32(labels.index("plain"))))
  arms = (plain, pinned)
  for step in range(2):  # compiles
    for arm in arms:
      arm.roll_out(step)
  rounds = {step: sum(plain.roll_out(step)[0]["rounds_by_width"]) for step in range(2, 40)}
  steps = (min(rounds, key=rounds.get), max(rounds, key=rounds.get))
  seconds = {(arm.name, step): [] for arm in arms for step in steps}
  for repeat in range(args.repeats):
    for step in steps:
      for arm in (arms if repeat % 2 else arms[::-1]):
        seconds[(arm.name, step)].append(arm.roll_out(step)[1])
  short, long_ = steps
  report = {"benchmark": "bench_rl_plain_overhead_split", "args": vars(args),
            "rounds": {"short": rounds[short], "long": rounds[long_]}, "arms": {}}
  for arm in arms:
    at_short, at_long = (statistics.median(seconds[(arm.name, s)]) for s in steps)
    slope = (at_long - at_short) / (rounds[long_] - rounds[short])
    report["arms"][arm.name] = dict(
        short_ms=1e3 * at_short, long_ms=1e3 * at_long, per_round_us=1e6 * slope,
        per_rollout_ms=1e3 * (at_short - slope * rounds[short]))
  for name, step in (("short", short), ("long", long_)):
    ratios = [b / a for a, b in zip(seconds[("plain", step)], seconds[("pinned", step)])]
    report[f"pinned_seconds_over_plain_{name}"] = dict(median=statistics.median(ratios),
                                               min=min(ratios), max=max(ratios))
  print(json.dumps(report, indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
