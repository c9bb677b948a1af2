"""Does the simulator's cost model predict our own CPU runs? Plain and speculative decode
time over batch sizes and draft lengths, predicted vs measured in one process.

The prediction uses only what a simulator user would have: the cost of the pieces
(dense forwards of the target over 1 and k + 1 tokens per sequence, of the drafter over
one token, timed on these weights, interpolated in tokens by ``sim.MeasuredCallCost``),
the engine's per-round costs beyond them calibrated on three runs (plain decoding at the
smallest and the largest batch, speculation at the smallest batch and k), and the
per-position acceptance each run measured. Every other (batch, k), plain or
speculative, is a held-out prediction of ``sim.SpeculationCostModel.batch_decode_seconds``: rounds of
the slowest sequence of the batch times the round time. Measured decode time is
generate(new_tokens), best of N and averaged over rollout seeds, minus generate(2 tokens)
(prefill, the first token and one round); no stop tokens.

  python experiments/sim_vs_measured.py [--size small|medium] [--batches 1 4 8]
      [--ks 1 2 3 4] [--new-tokens 48] [--repeats 2] [--seeds 3] [--png results/sim_vs_measured.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import specrl_jax as sj  # noqa: E402
from specrl_jax.sim.cost_model import (  # noqa: E402
    MeasuredCallCost, SpeculationCostModel, conditional_acceptance,
)

TOLERANCE = 0.20  # the bar: predictions within 20% of measured


def random_prompts(vocab_size: int, length: int = 8) -> Callable[[int], list[list[int]]]:
  """Prompts of random tokens (for untrained models): batch size -> prompts."""
  return lambda batch: np.random.default_rng(batch).integers(
      3, vocab_size, size=(batch, length)).tolist()


def measure_runs(target: sj.Transformer, draft: sj.Transformer, *, batches: Sequence[int],
                 ks: Sequence[int], new_tokens: int, repeats: int, seeds: int,
                 prompts_of: Callable[[int], list[list[int]]]) -> list[dict]:
  """Per (batch, k) (k = 0: plain): decode seconds, rounds and per-position acceptance,
  each the mean over ``seeds`` rollout seeds. A batch's time hangs on its slowest
  sequence, so one seed is one draw of luck (+-10% in rounds at batch 4); the model
  predicts the expectation over seeds."""
  rows = []
  drafter = sj.drafters.DraftModel(draft)
  for batch in batches:
    prompts = prompts_of(batch)
    engine = sj.EngineConfig(num_slots=batch)
    runs, outputs = {}, {}
    for k in (0, *ks):
      extra = {} if k == 0 else dict(drafter=drafter, spec=sj.SpecConfig(num_draft_tokens=k))
      for tokens, seed in [(2, 0)] + [(new_tokens, seed) for seed in range(seeds)]:
        sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=tokens)

        def run(key=(k, tokens, seed), sampling=sampling, extra=extra):
          outputs[key] = sj.generate(target, prompts, sampling=sampling,
                                     rng=jax.random.key(1000 * key[2] + key[0]),
                                     engine=engine, **extra)
        runs[k, tokens, seed] = run
        run()  # compile (once per k and length; later seeds reuse the program)
    seconds = common.interleaved(runs, repeats)
    for k in (0, *ks):
      full = [outputs[k, new_tokens, seed] for seed in range(seeds)]
      first = outputs[k, 2, 0]
      rows.append({
          "batch": batch, "k": k,
          "decode_seconds": float(np.mean([seconds[k, new_tokens, seed]
                                           for seed in range(seeds)])) - seconds[k, 2, 0],
          "rounds": float(np.mean([out.stats["target_calls"] for out in full]))
                    - first.stats["target_calls"],
          "acceptance_length": float(np.mean([out.stats["acceptance_length"] for out in full])),
          "per_position_acceptance": np.mean(
              [out.stats["per_position_acceptance"] for out in full], axis=0).tolist()})
  return rows


def measure_pieces(target: sj.Transformer, draft: sj.Transformer, *, batches: Sequence[int],
                   ks: Sequence[int], repeats: int) -> dict:
  """Dense forward timings: the target over 1 and k + 1 tokens, the drafter over 1."""
  return {
      "target": [(b, q, common.dense_forward_seconds(target, b, q, repeats))
                 for b in batches for q in sorted({1, *(k + 1 for k in ks)})],
      "drafter": [(b, 1, common.dense_forward_seconds(draft, b, 1, repeats)) for b in batches]}


def predict(rows: list[dict], pieces: dict, *, new_tokens: int,
            calibration: tuple[int, int]) -> tuple[list[dict], dict]:
  """Adds predicted decode seconds to every row. The engine's per-round costs beyond
  the bare forwards come from three rows alone: plain decoding at the smallest and the
  largest batch (a fixed and a per-sequence part: sampling and attention over each
  sequence's cache, which the cache-less pieces lack) and speculation at
  ``calibration`` = (smallest batch, k) (verification's fixed extra)."""
  target = MeasuredCallCost.fit(pieces["target"])
  drafter = MeasuredCallCost.fit(pieces["drafter"])
  by_key = {(r["batch"], r["k"]): r for r in rows}
  batch0, k0 = calibration
  largest = max(r["batch"] for r in rows)
  extra = {b: by_key[b, 0]["decode_seconds"] / by_key[b, 0]["rounds"] - target.seconds(b, 1)
           for b in (batch0, largest)}
  per_sequence = max(0.0, (extra[largest] - extra[batch0]) / (largest - batch0)
                     if largest > batch0 else 0.0)
  fixed = max(0.0, extra[batch0] - per_sequence * batch0)
  engine_target = dataclasses.replace(target, overhead_s=fixed, per_sequence_s=per_sequence)
  bare = SpeculationCostModel(target=engine_target, drafter=drafter)
  spec0 = by_key[batch0, k0]
  round_overhead = max(0.0, spec0["decode_seconds"] / spec0["rounds"]
                       - bare.round_seconds(batch0, k0))
  model = SpeculationCostModel(target=engine_target, drafter=drafter,
                               round_overhead_s=round_overhead)
  calibration_keys = {(batch0, 0), (largest, 0), (batch0, k0)}
  out = []
  for row in rows:
    k = row["k"]
    acceptance = conditional_acceptance(row["per_position_acceptance"]) if k else (0.0,)
    # The baseline run's one round (tokens 1-2) is subtracted from both sides.
    predicted = model.batch_decode_seconds(row["batch"], k, acceptance, new_tokens - 1) \
        - model.round_seconds(row["batch"], k)
    out.append(dict(row, predicted_seconds=predicted,
                    relative_error=predicted / row["decode_seconds"] - 1.0,
                    calibration=(row["batch"], k) in calibration_keys))
  return out, {"plain_round_overhead_s": fixed, "plain_per_sequence_overhead_s": per_sequence,
               "speculative_round_extra_overhead_s": round_overhead,
               "target": vars(target), "drafter": vars(drafter)}


def plot(rows: list[dict], path: str, title: str) -> None:
  plt = common.pyplot()
  figure, axis = plt.subplots(figsize=(5.2, 4.6))
  measured = np.array([1e3 * r["decode_seconds"] for r in rows])
  predicted = np.array([1e3 * r["predicted_seconds"] for r in rows])
  low, high = 0.8 * min(measured.min(), predicted.min()), 1.2 * max(measured.max(),
                                                                     predicted.max())
  line = np.array([low, high])
  axis.plot(line, line, color="black", linewidth=1)
  axis.fill_between(line, line * (1 - TOLERANCE), line * (1 + TOLERANCE), color="0.9",
                    label=f"within {TOLERANCE:.0%}")
  markers = {1: "o", 2: "s", 4: "^", 8: "D", 16: "v", 32: "P"}
  for k in sorted({r["k"] for r in rows}):
    for batch in sorted({r["batch"] for r in rows}):
      picked = [i for i, r in enumerate(rows) if r["k"] == k and r["batch"] == batch]
      calibration = any(rows[i]["calibration"] for i in picked)
      axis.scatter(measured[picked], predicted[picked], marker=markers.get(batch, "o"),
                   color=plt.cm.viridis(k / max(1, max(r["k"] for r in rows))),
                   facecolors="none" if calibration else None,
                   label=f"b{batch} k{k}" + (" (calibration)" if calibration else ""))
  axis.set_xscale("log")
  axis.set_yscale("log")
  axis.set_xlabel("measured decode time (ms)")
  axis.set_ylabel("simulator prediction (ms)")
  axis.set_title(title, fontsize=9)
  axis.legend(fontsize=6, ncol=2)
  figure.tight_layout()
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=120)
  plt.close(figure)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=("small", "medium"), default="small")
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
  parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
  parser.add_argument("--new-tokens", type=int, default=48)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--png", default=None)
  args = parser.parse_args(argv)

  import bench_spec
  import spec_pair
  target, draft = spec_pair.load_or_train(size=args.size)
  # Task prompts (the pair is trained on them); no stop tokens, so every response is
  # new_tokens long.
  rows = measure_runs(target, draft, batches=args.batches, ks=args.ks,
                      new_tokens=args.new_tokens, repeats=args.repeats,
                      seeds=args.seeds, prompts_of=lambda batch: bench_spec.make_prompts(batch, seed=batch))
  pieces = measure_pieces(target, draft, batches=args.batches, ks=args.ks,
                          repeats=args.repeats * 5)
  rows, fitted = predict(rows, pieces, new_tokens=args.new_tokens,
                         calibration=(min(args.batches), min(args.ks)))
  held_out = [r for r in rows if not r["calibration"]]
  worst = max(abs(r["relative_error"]) for r in held_out)
  config = target.config
  title = (f"spec_pair {args.size} ({config.num_params() / 1e6:.0f}M target): held-out "
           f"worst error {worst:.0%}")
  if args.png:
    plot(rows, args.png, title)
  common.print_json({
      "benchmark": "sim_vs_measured", "size": args.size, "new_tokens": args.new_tokens,
      "pieces_ms": {name: [(b, q, round(1e3 * t, 4)) for b, q, t in points]
                    for name, points in pieces.items()},
      "fitted": fitted, "worst_held_out_relative_error": worst,
      "within_tolerance": worst <= TOLERANCE, "png": args.png,
      "rows": [{**r, "decode_seconds": round(r["decode_seconds"], 5),
                "predicted_seconds": round(r["predicted_seconds"], 5),
                "relative_error": round(r["relative_error"], 3),
                "per_position_acceptance": [round(a, 3) for a in r["per_position_acceptance"]]}
               for r in rows]})
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
