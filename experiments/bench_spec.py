"""Speculative vs plain decoding on a predictable target/draft pair, side by side.

Target: a 4-layer model SFT'd on the arithmetic task; drafters: a 2-layer draft model
distilled from it, and the training-free n-gram drafter. Temperature 1, EOS stops.
For batch 1 / 8 / 32: chains k = 1..7 and static trees, acceptance length and
tokens/s against plain decoding timed in the same run (interleaved, best of N).

  python experiments/bench_spec.py [--batches 1 8 32] [--ks 1 2 3 4 5 6 7] [--repeats 3]
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

TREES = ((2, 1, 1), (2, 2, 1), (3, 2, 1, 1))


def make_prompts(batch: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [tokenizer.encode(spec_pair.TASK.sample(rng).prompt, add_bos=True)
          for _ in range(batch)]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--no-trees", action="store_true")
  parser.add_argument("--no-ngram", action="store_true")
  args = parser.parse_args(argv)

  target, draft = spec_pair.load_or_train()
  sampling = sj.SamplingParams(temperature=args.temperature,
                               max_new_tokens=spec_pair.TASK.max_response_tokens,
                               stop_token_ids=(tokenizer.EOS_ID,))
  drafters = {"draft_model": sj.drafters.DraftModel(draft)}
  if not args.no_ngram:
    drafters["ngram"] = sj.drafters.NGram(n=3)
  specs = {f"chain_k{k}": sj.SpecConfig(num_draft_tokens=k) for k in args.ks}
  if not args.no_trees:
    specs.update({f"tree_{'x'.join(map(str, t))}": sj.SpecConfig(tree=t) for t in TREES})

  rows = []
  for batch in args.batches:
    prompts = make_prompts(batch, seed=batch)
    engine = sj.EngineConfig(num_slots=batch)
    configs = {"plain": {}}
    for drafter_name, drafter in drafters.items():
      for spec_name, spec in specs.items():
        configs[f"{drafter_name}/{spec_name}"] = dict(drafter=drafter, spec=spec)
    outputs = {}

    def runner(name, kwargs):
      def run():
        outputs[name] = sj.generate(target, prompts, sampling=sampling, rng=jax.random.key(7),
                                    engine=engine, **kwargs)
      return run

    runs = {name: runner(name, kwargs) for name, kwargs in configs.items()}
    for run in runs.values():
      run()  # compile
    seconds = common.interleaved(runs, args.repeats)
    tokens = {name: int(out.lengths.sum()) for name, out in outputs.items()}
    plain_rate = tokens["plain"] / seconds["plain"]
    for name in configs:
      out = outputs[name]
      rate = tokens[name] / seconds[name]
      row = {"batch": batch, "config": name, "tokens_per_second": round(rate, 1),
             "speedup_vs_plain": round(rate / plain_rate, 3),
             "acceptance_length": round(out.stats["acceptance_length"], 3),
             "per_position_acceptance": [round(a, 3) for a in out.stats["per_position_acceptance"]],
             "target_calls": out.stats["target_calls"], "generated_tokens": tokens[name]}
      rows.append(row)
      print(row, file=sys.stderr)
  violations = [r for r in rows if r["batch"] in (1, 8) and r["acceptance_length"] >= 2.5
                and r["speedup_vs_plain"] < 1.0]
  common.print_json({
      "benchmark": "bench_spec", "target": "spec_pair/target (4x384, SFT arithmetic)",
      "temperature": args.temperature, "results": rows,
      "slower_than_plain_despite_acceptance_2_5_at_batch_1_or_8": [
          (r["batch"], r["config"]) for r in violations]})
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
