"""Compiles and runs, on this machine's backend, the generation programs that
tests/test_lowering.py lowers on CPU: plain, chain, tree, adaptive and compacting
generation with the Pallas kernels (attention="pallas"), at a preset's shapes with
random weights, each against the reference attention: greedy tokens must be identical.
Prints one JSON document: per program, its status (ok, or the exception's first line),
seconds (compile included) and the tokens check.

  python experiments/lowered_programs.py --preset qwen3-0.6b --layers 4   # a device
  python experiments/lowered_programs.py --tiny                           # CPU dry run
"""

from __future__ import annotations

import argparse
import time
import traceback

import jax
import numpy as np
from flax import nnx

import specrl_jax as sj
from specrl_jax.config import PRESETS
from specrl_jax.sampling.engine import EngineConfig

from common import print_json

PROGRAMS = {
    "plain": dict(spec=None),
    "chain": dict(spec=sj.SpecConfig(num_draft_tokens=3)),
    "tree": dict(spec=sj.SpecConfig(tree=(2, 2, 1))),
    "adaptive": dict(spec=sj.SpecConfig(num_draft_tokens=3, adaptive=True)),
    "compaction": dict(spec=sj.SpecConfig(num_draft_tokens=3), compaction=True),
}


def model_config(args) -> sj.ModelConfig:
  if args.tiny:  # the attention shapes of a preset, scaled down for interpret mode on CPU
    return sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=4, num_kv_heads=2, head_dim=16, param_dtype="bfloat16",
                          dtype="bfloat16")
  return PRESETS[args.preset].replace(num_layers=args.layers)


def run_program(name, target, draft, prompts, args) -> dict:
  options = PROGRAMS[name]
  spec = options["spec"]
  greedy = sj.SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
  engines = {attention: EngineConfig(page_size=args.page_size, attention=attention,
                                     compaction=options.get("compaction", False))
             for attention in ("pallas", "reference")}
  call = lambda attention: sj.generate(
      target, prompts, sampling=greedy, engine=engines[attention], rng=jax.random.key(0),
      drafter=draft if spec is not None else None, spec=spec)
  start = time.perf_counter()
  try:
    kernels = call("pallas")
    seconds = time.perf_counter() - start
    reference = call("reference")
  except Exception as error:  # noqa: BLE001 - reported by name, the next program runs
    traceback.print_exc()
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return {"status": f"{type(error).__name__}: {first}",
            "seconds": round(time.perf_counter() - start, 2)}
  same = bool(np.array_equal(kernels.tokens, reference.tokens))
  return {"status": "ok" if same else "greedy tokens differ from the reference",
          "seconds": round(seconds, 2), "greedy_tokens_identical": same,
          "attention": kernels.stats.get("attention"),
          "attention_fallback": kernels.stats.get("attention_fallback"),
          "generated_tokens": int(np.sum(kernels.lengths))}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--tiny", action="store_true", help="toy shapes (a CPU dry run)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--page-size", type=int, default=64)
  parser.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=list(PROGRAMS))
  args = parser.parse_args()
  config = model_config(args)
  target = sj.Transformer(config, rngs=nnx.Rngs(0))
  draft = sj.drafters.DraftModel(sj.Transformer(config.replace(num_layers=1),
                                                rngs=nnx.Rngs(1)))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, config.vocab_size, size=int(n)).tolist()
             for n in rng.integers(4, 24, size=args.batch)]
  results = {}
  for name in args.programs:
    results[name] = run_program(name, target, draft, prompts, args)
    print(name, results[name], flush=True)
  print_json({"backend": jax.default_backend(), "devices": str(jax.devices()),
              "preset": "tiny" if args.tiny else args.preset, "layers": config.num_layers,
              "batch": args.batch, "new_tokens": args.new_tokens, "page_size": args.page_size,
              "programs": results,
              "all_ok": all(r["status"] == "ok" for r in results.values())})


if __name__ == "__main__":
  main()
