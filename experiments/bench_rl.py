"""RL step time, plain vs speculative rollouts, sync vs async, measured in one run.

On the demo's first warm-started policy and draft model (``--policy tiny``, the 1.2M
sizes of ``common.SMALL_DEMO``: trained here, or
loaded from --warm-from) or on one of experiments/spec_pair.py's SFT targets and its
distilled draft model (``--policy medium``: 38M parameters, large enough that, as for a
real policy, verifying a few tokens costs little more than decoding one on a CPU;
``--policy large``: ~0.8B, for an accelerator), with the same prompts, seeds and
engine shape for every arm:

  sync  (all devices, one mesh): the fused one-call ``rl_step`` time, and a breakdown
        from the same stages jitted one by one: generation (rollout + rewards),
        log-prob (the trainer's recomputation), train (the GRPO update), drafter (the
        extra update time of the online drafter loss: speculative train minus plain
        train), sync (0: the rollout reads the learner's weights in place);
  async (rollout and train on disjoint halves of the devices): samples/s at
        max_policy_lag 1 and 2, with the measured weight-push (sync) time.

The learner runs its log-prob pass in every arm (``--learner.skip_log_prob_pass=false``)
so the figures compare with earlier runs. ``--log-prob-pass-comparison`` instead runs
only the sync plain arm twice, with the pass and with the update's own forward giving
the log-probs (``skip_log_prob_pass``), and reports what skipping saves per step and
the training-inference mismatch both measured.

``--task=longtail`` runs on the longtail_arithmetic task (operand digit counts
P(d) ~ d ** -tail_exponent on 1..16: long-tailed response lengths) with one engine slot
per sample and slot compaction in both arms (``--no-compaction``, ``--num-slots`` to
change), and reports the responses' mean and max length and the rollouts' rounds per
compaction width and tail share. A tiny policy is warm-started on that task; a
spec_pair policy keeps its own training (2-4 digits), so the tail runs past it.

``--draft-shapes`` compares draft shapes instead: plain decoding, fixed chains and the
in-loop adaptive shape on the sync step's own rollout program, interleaved step by step
on the same prompts and seeds, with slot compaction (experiments/bench_rl_inloop.py,
which this mode runs with --policy, --task, --tail-exponent, --steps, --warmup,
--prompts-per-step, --num-slots and --set; --policy medium's drafter is distilled on the
target's own rollouts of the task; one device).

Medians over --steps timed steps after --warmup compiled ones. Prints one JSON object.

  python experiments/bench_rl.py [--devices=2] [--steps=6] [--warm-from=runs/demo]
      [--policy=tiny|medium|large] [--prompts-per-step=N] [--log-prob-pass-comparison]
      [--task=arithmetic|longtail] [--tail-exponent=1.0] [--compaction|--no-compaction]
      [--num-slots=N] [--sync-only] [--set=--SECTION.FIELD=VALUE ...]
  python experiments/bench_rl.py --draft-shapes [--policy=tiny|medium] [--task=longtail]
      [--steps=10] [--warmup=2] [--prompts-per-step=8] [--num-slots=4]
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--warm-from", default="runs/demo")
  parser.add_argument("--out", default=None,
                      help="default: runs/bench_rl[_POLICY][_longtail]")
  parser.add_argument("--policy", choices=("tiny", "medium", "large"), default="tiny")
  parser.add_argument("--prompts-per-step", type=int, default=None,
                      help="default: the demo's 16 (tiny), 4 (a spec_pair policy)")
  parser.add_argument("--log-prob-pass-comparison", action="store_true",
                      help="only sync plain, with and without the learner's log-prob pass")
  parser.add_argument("--task", choices=("arithmetic", "longtail"), default="arithmetic",
                      help="the policy's own arithmetic task, or longtail_arithmetic")
  parser.add_argument("--tail-exponent", type=float, default=1.0,
                      help="--task=longtail: P(d) ~ d ** -tail_exponent on 1..16 digits")
  parser.add_argument("--compaction", action=argparse.BooleanOptionalAction, default=None,
                      help="slot compaction in both arms (default: on with --task=longtail)")
  parser.add_argument("--num-slots", type=int, default=None,
                      help="engine slots per rollout shard (default: the experiment's; "
                      "0, one per sample, with --task=longtail)")
  parser.add_argument("--sync-only", action="store_true", help="skip the async arms")
  parser.add_argument("--draft-shapes", action="store_true",
                      help="plain vs fixed chains vs the in-loop adaptive shape, interleaved "
                      "per step (experiments/bench_rl_inloop.py)")
  parser.add_argument("--set", action="append", default=[], metavar="--SECTION.FIELD=VALUE",
                      help="an experiment override, e.g. --set=--rl.group_size=4")
  return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1" if ARGS.draft_shapes else str(ARGS.devices))

import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from specrl_jax.rl.loop.async_pipeline import AsyncPipeline  # noqa: E402
from specrl_jax.rl.app.experiment import experiment_config  # noqa: E402
from specrl_jax.rl.loop.sync import build_program, prompts_on_mesh  # noqa: E402
from specrl_jax.rl.app.train_command import Session  # noqa: E402
from specrl_jax.sampling.compaction import stage_widths  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import spec_pair  # noqa: E402


def _timed(function, *args):
  start = time.perf_counter()
  out = jax.block_until_ready(function(*args))
  return out, time.perf_counter() - start


def _median(values):
  return statistics.median(values) if values else float("nan")


def bench_sync(session: Session, models, kind: str, steps: int, warmup: int,
               skip_log_prob_pass: bool = False) -> dict:
  config = dataclasses.replace(session.config, drafter=dataclasses.replace(
      session.config.drafter, kind=kind))
  session.config = config
  session.learner = dataclasses.replace(session.learner, skip_log_prob_pass=skip_log_prob_pass)
  drafter, online = session.drafter_for(models)
  mesh, _ = session.meshes()
  state = session.initial_state(models, online, mesh)
  program = build_program(nnx.split(models.policy)[0], models.policy.config, session.task,
                          session.learner, session.rollout_config, mesh, state,
                          prompt_width=session.prompt_width, drafter=drafter, online=online,
                          spec=session.spec if drafter is not None else None,
                          engine=session.engine)
  stages = {name: [] for name in ("generation", "log_prob", "train", "fused_step")}
  acceptance, tokens, mismatch_mean, mismatch_max = [], [], [], []
  tail = {name: [] for name in ("response_length_mean", "response_length_max",
                                "tail_round_share", "slot_utilization", "truncated_fraction")}
  rounds_by_width, slots = [], 0
  for step in range(warmup + steps):
    prompts = prompts_on_mesh(session.step_prompts(step), mesh)
    rng = session.step_rng(step)
    copy = jax.device_put(jax.tree.map(jnp.copy, state), program.train_step.state_shardings)
    trajectories, generation = _timed(program.rollout_jit, state, prompts, rng)
    batch = trajectories.batch
    old, log_prob = _timed(program.log_prob_step, state.compute_params(), batch.tokens,
                           batch.response_mask)
    (_, _), train = _timed(program.train_step.jitted, state, program.learn.batch(trajectories, old))
    (state, metrics), fused = _timed(program.rl_step, copy, prompts, rng)
    if step >= warmup:
      for name, value in (("generation", generation), ("log_prob", log_prob), ("train", train),
                          ("fused_step", fused)):
        stages[name].append(value)
      acceptance.append(float(metrics["acceptance_length"]))
      tokens.append(int(metrics["generated_tokens"]))
      mismatch_mean.append(float(metrics["logprob_mismatch_mean"]))
      mismatch_max.append(float(metrics["logprob_mismatch_max"]))
      for name, values in tail.items():
        values.append(float(metrics[name]))
      rounds_by_width.append([int(n) for n in jax.device_get(metrics["rounds_by_width"])])
      slots = int(metrics["rollout_slots"]) // (mesh.shape["data"] * mesh.shape["fsdp"])
  result = {name: _median(values) for name, values in stages.items()}
  # The tail: each step's mean response against its longest, and the rollout rounds
  # run at each compaction width (widest first; summed over the rollout shards), per
  # timed step.
  result.update({name: _median(values) for name, values in tail.items()})
  result.update(response_length_max=max(tail["response_length_max"], default=float("nan")),
                response_length_mean_over_max=_median(
                    [m / x for m, x in zip(tail["response_length_mean"],
                                           tail["response_length_max"])]),
                rounds_by_width_per_step=rounds_by_width, slots_per_shard=slots,
                compaction_widths=list(stage_widths(slots, session.engine.compaction_min_width
                                                    if session.engine.compaction else 0)))
  result.update(acceptance_length=_median(acceptance), generated_tokens=_median(tokens),
                logprob_mismatch_mean=_median(mismatch_mean),
                logprob_mismatch_max=max(mismatch_max, default=float("nan")),
                samples_per_second=session.rollout_config.group_size
                * session.rollout_config.prompts_per_step / result["fused_step"])
  return result


def bench_async(session: Session, models, kind: str, lag: int, steps: int, warmup: int) -> dict:
  config = session.config
  session.config = dataclasses.replace(config, drafter=dataclasses.replace(config.drafter,
                                                                           kind=kind))
  drafter, online = session.drafter_for(models)
  devices = jax.devices()
  half = len(devices) // 2
  from specrl_jax.parallel.mesh import make_mesh
  rollout_mesh = make_mesh((half, 1, 1), devices=devices[:half])
  train_mesh = make_mesh((len(devices) - half, 1, 1), devices=devices[half:])
  state = session.initial_state(models, online, train_mesh)
  pipeline = AsyncPipeline(nnx.split(models.policy)[0], models.policy.config, session.task,
                           session.learner, session.rollout_config, rollout_mesh=rollout_mesh,
                           train_mesh=train_mesh, state=state, prompt_width=session.prompt_width,
                           max_policy_lag=lag, drafter=drafter, online=online,
                           spec=session.spec if drafter is not None else None,
                           engine=session.engine)
  records = []
  start = None
  for record in pipeline.run(state, first_update=0, num_updates=warmup + steps,
                             prompts_of=session.step_prompts, rng_of=session.step_rng):
    records.append(record.metrics)
    if record.update == warmup - 1:
      start = time.perf_counter()
  seconds = time.perf_counter() - start
  timed = records[warmup:]
  samples = session.rollout_config.group_size * session.rollout_config.prompts_per_step
  return {"samples_per_second": samples * len(timed) / seconds,
          "step_seconds": seconds / len(timed),
          "generation": _median([r["rollout_seconds"] for r in timed]),
          "train": _median([r["train_seconds"] for r in timed]),
          "sync": _median([r["sync_seconds"] for r in timed]),
          "exposed_generation": _median([r["exposed_rollout_seconds"] for r in timed]),
          "acceptance_length": _median([r["acceptance_length"] for r in timed]),
          "max_policy_lag_seen": max(r["policy_lag"] for r in records)}


def _longtail_overrides(args) -> list[str]:
  """The longtail_arithmetic task on 1-16 digits as the experiment's task."""
  return ["--task.name=longtail_arithmetic", "--task.min_digits=1", "--task.max_digits=16",
          f"--task.tail_exponent={args.tail_exponent}"]


