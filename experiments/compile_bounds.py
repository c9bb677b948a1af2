"""Compile time of one speculative ``generate`` call against draft length, tree size and
n-gram n, on a tiny model: the evidence behind the static bounds in SpecConfig and NGram.

Each case is a fresh shape, so its first call's wall time is almost all tracing and
compiling (the decode itself is milliseconds). Prints one JSON object per case.

  python experiments/compile_bounds.py [--cases chain:4 chain:16 tree:4,4 ngram:16 ...]

Cases beyond the bounds (chain:32, tree:4,4,4,2, tree:16,8, ngram:64) are refused now;
their figures in docs/drafters.md were measured before the bounds existed.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

import specrl_jax as sj
from specrl_jax import testing
from specrl_jax.config import tree_nodes

DEFAULT_CASES = ["chain:4", "chain:8", "chain:16", "chain:32", "tree:4,4,4", "tree:8,8",
                 "tree:4,4,4,2", "tree:16,8", "ngram:4", "ngram:16", "ngram:64"]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
  args = parser.parse_args(argv)
  config = sj.ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8,
                          max_position_embeddings=512)
  target = testing.peaked_random_model(config, seed=0)
  draft = sj.drafters.DraftModel(testing.peaked_random_model(config.replace(num_layers=1),
                                                             seed=1))
  sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=8)
  prompts = [[1, 2, 3, 4, 5, 6, 7]] * 2
  for case in args.cases:
    kind, _, value = case.partition(":")
    if kind == "chain":
      drafter, spec = draft, sj.SpecConfig(num_draft_tokens=int(value))
    elif kind == "tree":
      drafter, spec = draft, sj.SpecConfig(tree=tuple(int(b) for b in value.split(",")))
    elif kind == "ngram":
      drafter, spec = sj.drafters.NGram(n=int(value)), sj.SpecConfig(num_draft_tokens=3)
    else:
      raise SystemExit(f"unknown case {case!r}: expected chain:K, tree:B,B,... or ngram:N")
    nodes = tree_nodes(spec.tree) if spec.tree else spec.num_draft_tokens
    start = time.perf_counter()
    out = sj.generate(target, prompts, sampling=sampling, rng=jax.random.key(0),
                      drafter=drafter, spec=spec)
    first = time.perf_counter() - start
    start = time.perf_counter()
    sj.generate(target, prompts, sampling=sampling, rng=jax.random.key(1), drafter=drafter,
                spec=spec)
    again = time.perf_counter() - start
    print(json.dumps({"case": case, "draft_nodes": nodes, "first_call_s": round(first, 2),
                      "cached_call_s": round(again, 3),
                      "acceptance_length": out.stats["acceptance_length"]}), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
