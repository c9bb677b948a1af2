"""``sj.generate``'s adaptive speculation: the host controller vs the in-loop one.

The host controller (``SpecConfig(adaptive=True)``, ``ConcurrencyAwareController``)
chooses a draft shape per live width between batches of rounds, each batch its own
program call; the in-loop controller (``speculative.inloop_rollout.generate_in_loop``)
chooses per round inside one program, from round costs calibrated at the start on this
machine. Both carry what they measured from call to call, as an RL run would. Arms,
interleaved per repeat in a rotating order on the same prompts and seed (each repeat
its own seed): plain decoding, fixed chains (--fixed), host adaptive, in-loop adaptive,
and the in-loop program pinned to plain decoding (what adaptive costs when plain is
chosen); all with slot compaction. The drafter is the pair's draft model distilled on
the target's own rollouts of the long tail (``spec_pair.load_or_distill_on_rollouts``,
cached under artifacts/). Progress goes to stderr; stdout is one JSON object: per arm
the median seconds and the per-repeat speed-up over plain decoding (median and range).

  python experiments/bench_generate_controllers.py [--size small|medium] [--prompts 16]
      [--k 4] [--fixed 2,3,4] [--repeats 5] [--warmup 1] [--max-digits 16] [--num-slots 4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import spec_pair  # noqa: E402

import specrl_jax as sj  # noqa: E402
from specrl_jax.rl.app.experiment import experiment_config  # noqa: E402
from specrl_jax.rl.app.train_command import Session  # noqa: E402
from specrl_jax.sampling import set_program_cache_size  # noqa: E402
from specrl_jax.speculative.concurrency import ConcurrencyAwareController  # noqa: E402
from specrl_jax.speculative.inloop import InLoopState, fade  # noqa: E402
from specrl_jax.speculative.inloop_calibration import calibrate  # noqa: E402
from specrl_jax.speculative.inloop_rollout import generate_in_loop, in_loop_config  # noqa: E402


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", choices=("small", "medium"), default="medium")
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--fixed", default="2,3,4")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=4,
                      help="at most this many untimed passes over the arms, until one "
                      "compiles nothing (the engine compiles a width's program when a "
                      "rollout first reaches it)")
  parser.add_argument("--max-digits", type=int, default=16)
  parser.add_argument("--num-slots", type=int, default=4)
  args = parser.parse_args(argv)

  # The RL rollout's sampling on the long tail (as bench_rl_inloop's), so the drafter
  # distilled on the target's rollouts there is the one cached for it.
  session = Session(experiment_config("demo", [
      "--task.name=longtail_arithmetic", "--task.min_digits=1",
      f"--task.max_digits={args.max_digits}", "--output.progress=false"]), log=lambda _: None)
  task, sampling = session.task, session.rollout_config.sampling
  with contextlib.redirect_stdout(sys.stderr):  # training logs stay out of the JSON
    target, draft = spec_pair.load_or_distill_on_rollouts(task, args.size, sampling=sampling)
  drafter = sj.drafters.DraftModel(draft)
  engine = sj.EngineConfig(num_slots=args.num_slots, compaction=True)
  rng = np.random.default_rng(7)
  prompts = [task.sample(rng).prompt_ids(task.tokenizer) for _ in range(args.prompts)]
  spec = sj.SpecConfig(num_draft_tokens=args.k, adaptive=True)
  config = in_loop_config(spec)
  start = time.perf_counter()
  table = calibrate(target, prompts, sampling=sampling, drafter=drafter, spec=spec,
                    engine=engine, rng=jax.random.key(99))
  progress(f"calibrated in {time.perf_counter() - start:.0f} s: " + ", ".join(
      f"{label} " + "/".join(f"{1e3 * x:.1f}" for x in row) + " ms"
      for label, row in zip(config.labels, table.cost_SxW)) + f" at widths {table.widths}")
  carried = {"host": ConcurrencyAwareController(k_max=args.k),
             "inloop": InLoopState.initial(config, table.cost_SxW)}

  def plain(seed):
    return sj.generate(target, prompts, sampling=sampling, rng=jax.random.key(seed),
                       engine=engine)

  def fixed(k):
    return lambda seed: sj.generate(target, prompts, sampling=sampling,
                                    rng=jax.random.key(seed), drafter=drafter,
                                    spec=sj.SpecConfig(num_draft_tokens=k), engine=engine)

  def host(seed):
    return sj.generate(target, prompts, sampling=sampling, rng=jax.random.key(seed),
                       drafter=drafter, spec=spec, engine=engine, controller=carried["host"])

  def in_loop(seed):
    before = carried["inloop"]
    out, after = generate_in_loop(target, prompts, sampling=sampling, rng=jax.random.key(seed),
                                  drafter=drafter, spec=spec, controller=before, engine=engine)
    carried["inloop"] = fade(config, before, after)
    return out

  pinned = InLoopState.initial(config, table.cost_SxW).replace(force=jnp.int32(0))

  def in_loop_plain(seed):
    return generate_in_loop(target, prompts, sampling=sampling, rng=jax.random.key(seed),
                            drafter=drafter, spec=spec, controller=pinned, engine=engine)[0]

  runs = {"plain": plain, **{f"chain_k{k}": fixed(int(k)) for k in args.fixed.split(",")},
          "host_adaptive": host, "inloop_adaptive": in_loop, "inloop_pinned_plain": in_loop_plain}
  # Seven arms' programs at every width: more than generate's default cache keeps, so
  # calls would evict each other's programs and compile them again every repeat.
  set_program_cache_size(128)
  compiles = common.CompileCounter()
  for seed in range(args.warmup):  # compiles, and both controllers' first measurements
    start, before, per_arm = time.perf_counter(), compiles.count, {}
    for name, run in runs.items():
      count = compiles.count
      jax.block_until_ready(run(1000 + seed).tokens)
      per_arm[name] = compiles.count - count
    progress(f"warm-up {seed + 1}: {time.perf_counter() - start:.0f} s, "
             f"{compiles.count - before} programs compiled: "
             + ", ".join(f"{name} {n}" for name, n in per_arm.items()))
    if compiles.count == before:
      break
  names = list(runs)
  seconds = {name: [] for name in names}
  compiled_seconds = 0.0
  for repeat in range(args.repeats):
    # A rotating order: no arm always runs first (or after the same neighbour).
    for name in names[repeat % len(names):] + names[:repeat % len(names)]:
      start, compiling = time.perf_counter(), compiles.seconds
      jax.block_until_ready(runs[name](repeat).tokens)
      # A width first reached now compiles now: that time is not the arm's.
      compiled_seconds += compiles.seconds - compiling
      seconds[name].append(time.perf_counter() - start - (compiles.seconds - compiling))
    progress(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
        f"{name} {seconds[name][-1]:.2f} s" for name in names))
  report = {"benchmark": "bench_generate_controllers", "args": vars(args),
            "calibrated_round_ms": {label: (1e3 * table.cost_SxW[s]).round(2).tolist()
                                    for s, label in enumerate(config.labels)},
            "widths": list(table.widths), "compile_seconds_taken_out": compiled_seconds,
            "arms": {}}
  for name, values in seconds.items():
    speedups = [p / s for p, s in zip(seconds["plain"], values)]
    report["arms"][name] = {"seconds_median": statistics.median(values), "seconds": values,
                            "speedup_vs_plain_median": statistics.median(speedups),
                            "speedup_vs_plain_range": [min(speedups), max(speedups)]}
  fixed_names = [n for n in seconds if n.startswith("chain_")]
  best = min(fixed_names, key=lambda n: statistics.median(seconds[n]))
  report["best_fixed"] = best
  for name in ("host_adaptive", "inloop_adaptive"):
    report[f"{name}_vs_best_fixed"] = statistics.median(
        [b / a for a, b in zip(seconds[name], seconds[best])])
  ratios = [h / i for h, i in zip(seconds["host_adaptive"], seconds["inloop_adaptive"])]
  report["inloop_speedup_over_host"] = {"median": statistics.median(ratios),
                                        "range": [min(ratios), max(ratios)]}
  overhead = [p / s for s, p in zip(seconds["plain"], seconds["inloop_pinned_plain"])]
  report["inloop_pinned_plain_time_over_plain"] = {"median": statistics.median(overhead),
                                                   "range": [min(overhead), max(overhead)]}
  report["inloop_schedule_by_width"] = {
      str(w): {label: int(carried["inloop"].rounds_SxW[s, i])
               for s, label in enumerate(config.labels) if carried["inloop"].rounds_SxW[s, i]}
      for i, w in enumerate(table.widths)}
  common.print_json(report)
  return 0


def progress(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
  raise SystemExit(main())