def draft_shapes(args) -> int:
  """The --draft-shapes comparison, run by experiments/bench_rl_inloop.py."""
  import bench_rl_inloop
  if args.policy == "large":
    raise SystemExit("--draft-shapes runs --policy tiny (the 1.2M sizes) or medium")
  policy = {"tiny": "small", "medium": "medium"}[args.policy]  # bench_rl_inloop's names
  slots = 4 if args.num_slots is None else args.num_slots
  argv = [f"--policy={policy}", f"--task={args.task}",
          f"--tail-exponent={args.tail_exponent}", f"--steps={args.steps}",
          f"--warmup={args.warmup}", f"--prompts-per-step={args.prompts_per_step or 8}",
          f"--num-slots={slots}"] + [f"--set={item}" for item in args.set]
  if args.out:
    argv.append(f"--out={args.out}")
  return bench_rl_inloop.main(argv)


def main() -> int:
  args = ARGS
  if args.draft_shapes:
    return draft_shapes(args)
  devices = len(jax.devices())
  pair = args.policy != "tiny"
  prompts = args.prompts_per_step or (4 if pair else 16)
  longtail = args.task == "longtail"
  args.out = args.out or ("runs/bench_rl" + (f"_{args.policy}" if pair else "")
                          + ("_longtail" if longtail else ""))
  compaction = longtail if args.compaction is None else args.compaction
  num_slots = 0 if args.num_slots is None and longtail else args.num_slots
  config = experiment_config("demo", [
      f"--rl.mesh={devices},1,1", "--output.progress=false", "--output.plots=false",
      f"--output.directory={args.out}", f"--rl.prompts_per_step={prompts}",
      f"--rl.engine.compaction={str(compaction).lower()}"]
      + common.SMALL_DEMO  # k = 3 on 8 slots; a pair's shapes replace the policy's below
      + (spec_pair.experiment_overrides(args.policy, own_task=not longtail) if pair else [])
      + (_longtail_overrides(args) if longtail else [])
      + ([f"--rl.engine.num_slots={num_slots}"] if num_slots is not None else [])
      + args.set)
  if not pair and not longtail:  # the demo's warm start is for its own task
    warm = os.path.join(args.warm_from, "warm_start")
    if os.path.exists(warm) and not os.path.exists(os.path.join(args.out, "warm_start")):
      shutil.copytree(warm, os.path.join(args.out, "warm_start"))
  log = lambda message: print(message, file=sys.stderr, flush=True)
  session = Session(config, log=log)
  if pair:
    spec_pair.use_as_warm_start(session, *spec_pair.load_or_train(size=args.policy))
  models = session.warm_start()
  report = {"policy": args.policy, "policy_params": models.policy.config.num_params(),
            "devices": devices, "samples_per_step": session.rollout_config.group_size
            * session.rollout_config.prompts_per_step,
            "engine_slots_per_rollout_shard": config.rl.engine.num_slots,
            "compaction": config.rl.engine.compaction,
            "task": dataclasses.asdict(session.task), "overrides": args.set,
            "num_draft_tokens": config.drafter.num_draft_tokens, "timed_steps": args.steps}
  if args.log_prob_pass_comparison:
    for skip, arm in ((False, "sync_plain"), (True, "sync_plain_skip_log_prob_pass")):
      log(f"{arm} ...")
      report[arm] = bench_sync(session, models, "none", args.steps, args.warmup,
                               skip_log_prob_pass=skip)
      log(json.dumps(report[arm]))
    with_pass, skipped = report["sync_plain"], report["sync_plain_skip_log_prob_pass"]
    report["log_prob_pass_saving_seconds"] = with_pass["fused_step"] - skipped["fused_step"]
    report["log_prob_pass_step_speedup"] = with_pass["fused_step"] / skipped["fused_step"]
    print(json.dumps(report, indent=2))
    return 0
  for kind, arm in (("none", "plain"), ("draft_model", "speculative")):
    log(f"sync {arm} ...")
    report[f"sync_{arm}"] = bench_sync(session, models, kind, args.steps, args.warmup)
    log(json.dumps(report[f"sync_{arm}"]))
  plain, spec = report["sync_plain"], report["sync_speculative"]
  spec["drafter"] = max(0.0, spec["train"] - plain["train"])
  spec["train"] = plain["train"]
  for arm in (plain, spec):
    arm["sync"] = 0.0  # colocated: the rollout reads the learner's weights, no copy
    arm.setdefault("drafter", 0.0)
  report["sync_generation_speedup"] = plain["generation"] / spec["generation"]
  report["sync_step_speedup"] = plain["fused_step"] / spec["fused_step"]
  report["sync_generation_share_plain"] = plain["generation"] / (
      plain["generation"] + plain["log_prob"] + plain["train"])
  if devices >= 2 and not args.sync_only:
    for kind, arm in (("none", "plain"), ("draft_model", "speculative")):
      for lag in (1, 2):
        log(f"async {arm} lag {lag} ...")
        report[f"async_{arm}_lag{lag}"] = bench_async(session, models, kind, lag, args.steps,
                                                      args.warmup)
        log(json.dumps(report[f"async_{arm}_lag{lag}"]))
    for lag in (1, 2):
      report[f"async_lag{lag}_speculative_vs_sync_plain_throughput"] = (
          report[f"async_speculative_lag{lag}"]["samples_per_second"]
          / plain["samples_per_second"])
      report[f"async_lag{lag}_vs_sync_throughput"] = {
          arm: report[f"async_{arm}_lag{lag}"]["samples_per_second"]
          / report[f"sync_{arm}"]["samples_per_second"] for arm in ("plain", "speculative")}
  print(json.dumps(report, indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
