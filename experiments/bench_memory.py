"""Resident memory over many ``generate`` calls of mixed shapes: compiled programs must
not pile up (issue 25: 40 mixed calls kept 27 programs, RSS 474 -> 1,002 MiB).

200 calls on a tiny model with random prompt lengths (1 to --max-length), batch sizes
(1 to --max-batch distinct prompts, each repeated 1 to --max-group times) and, with
--speculative-share, some calls speculative with an n-gram drafter. Prints JSON with
the RSS after the first 50 calls and after all of them (goal: within 20%), and the
program cache's figures. Every compile costs seconds on a shared CPU, so the defaults
keep the shape variety near the cache size; widen them to exercise eviction harder.

  python experiments/bench_memory.py [--calls 200] [--max-programs 16] [--seed 0]

Measured with the defaults on the shared 2-core CPU (2026-12-01): 97 distinct call
shapes, 66 compiles, 134 hits, 50 evictions, 16 programs kept; RSS 843.0 MiB after 50
calls and 901.6 MiB after 200 (+6.9%), 945 s in all (almost all compiling).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import jax
import numpy as np

import specrl_jax as sj
from specrl_jax import testing
from specrl_jax.sampling import programs


def rss_mib() -> float:
  """Current resident set size (not the peak), from /proc."""
  with open("/proc/self/statm") as statm:
    pages = int(statm.read().split()[1])
  return pages * resource.getpagesize() / 2 ** 20


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=200)
  parser.add_argument("--warmup", type=int, default=50)
  parser.add_argument("--max-programs", type=int, default=programs.DEFAULT_MAX_PROGRAMS)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-length", type=int, default=32)
  parser.add_argument("--max-batch", type=int, default=8)
  parser.add_argument("--max-group", type=int, default=1)
  parser.add_argument("--speculative-share", type=float, default=0.0)
  args = parser.parse_args(argv)
  programs.set_program_cache_size(args.max_programs)
  config = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
  model = testing.peaked_random_model(config, seed=0)
  drafter, spec = sj.drafters.NGram(n=3), sj.SpecConfig(num_draft_tokens=3)
  sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=16)
  choice = np.random.default_rng(args.seed)
  rss, shapes, start = {}, set(), time.perf_counter()
  for call in range(args.calls):
    num_prompts = int(choice.integers(1, args.max_batch + 1))
    group = int(choice.integers(1, args.max_group + 1))
    prompts = [choice.integers(0, config.vocab_size,
                               int(choice.integers(1, args.max_length + 1))).tolist()
               for _ in range(num_prompts)] * group
    speculative = bool(choice.random() < args.speculative_share)
    shapes.add((num_prompts, len(prompts), max(map(len, prompts)), speculative))
    sj.generate(model, prompts, sampling=sampling, rng=jax.random.key(call),
                drafter=drafter if speculative else None, spec=spec if speculative else None)
    if call + 1 == args.warmup:
      rss["after_warmup"] = rss_mib()
  rss["after_all"] = rss_mib()
  print(json.dumps({
      "calls": args.calls, "warmup_calls": args.warmup,
      "distinct_call_shapes": len(shapes),
      "rss_mib_after_warmup": round(rss["after_warmup"], 1),
      "rss_mib_after_all": round(rss["after_all"], 1),
      "rss_growth": round(rss["after_all"] / rss["after_warmup"] - 1, 3),
      "program_cache": programs.program_cache_info(),
      "seconds": round(time.perf_counter() - start, 1)}))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
