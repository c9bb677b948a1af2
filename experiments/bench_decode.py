"""Plain paged decoding throughput and its memory-bandwidth roofline, on any backend.

Default: model "bench-160m" (Qwen3 architecture, random weights, float32), prompt 64
tokens, 128 new tokens, batch 1 / 8 / 32, greedy and temperature 1, against Hugging Face
transformers on the same weights (exported with save_hf) in the same process,
interleaved, best of N.

Any preset (``--preset qwen3-0.6b --dtype bfloat16``) runs with random weights created
in their dtype and sharded at creation over ``--mesh D,F,T`` (on CPU the devices are
simulated). Each row reports the fraction of the memory-bandwidth roofline a decode step
reaches: the bytes one step reads on a device (its weights, less the embedding table of
an untied model of which only B rows are gathered, plus the live KV pages of its
sequences) over the step's time, over the device's peak bandwidth. A step's time is the
rollout's time less a prefill-only rollout's, over the decode steps. Peak bandwidth:
``--peak-gbps``, else a table of known accelerators, else (CPU) measured by a full read
of a buffer far beyond cache.

  python experiments/bench_decode.py [--batches 1 8 32] [--repeats 3]
  python experiments/bench_decode.py --preset qwen3-0.6b --dtype bfloat16 --batches 4 \
      --new-tokens 16 --temperatures 0 --repeats 1 [--mesh 1,1,4]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import specrl_jax as sj  # noqa: E402
from specrl_jax.config import PRESETS  # noqa: E402
from specrl_jax.kv.planner import bytes_per_page  # noqa: E402
from specrl_jax.parallel.create import create_model  # noqa: E402
from specrl_jax.parallel.mesh import make_mesh  # noqa: E402
from specrl_jax.sampling.memory import tree_bytes  # noqa: E402

PROMPT_LENGTH, NEW_TOKENS, PAGE_SIZE = 64, 128, 16

# Peak HBM bandwidth per device (bytes/s) by a lower-case fragment of device_kind, from
# the vendors' data sheets; the first fragment found in the kind wins.
PEAK_BANDWIDTH = (
    ("h200", 4.8e12), ("h100 pcie", 2.0e12), ("h100", 3.35e12), ("a100-sxm4-80gb", 2.039e12),
    ("a100 80gb", 1.935e12), ("a100", 1.555e12), ("l4", 0.3e12), ("v6", 1.64e12),
    ("v5p", 2.765e12), ("v5 lite", 0.819e12), ("v5e", 0.819e12), ("v4", 1.228e12),
)


def peak_bandwidth(device: jax.Device, given_gbps: float | None) -> tuple[float, str]:
  """(bytes/s, where the figure came from) for one device."""
  if given_gbps is not None:
    return given_gbps * 1e9, "--peak-gbps"
  kind = device.device_kind.lower()
  for fragment, bandwidth in PEAK_BANDWIDTH:
    if fragment in kind:
      return bandwidth, f"data sheet ({device.device_kind})"
  if device.platform == "cpu":
    return common.read_bandwidth_bytes_per_second(), "measured (full read of 512 MiB)"
  raise SystemExit(f"no known peak bandwidth for {device.device_kind!r}: pass --peak-gbps")


def bytes_per_step(model, config, *, batch: int, prompt_length: int, new_tokens: int,
                   mesh_shape: tuple[int, int, int]) -> float:
  """Bytes one decode step reads on one device, averaged over the rollout's steps.

  Weights: what the device holds, less its shard of an untied embedding table (a step
  gathers B rows of it). KV: the live pages (committed context rounded up to whole
  pages) of the device's sequences, requests being split over data x fsdp and KV heads
  over tensor where the shards divide them.
  """
  weights = tree_bytes(nnx.state(model))
  if not config.tie_embeddings:
    weights -= tree_bytes(model.embed[...])
  sequences = math.ceil(batch / (mesh_shape[0] * mesh_shape[1]))
  layers = ((config.num_kv_heads, config.head_dim),) * config.num_layers
  page_bytes = bytes_per_page(layers, page_size=PAGE_SIZE, kv_dtype=config.dtype,
                              tensor_shards=mesh_shape[2])
  # Decode step s (1 .. new_tokens - 1) attends over the prompt and s - 1 emitted tokens.
  live_pages = [math.ceil((prompt_length + step) / PAGE_SIZE) for step in range(new_tokens - 1)]
  return weights + sequences * page_bytes * float(np.mean(live_pages or [0]))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="bench-160m", choices=sorted(PRESETS))
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                      help="weights and activations (default: the preset's)")
  parser.add_argument("--mesh", default="1,1,1", help="D,F,T: data, fsdp, tensor")
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
  parser.add_argument("--prompt-length", type=int, default=PROMPT_LENGTH)
  parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--peak-gbps", type=float, default=None,
                      help="peak memory bandwidth of one device in GB/s")
  parser.add_argument("--skip-hf", action="store_true", help="only time specrl_jax")
  args = parser.parse_args(argv)

  mesh_shape = tuple(int(n) for n in args.mesh.split(","))
  if len(mesh_shape) != 3:
    parser.error(f"--mesh {args.mesh!r}: expected three sizes D,F,T")
  devices_needed = math.prod(mesh_shape)
  if jax.config.jax_platforms in (None, "", "cpu") and devices_needed > 1:
    # Simulated CPU devices must be asked for before the backend starts.
    jax.config.update("jax_num_cpu_devices", max(devices_needed, jax.config.jax_num_cpu_devices))
  mesh = None
  if mesh_shape != (1, 1, 1):
    mesh = make_mesh(mesh_shape, devices=jax.devices()[:devices_needed])
  config = PRESETS[args.preset]
  dtype = args.dtype or config.dtype
  config = config.replace(param_dtype=dtype, dtype=dtype)
  new_tokens, prompt_length = args.new_tokens, args.prompt_length
  config = config.replace(max_position_embeddings=max(config.max_position_embeddings,
                                                      prompt_length + new_tokens))
  model = create_model(config, rng=0, mesh=mesh)

  # transformers runs the README's comparison: the float32 benchmark model, one device.
  with_hf = (not args.skip_hf and args.preset == "bench-160m" and dtype == "float32"
             and mesh is None)
  hf_model = None
  if with_hf:
    import torch
    import transformers
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as folder:
      sj.save_hf(model, folder)
      hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf_model.eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0

  device = jax.devices()[0]
  bandwidth, bandwidth_source = peak_bandwidth(device, args.peak_gbps)
  mesh_kwargs = {} if mesh is None else {"mesh": mesh}
  rng = np.random.default_rng(0)
  rows = []
  for batch in args.batches:
    prompts = rng.integers(3, config.vocab_size, size=(batch, prompt_length))
    prompt_lists = prompts.tolist()
    engine = sj.EngineConfig(num_slots=batch, page_size=PAGE_SIZE)
    step_bytes = bytes_per_step(model, config, batch=batch, prompt_length=prompt_length,
                                new_tokens=new_tokens, mesh_shape=mesh_shape)
    for temperature in args.temperatures:
      def ours(tokens=new_tokens, temperature=temperature):
        sampling = sj.SamplingParams(temperature=temperature, max_new_tokens=tokens)
        out = sj.generate(model, prompt_lists, sampling=sampling, rng=jax.random.key(1),
                          engine=engine, **mesh_kwargs)
        assert int(out.lengths.sum()) == batch * tokens

      runs = {"specrl_jax": ours,
              # Prefill and the first token only: what the rollout spends besides steps.
              "prefill_only": lambda temperature=temperature: ours(1, temperature)}
      if hf_model is not None:
        input_ids = torch.as_tensor(prompts)

        def hf(temperature=temperature):
          with torch.no_grad():
            out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=temperature > 0, temperature=temperature or None,
                                    top_k=0 if temperature > 0 else None, top_p=None)
          assert out.shape[1] == prompt_length + new_tokens
        runs["transformers"] = hf
      for run in runs.values():
        run()  # compile / warm up
      seconds = common.interleaved(runs, args.repeats)
      step_seconds = max(seconds["specrl_jax"] - seconds["prefill_only"], 1e-9) / max(
          new_tokens - 1, 1)
      row = {"batch": batch, "temperature": temperature}
      for name in ("specrl_jax", "transformers"):
        if name in seconds:
          row[f"{name}_tokens_per_second"] = round(batch * new_tokens / seconds[name], 1)
      if hf_model is not None:
        row["ratio_vs_transformers"] = round(seconds["transformers"] / seconds["specrl_jax"], 2)
      row["roofline_tokens_per_second"] = round(batch * bandwidth / step_bytes, 1)
      row["step_ms"] = round(step_seconds * 1e3, 3)
      row["decode_tokens_per_second"] = round(batch / step_seconds, 1)
      row["bytes_per_step_per_device"] = int(step_bytes)
      row["roofline_fraction"] = round(step_bytes / step_seconds / bandwidth, 4)
      rows.append(row)
      print(row, file=sys.stderr)
  common.print_json({
      "benchmark": "bench_decode", "model": args.preset, "dtype": dtype,
      "mesh": list(mesh_shape), "backend": device.platform, "device_kind": device.device_kind,
      "num_params": config.num_params(), "prompt_tokens": prompt_length,
      "new_tokens": new_tokens, "read_bandwidth_GBps": round(bandwidth / 1e9, 1),
      "bandwidth_source": bandwidth_source, "cpu_count": os.cpu_count(),
      "jax": jax.__version__, "results": rows})
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
