"""``make demo``: the main end-to-end job that exists so far.

Saves a small random Qwen3-architecture model in Hugging Face format, loads it back,
and decodes the same prompts plainly and speculatively (n-gram drafter), printing the
acceptance length and the wall-clock ratio measured side by side.
"""

from __future__ import annotations

import json
import tempfile
import time

import jax
import numpy as np
from flax import nnx

import specrl_jax as sj
from specrl_jax.models import tokenizer as builtin


def main(argv: list[str] | None = None) -> int:
  del argv
  config = sj.ModelConfig(vocab_size=builtin.VOCAB_SIZE, hidden_size=256, intermediate_size=704,
                          num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32)
  with tempfile.TemporaryDirectory() as folder:
    sj.save_hf(sj.Transformer(config, rngs=nnx.Rngs(0)), folder,
               tokenizer=builtin.builtin_tokenizer())
    model = sj.load_hf(folder)
  prompt = builtin.encode("12+34=46\n12+34=46\n12+34=", add_bos=True)
  prompts = [prompt] * 8
  sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=48)
  results = {}
  for name, kwargs in [("plain", {}),
                       ("ngram", dict(drafter=sj.drafters.NGram(n=3),
                                      spec=sj.SpecConfig(num_draft_tokens=4)))]:
    sj.generate(model, prompts, sampling=sampling, **kwargs)  # compile
    start = time.perf_counter()
    out = sj.generate(model, prompts, sampling=sampling, rng=jax.random.key(1), **kwargs)
    results[name] = dict(seconds=time.perf_counter() - start, out=out)
  same = bool(np.array_equal(results["plain"]["out"].tokens, results["ngram"]["out"].tokens))
  report = {
      "identical_greedy_output": same,
      "acceptance_length": results["ngram"]["out"].stats["acceptance_length"],
      "target_calls": {k: v["out"].stats["target_calls"] for k, v in results.items()},
      "speedup": results["plain"]["seconds"] / results["ngram"]["seconds"],
      "sample": builtin.decode(results["ngram"]["out"].tokens[0].tolist()),
  }
  print(json.dumps(report, indent=2))
  return 0 if same else 1


if __name__ == "__main__":
  raise SystemExit(main())
