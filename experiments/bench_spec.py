"""Speculative vs plain decoding on a predictable target/draft pair, side by side.

Target: a model SFT'd on the arithmetic task (experiments/spec_pair.py; --size small is
4 x 384, medium 6 x 768); drafters: a 1-layer draft model distilled from it, and the
training-free n-gram drafter; with --learned also MTP and EAGLE-3 heads trained
offline for the target (spec_pair.load_or_train_heads). Temperature 1, EOS stops. For batch 1 / 8 / 32: chains
k = 1..7, static trees and adaptive k, acceptance length and tokens/s against plain
decoding timed in the same run: every configuration decodes the same ``--samples``
rollout seeds, interleaved, and its speed-up is the median over seeds of its speed over
plain decoding's on that seed. Also the cost breakdown a
round is made of, timed on the same weights: one target forward over 1 and k + 1
tokens per sequence (verification) and one drafter step.

With ``--lengths longtail`` the prompts are additions whose operands have a
heavy-tailed number of digits (``longtail_prompts``, the longtail_arithmetic task's
distribution: most answers take ~20 tokens, the longest run past the target's training
range to 100-256), and every configuration runs
with and without slot compaction (``EngineConfig(compaction=True)``): plain, plain with
compaction, and each speculative configuration with compaction, the same seeds,
interleaved; rows report the rounds and seconds per compiled width, the tail's share and
the speed-up over plain decoding with compaction at each width (``--plot`` draws it).
Adaptive configurations then run with compaction and a ``ConcurrencyAwareController``
(a shape per width; ``--adaptive-trees 2x2x1`` adds trees to its menu).

  python experiments/bench_spec.py [--size small|medium] [--batches 1 8 32]
      [--ks 1 2 3 4 5 6 7] [--samples 7] [--no-trees] [--no-ngram] [--no-adaptive]
      [--learned] [--adaptive-warmup 6] [--train-steps 200 150]
      [--lengths task|longtail] [--max-new-tokens 256] [--adaptive-trees 2x2x1 ...]
      [--longtail-digits 16] [--longtail-exponent 1.0] [--longtail-straggler]
      [--plot results/cpu/bench_spec_longtail.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import spec_pair  # noqa: E402

import specrl_jax as sj  # noqa: E402
from specrl_jax.models import tokenizer  # noqa: E402
from specrl_jax.rl.tasks.arithmetic import random_operand  # noqa: E402
from specrl_jax.rl.tasks.longtail import LongTailArithmetic, digit_distribution  # noqa: E402
from specrl_jax.sampling.programs import set_program_cache_size  # noqa: E402
from specrl_jax.speculative.adaptive import DraftLengthController  # noqa: E402
from specrl_jax.speculative.concurrency import ConcurrencyAwareController, shape_label  # noqa: E402

TREES = ((2, 1, 1), (2, 2, 1), (3, 2, 1, 1))


def make_prompts(batch: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [tokenizer.encode(spec_pair.TASK.sample(rng).prompt, add_bos=True)
          for _ in range(batch)]


# The long-tailed prompts' task: operand digit counts d with P(d) ~ 1/d, the target's
# own 2-4 digits and, in the tail, up to 16 (the worked sum then runs on for a line per
# column, past anything the target was trained on). --longtail-digits and
# --longtail-exponent change the range and the tail (digit_distribution), beyond the
# task's int64 operands if need be.
LONGTAIL = LongTailArithmetic(min_digits=1, max_digits=16, tail_exponent=1.0)


def longtail_prompts(batch: int, seed: int, *, max_digits: int = LONGTAIL.max_digits,
                     tail_exponent: float = LONGTAIL.tail_exponent,
                     straggler: bool = False) -> list[list[int]]:
  """``batch`` addition prompts with operand lengths at the batch's quantiles of the
  long-tailed digit distribution (so every batch of 8 or more has a long one), in a
  seeded random order. straggler: the longest prompt takes ``max_digits`` (every batch
  then has one response that runs to the length limit, as RL batches do)."""
  digits_D, probabilities_D = digit_distribution(LONGTAIL.min_digits, max_digits,
                                                 tail_exponent)
  quantiles = (np.arange(batch) + 0.5) / batch
  digits = digits_D[np.searchsorted(np.cumsum(probabilities_D), quantiles)]
  if straggler:
    digits[-1] = max_digits
  rng = np.random.default_rng(seed)
  rng.shuffle(digits)
  prompts = []
  for d in digits:
    a, b = (random_operand(rng, int(d)) for _ in range(2))
    prompts.append(tokenizer.encode(f"{a}+{b}=", add_bos=True))
  return prompts


def _mean_per_position(rates: list[list[float]]) -> list[float]:
  """Per draft position, the mean over the samples that drafted it (an adaptive run
  need not reach every position)."""
  longest = max(map(len, rates), default=0)
  return [round(float(np.mean([r[i] for r in rates if len(r) > i])), 3) for i in range(longest)]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7])
  parser.add_argument("--samples", type=int, default=7,
                      help="rollouts timed per configuration, each on its own seed")
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--no-trees", action="store_true")
  parser.add_argument("--no-ngram", action="store_true")
  parser.add_argument("--no-adaptive", action="store_true")
  parser.add_argument("--size", choices=sorted(spec_pair.SIZES), default="small")
  parser.add_argument("--adaptive-warmup", type=int, default=6,
                      help="untimed calls that warm an adaptive controller up")
  parser.add_argument("--learned", action="store_true",
                      help="also MTP and EAGLE-3 heads trained for the target (cached)")
  parser.add_argument("--lengths", choices=("task", "longtail"), default="task",
                      help="the task's own prompts, or long-tailed response lengths "
                      "(longtail_prompts), each configuration also with slot compaction")
  parser.add_argument("--max-new-tokens", type=int, default=256,
                      help="the response budget with --lengths longtail")
  parser.add_argument("--longtail-digits", type=int, default=LONGTAIL.max_digits,
                      help="the most operand digits of the long-tailed prompts")
  parser.add_argument("--longtail-exponent", type=float, default=LONGTAIL.tail_exponent,
                      help="P(digits) ~ digits ** -exponent")
  parser.add_argument("--longtail-straggler", action="store_true",
                      help="each batch's longest prompt takes --longtail-digits")
  parser.add_argument("--adaptive-trees", nargs="*", default=[],
                      help="trees the adaptive controller may also choose, e.g. 2x2x1 "
                      "(an extra adaptive configuration)")
  parser.add_argument("--plot", default=None,
                      help="with --lengths longtail: a PNG of the speed-up per width")
  parser.add_argument("--train-steps", type=int, nargs=2, metavar=("TARGET", "DRAFT"),
                      default=(200, 150), help="SFT / distillation steps when the pair is "
                      "not cached (fewer: a device's time budget, or a CPU dry run)")
  args = parser.parse_args(argv)

  target, draft = spec_pair.load_or_train(size=args.size, target_steps=args.train_steps[0],
                                          draft_steps=args.train_steps[1])
  longtail = args.lengths == "longtail"
  if longtail:
    # Each configuration compiles a program per width: at the default 16 they would
    # evict each other and recompile inside the timed runs.
    set_program_cache_size(256)
  sampling = sj.SamplingParams(
      temperature=args.temperature,
      max_new_tokens=args.max_new_tokens if longtail else spec_pair.TASK.max_response_tokens,
      stop_token_ids=(tokenizer.EOS_ID,))
  drafters = {"draft_model": sj.drafters.DraftModel(draft)}
  if not args.no_ngram:
    drafters["ngram"] = sj.drafters.NGram(n=3)
  if args.learned:
    drafters.update(spec_pair.load_or_train_heads(target, args.size))
  specs = {f"chain_k{k}": sj.SpecConfig(num_draft_tokens=k) for k in args.ks}
  if not args.no_trees:
    specs.update({f"tree_{'x'.join(map(str, t))}": sj.SpecConfig(tree=t) for t in TREES})
  if not args.no_adaptive:
    specs[f"adaptive_k<={max(args.ks)}"] = sj.SpecConfig(num_draft_tokens=max(args.ks),
                                                         adaptive=True)
    if args.adaptive_trees:
      trees = tuple(tuple(int(b) for b in tree.split("x")) for tree in args.adaptive_trees)
      specs[f"adaptive_k<={max(args.ks)}+trees"] = sj.SpecConfig(
          num_draft_tokens=max(args.ks), adaptive=True, adaptive_trees=trees)

  compiles = common.CompileCounter()
  rows, breakdowns = [], []
  for batch in args.batches:
    if longtail:
      prompts = longtail_prompts(batch, seed=batch, max_digits=args.longtail_digits,
                                 tail_exponent=args.longtail_exponent,
                                 straggler=args.longtail_straggler)
    else:
      prompts = make_prompts(batch, seed=batch)
    engine = sj.EngineConfig(num_slots=batch)
    compacting = sj.EngineConfig(num_slots=batch, compaction=True)
    configs = {"plain": {}}
    if longtail:
      configs["plain+compaction"] = dict(engine=compacting)
    for drafter_name, drafter in drafters.items():
      for spec_name, spec in specs.items():
        name = f"{drafter_name}/{spec_name}"
        if not (longtail and spec.adaptive):
          configs[name] = dict(drafter=drafter, spec=spec)
        if longtail:
          configs[f"{name}+compaction"] = dict(drafter=drafter, spec=spec, engine=compacting)
        # One controller across the calls, as an RL run passes one to every step's
        # rollouts: what it measured while warming up carries over. With compaction, it
        # chooses per width.
        if spec.adaptive and longtail:
          configs[f"{name}+compaction"]["controller"] = ConcurrencyAwareController(
              k_max=spec.num_draft_tokens, trees=spec.adaptive_trees)
        elif spec.adaptive:
          configs[name]["controller"] = DraftLengthController(k_max=spec.num_draft_tokens)

    # Per timed sample: (programs compiled, seconds compiling) during the call.
    compiled_while_timed: dict[str, list[tuple[int, float]]] = {name: [] for name in configs}

    def runner(name, kwargs):
      def run(sample):
        before = compiles.count, compiles.seconds
        out = sj.generate(target, prompts, sampling=sampling,
                          rng=jax.random.key(1000 + sample), **dict(dict(engine=engine),
                                                                    **kwargs))
        if sample >= 0:
          compiled_while_timed[name].append((compiles.count - before[0],
                                             compiles.seconds - before[1]))
        return out
      return run

    runs = {name: runner(name, kwargs) for name, kwargs in configs.items()}
    for name, run in runs.items():
      # Compile (the adaptive engine compiles the shapes it picks, per width). An
      # adaptive controller also gets the rollouts an RL run's first steps would give it
      # to explore, and more until one compiles nothing new, so that what is timed is
      # its steady state.
      warmups = args.adaptive_warmup if "controller" in configs[name] else 2
      for warmup in range(2 * warmups):
        compiled_before = compiles.count
        run(-1 - warmup)
        if warmup + 1 >= warmups and compiles.count == compiled_before:
          break
    timed = common.paired_samples(runs, args.samples)
    # A shape an adaptive controller first picks at a width in a timed call compiles
    # there: its compile time is taken out (a long run compiles each program once).
    rates = {name: [int(out.lengths.sum()) / (seconds - compiled[1])
                    for (seconds, out), compiled in zip(results, compiled_while_timed[name])]
             for name, results in timed.items()}
    clean = {name: [count == 0 for count, _ in log] for name, log in compiled_while_timed.items()}
    for name in configs:
      outs = [out for _, out in timed[name]]
      # Each sample's speed is divided by plain decoding's on the same seed, timed next
      # to it; the median over samples drops the ones a burst of machine load hit.
      speedups = [rate / plain for rate, plain in zip(rates[name], rates["plain"])]
      row = {"batch": batch, "config": name,
             "tokens_per_second": round(common.median(rates[name]), 1),
             "speedup_vs_plain": round(common.median(speedups), 3),
             "acceptance_length": round(np.mean([o.stats["acceptance_length"] for o in outs]), 3),
             "per_position_acceptance": _mean_per_position(
                 [o.stats["per_position_acceptance"] for o in outs]),
             "target_calls": [o.stats["target_calls"] for o in outs],
             **_request_spread(outs),
             "generated_tokens": [int(o.lengths.sum()) for o in outs],
             "programs_compiled_while_timed": sum(c for c, _ in compiled_while_timed[name]),
             "compile_seconds_excluded": round(sum(t for _, t in compiled_while_timed[name]), 2)}
      if longtail:
        row.update(_tail_stats(outs, rates[name], rates.get("plain+compaction"),
                               [out for _, out in timed["plain+compaction"]],
                               [a and b for a, b in zip(clean[name], clean["plain+compaction"])]))
      if "draft_length_schedule" in outs[0].stats:
        row["draft_length_rounds"] = _rounds_by_length(
            [entry for o in outs for entry in o.stats["draft_length_schedule"]])
        row["draft_schedule_by_width"] = _schedule_by_width(outs)
      rows.append(row)
      print(row, file=sys.stderr)
    breakdowns.append(round_cost_breakdown(target, draft, batch, max(args.ks)))
    print(breakdowns[-1], file=sys.stderr)
    # Each batch size compiles its own programs; dropping the last ones keeps a long
    # run within the process's memory maps (LLVM failed to allocate in one with
    # four drafters x six configurations x two batch sizes).
    jax.clear_caches()
  if args.plot and longtail:
    plot_speedup_by_width(rows, args.plot)
  violations = [r for r in rows if r["batch"] in (1, 8) and r["acceptance_length"] >= 2.5
                and r["speedup_vs_plain"] < 1.0]
  config = target.config
  common.print_json({
      "benchmark": "bench_spec", "size": args.size,
      "target": (f"spec_pair {args.size}: {config.num_layers} x {config.hidden_size}, "
                 f"{config.num_params() / 1e6:.1f}M parameters, SFT arithmetic"),
      "temperature": args.temperature, "lengths": args.lengths,
      "max_new_tokens": sampling.max_new_tokens, "results": rows,
      "round_cost_breakdown": breakdowns,
      "slower_than_plain_despite_acceptance_2_5_at_batch_1_or_8": [
          (r["batch"], r["config"]) for r in violations]})
  return 0


def _request_spread(outs) -> dict:
  """How unevenly the requests of a batch progress: the spread of their tokens per
  round, and the batch's rounds over its requests' mean (a batch runs until its
  slowest request ends, so pooled acceptance overstates its progress)."""
  per_request = np.concatenate([(o.lengths - 1) / np.maximum(o.stats["request_rounds"], 1)
                                for o in outs])
  straggling = [o.stats["target_calls"] / max(np.mean(o.stats["request_rounds"]), 1e-9)
                for o in outs]
  return {"request_tokens_per_round_min_median_max": [
              round(float(q), 2) for q in np.quantile(per_request, [0, 0.5, 1])],
          "batch_rounds_over_mean_request_rounds": round(float(np.mean(straggling)), 3)}


def _tail_stats(outs, rates, compaction_rates, compaction_outs, clean) -> dict:
  """A long-tailed row's response lengths, its speed over plain decoding with
  compaction (same seeds), and, when it compacted, its rounds, tokens and seconds per
  width and its speed-up over plain decoding with compaction at each width (tokens per
  second at that width, median over the seeds where neither compiled: a width's seconds
  would include compiling)."""
  lengths = np.concatenate([o.lengths for o in outs])
  row = {"response_length_mean_over_max": round(float(lengths.mean() / lengths.max()), 3),
         "response_length_max": int(lengths.max()),
         "rounds_by_live": np.sum([o.stats["rounds_by_live"] for o in outs], axis=0).tolist()}
  if compaction_rates is not None:
    row["speedup_vs_plain_compaction"] = round(common.median(
        [rate / base for rate, base in zip(rates, compaction_rates)]), 3)
  if "compaction" in outs[0].stats:
    widths = [o.stats["compaction"] for o in outs]
    row["widths"] = widths[0]["widths"]
    row["rounds_by_width"] = np.mean([w["rounds_by_width"] for w in widths], axis=0).tolist()
    row["seconds_by_width"] = np.round(np.mean([w["seconds_by_width"] for w in widths],
                                               axis=0), 4).tolist()
    row["tail_time_share"] = round(float(np.mean([w["tail_time_share"] for w in widths])), 3)
    row["tokens_by_width"] = np.mean([w["tokens_by_width"] for w in widths], axis=0).tolist()
    # Tokens per second at each width: the two decoders draw different samples, so the
    # time either spends at a width (how long its longest sequences run) is no measure.
    base, mine = (_tokens_per_second_by_width([o.stats["compaction"] for o in runs])
                  for runs in (compaction_outs, outs))
    # A width one of the two skipped (its sequences ended before it) has no ratio.
    ratios = np.where((base > 0) & (mine > 0), mine / np.where(base > 0, base, 1), np.nan)
    ratios[~np.asarray(clean)] = np.nan
    row["speedup_by_width_vs_plain_compaction"] = [
        None if np.all(np.isnan(column)) else round(float(np.nanmedian(column)), 3)
        for column in ratios.T]
  return row


def _tokens_per_second_by_width(compactions: list[dict]) -> np.ndarray:
  """[samples, widths] tokens emitted per second at each width (0 where none ran)."""
  tokens = np.asarray([c["tokens_by_width"] for c in compactions], float)
  seconds = np.asarray([c["seconds_by_width"] for c in compactions], float)
  return np.where(seconds > 0, tokens / np.where(seconds > 0, seconds, 1), 0.0)


def _schedule_by_width(outs) -> dict[int, dict[str, int]]:
  """Rounds per width and chosen shape, summed over the timed rollouts."""
  table: dict[int, dict[str, int]] = {}
  for out in outs:
    for width, row in out.stats["draft_schedule_by_width"].items():
      for shape, rounds in row.items():
        table.setdefault(width, {})
        table[width][shape] = table[width].get(shape, 0) + rounds
  return table


def plot_speedup_by_width(rows: list[dict], path: str) -> None:
  """Speed-up over plain decoding with compaction at each width, a panel per batch."""
  plt = common.pyplot()
  batches = sorted({r["batch"] for r in rows if "speedup_by_width_vs_plain_compaction" in r})
  figure, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
  for axis, batch in zip(axes[0], batches):
    for row in rows:
      if row["batch"] != batch or "speedup_by_width_vs_plain_compaction" not in row:
        continue
      if row["config"] == "plain+compaction":
        continue
      widths = row["widths"]
      speedups = [np.nan if x is None else x for x in row["speedup_by_width_vs_plain_compaction"]]
      axis.plot(range(len(widths)), speedups, marker="o",
                label=row["config"].replace("draft_model/", ""))
      axis.set_xticks(range(len(widths)), [str(w) for w in widths])
    axis.axhline(1.0, color="grey", lw=0.8)
    axis.set_title(f"batch {batch}: speed-up per live width")
    axis.set_xlabel("compiled width (live sequences), full batch to tail")
    axis.set_ylabel("tokens/s at the width, x plain with compaction")
    axis.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def _rounds_by_length(schedule) -> dict[str, int]:
  """Rounds per chosen shape (chain length, or a tree) over a schedule."""
  rounds: dict[str, int] = {}
  for shape, count in schedule:
    rounds[shape_label(shape)] = rounds.get(shape_label(shape), 0) + count
  return dict(sorted(rounds.items()))


def round_cost_breakdown(target, draft, batch: int, k: int, repeats: int = 5) -> dict:
  """Milliseconds of the pieces of a round on these weights (dense forwards, no cache):
  the target over 1 token (a plain step) and over k + 1 (verification), one drafter
  step. Verification / plain is what speculation must beat with accepted tokens."""
  def forward_ms(model, length):
    return 1e3 * common.dense_forward_seconds(model, batch, length, repeats)

  plain, verify = forward_ms(target, 1), forward_ms(target, k + 1)
  drafter = forward_ms(draft, 1)
  return {"batch": batch, "k": k, "target_1_token_ms": round(plain, 3),
          f"target_{k + 1}_tokens_ms": round(verify, 3),
          "verify_over_plain": round(verify / plain, 2), "drafter_step_ms": round(drafter, 3),
          f"drafter_{k}_steps_over_plain": round(k * drafter / plain, 2)}


if __name__ == "__main__":
  raise SystemExit(main())
