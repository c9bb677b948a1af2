"""Where the in-loop program pinned to plain decoding spends more than plain decoding:
``sj.generate`` (plain) against ``generate_in_loop`` with the controller forced to plain
on the same prompts and rngs, interleaved, each compaction stage timed apart, so a
per-round cost (the widest stage, hundreds of rounds) shows apart from per-stage and
per-call ones (the narrow stages' few rounds, and the time outside the rounds).

A tiny policy (the tiny preset's shapes, random weights, peaked), 8 prompts x
``--group`` samples through 4 slots (continuous batching), the third most frequent greedy
token as the stop token so responses end at different rounds, the n-gram drafter (no KV
layers, no prefill: what remains is the in-loop machinery itself), menu plain + chains
1..K.

  python experiments/bench_inloop_plain_overhead.py [--k 4] [--repeats 30] [--group 8]

Prints one JSON object: per arm the median seconds of the whole call, of the rounds, of
what lies outside them, per round at each width, and the rounds per width; and the
in-loop arm's total over plain's per repeat (median and range).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax import drafters, testing
from specrl_jax.config import SamplingParams, SpecConfig
from specrl_jax.rl.app.experiment import PRESETS
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.generate import generate
from specrl_jax.speculative.inloop import InLoopState
from specrl_jax.speculative.inloop_calibration import engine_widths
from specrl_jax.speculative.inloop_rollout import generate_in_loop, in_loop_config

TINY = PRESETS["tiny"].policy.model_config()  # what `specrl train --preset=tiny` trains


def _timings(out) -> dict:
  stats = out.stats["compaction"]
  seconds_W = np.asarray(stats["seconds_by_width"], np.float64)
  rounds_W = np.asarray(stats["rounds_by_width"], np.float64)
  return dict(total=out.stats["seconds"], rounds=float(seconds_W.sum()),
              per_round_W=seconds_W / np.maximum(rounds_W, 1), rounds_W=rounds_W)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--group", type=int, default=8)
  args = parser.parse_args(argv)
  target = testing.peaked_random_model(TINY, seed=0)
  rng = np.random.default_rng(0)
  distinct = [[int(t) for t in rng.integers(3, 20, size=12)] for _ in range(8)]
  counts = collections.Counter(t for response in testing.greedy_reference(target, distinct, 40)
                               for t in response)
  stop = counts.most_common(3)[2][0]
  prompts = distinct * args.group
  sampling = SamplingParams(temperature=1.0, max_new_tokens=160, stop_token_ids=(stop,))
  engine = EngineConfig(page_size=16, num_slots=4, compaction=True, compaction_min_width=1)
  spec = SpecConfig(num_draft_tokens=args.k, adaptive=True)
  drafter = drafters.NGram(n=3)
  config = in_loop_config(spec)
  widths = engine_widths(target, prompts, sampling, engine, drafter, spec)
  pinned = InLoopState.initial(config, np.ones((len(config.shapes), len(widths)))).replace(
      force=jnp.int32(0))
  arms = {
      "plain": lambda key: generate(target, prompts, sampling=sampling, engine=engine, rng=key),
      "inloop_pinned_plain": lambda key: generate_in_loop(
          target, prompts, sampling=sampling, rng=key, drafter=drafter, spec=spec,
          controller=pinned, engine=engine)[0]}
  runs = {name: [] for name in arms}
  for repeat in range(args.repeats + 2):  # two untimed: compiles and first runs
    order = list(arms) if repeat % 2 else list(arms)[::-1]
    for name in order:
      timing = _timings(arms[name](jax.random.key(repeat)))
      if repeat >= 2:
        runs[name].append(timing)
  report = {"benchmark": "bench_inloop_plain_overhead", "args": vars(args), "widths": widths,
            "arms": {}}
  for name, rows in runs.items():
    report["arms"][name] = dict(
        total_ms=1e3 * statistics.median(r["total"] for r in rows),
        rounds_ms=1e3 * statistics.median(r["rounds"] for r in rows),
        outside_ms=1e3 * statistics.median(r["total"] - r["rounds"] for r in rows),
        per_round_us_by_width=(1e6 * np.median([r["per_round_W"] for r in rows], axis=0)).tolist(),
        rounds_by_width=np.median([r["rounds_W"] for r in rows], axis=0).tolist())
  ratios = [b["total"] / a["total"] for a, b in zip(runs["plain"], runs["inloop_pinned_plain"])]
  report["inloop_over_plain_median"] = statistics.median(ratios)
  report["inloop_over_plain_range"] = [min(ratios), max(ratios)]
  print(json.dumps(report, indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
