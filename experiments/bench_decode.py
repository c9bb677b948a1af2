"""Plain paged decoding throughput vs Hugging Face transformers, side by side.

Model "bench-160m" (Qwen3 architecture, random weights, float32), prompt 64 tokens,
128 new tokens, batch 1 / 8 / 32, greedy and temperature 1. Both engines decode the same
weights (exported with save_hf) in the same process, interleaved, best of N. Also
reports the memory-bandwidth roofline: weight + KV bytes read per decode step over the
measured read bandwidth.

  python experiments/bench_decode.py [--batches 1 8 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import torch
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import specrl_jax as sj  # noqa: E402
from specrl_jax.config import PRESETS  # noqa: E402

PROMPT_LENGTH, NEW_TOKENS = 64, 128


def roofline_tokens_per_second(config, batch: int, bandwidth: float) -> float:
  """Upper bound from bytes read per step: all weights except the embedding table (only
  B rows are gathered) plus the average live KV, at the measured bandwidth."""
  weight_bytes = (config.num_params() - config.vocab_size * config.hidden_size) * 4
  average_context = PROMPT_LENGTH + NEW_TOKENS / 2
  kv_bytes = (batch * average_context * config.num_layers * 2 * config.num_kv_heads
              * config.head_dim * 4)
  return batch * bandwidth / (weight_bytes + kv_bytes)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--skip-hf", action="store_true", help="only time specrl_jax")
  args = parser.parse_args(argv)

  torch.set_num_threads(os.cpu_count() or 1)
  config = PRESETS["bench-160m"]
  model = sj.Transformer(config, rngs=nnx.Rngs(0))
  hf_model = None
  if not args.skip_hf:
    import transformers
    with tempfile.TemporaryDirectory() as folder:
      sj.save_hf(model, folder)
      hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf_model.eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0

  bandwidth = common.read_bandwidth_bytes_per_second()
  rng = np.random.default_rng(0)
  rows = []
  for batch in args.batches:
    prompts = rng.integers(3, config.vocab_size, size=(batch, PROMPT_LENGTH))
    for temperature in (0.0, 1.0):
      sampling = sj.SamplingParams(temperature=temperature, max_new_tokens=NEW_TOKENS)
      engine = sj.EngineConfig(num_slots=batch)
      prompt_lists = prompts.tolist()

      def ours():
        out = sj.generate(model, prompt_lists, sampling=sampling, rng=jax.random.key(1),
                          engine=engine)
        assert int(out.lengths.sum()) == batch * NEW_TOKENS

      runs = {"specrl_jax": ours}
      if hf_model is not None:
        input_ids = torch.as_tensor(prompts)

        def hf():
          with torch.no_grad():
            out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=temperature > 0, temperature=temperature or None,
                                    top_k=0 if temperature > 0 else None, top_p=None)
          assert out.shape[1] == PROMPT_LENGTH + NEW_TOKENS
        runs["transformers"] = hf
      for run in runs.values():
        run()  # compile / warm up
      seconds = common.interleaved(runs, args.repeats)
      row = {"batch": batch, "temperature": temperature}
      for name, value in seconds.items():
        row[f"{name}_tokens_per_second"] = round(batch * NEW_TOKENS / value, 1)
      if hf_model is not None:
        row["ratio_vs_transformers"] = round(seconds["transformers"] / seconds["specrl_jax"], 2)
      row["roofline_tokens_per_second"] = round(
          roofline_tokens_per_second(config, batch, bandwidth), 1)
      rows.append(row)
      print(row, file=sys.stderr)
  common.print_json({
      "benchmark": "bench_decode", "model": "bench-160m", "prompt_tokens": PROMPT_LENGTH,
      "new_tokens": NEW_TOKENS, "read_bandwidth_GBps": round(bandwidth / 1e9, 1),
      "cpu_count": os.cpu_count(), "jax": jax.__version__, "results": rows})
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
