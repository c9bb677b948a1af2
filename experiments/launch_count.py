"""What one decode step and one speculative round launch, read from the compiled HLO.

Compiles (never runs) the whole rollout program of ``generate`` for a preset's shape at
two layer counts, finds the decode loop (the largest while loop of the entry
computation) and counts the operations of its body that are kernels on an accelerator:
fusions, custom calls (cuBLAS / cuDNN / Pallas), unfused dots, copies, scatters,
gathers, ... (not parameters, tuples, get-tuple-element, constants or bitcasts), going
into nested while loops and conditionals but not into fusions. The difference between
the two layer counts over their difference is the per-layer count; the rest is the
per-step overhead. A speculative round (DraftModel with a one-layer drafter of the
same shape, chain of k drafts) is counted the same way. Backend: JAX's default one,
so on a GPU the counts are the GPU's (its fusion passes differ from the CPU's).

  python experiments/launch_count.py [--preset bench-160m] [--batch 8] [--k 3]
      [--attention reference auto] [--layers 1 2] [--tiny]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specrl_jax as sj  # noqa: E402
from specrl_jax.config import PRESETS  # noqa: E402
from specrl_jax.kernels import ATTENTION_CHOICES  # noqa: E402
from specrl_jax.speculative import generate as generate_module, rollout as rollout_programs  # noqa: E402

FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
        "partition-id", "replica-id", "opt-barrier"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][a-z0-9\-]*)\((.*)$")


def parse_computations(hlo_text: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
  """{computation: [(opcode, rest of line)]} and the entry computation's name."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    if current is None:
      match = _COMPUTATION.match(line)
      if match:
        current = match.group(1)
        computations[current] = []
        if line.startswith("ENTRY"):
          entry = current
    elif line.startswith("}"):
      current = None
    else:
      match = _INSTRUCTION.match(line)
      if match:
        computations[current].append((match.group(1), match.group(2)))
  return computations, entry


def _called(rest: str, *keys: str) -> list[str]:
  names = []
  for key in keys:
    for match in re.finditer(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", rest):
      names += [name.strip(" {}%") for name in match.group(1).split(",")]
  return names


def count_launches(computations, name: str) -> collections.Counter:
  """Kernel-like ops of a computation, through nested while loops and conditionals."""
  counts = collections.Counter()
  for opcode, rest in computations[name]:
    if opcode in FREE:
      continue
    counts[opcode] += 1
    if opcode == "while":
      for inner in _called(rest, "condition", "body"):
        counts.update(count_launches(computations, inner))
    elif opcode == "call":  # e.g. the CPU's parallel task partitions
      for inner in _called(rest, "to_apply"):
        counts.update(count_launches(computations, inner))
    elif opcode == "conditional":
      for inner in _called(rest, "branch_computations", "true_computation",
                           "false_computation"):
        counts.update(count_launches(computations, inner))
  return counts


def decode_loop_counts(hlo_text: str) -> collections.Counter:
  """Counts of the body of the entry computation's largest while loop."""
  computations, entry = parse_computations(hlo_text)
  bodies = [_called(rest, "body")[0] for opcode, rest in computations[entry]
            if opcode == "while"]
  if not bodies:
    raise RuntimeError("no while loop in the entry computation")
  return max((count_launches(computations, body) for body in bodies),
             key=lambda counts: sum(counts.values()))


def compiled_rollout_text(config, *, batch: int, prompt_length: int, new_tokens: int,
                          drafter, spec, attention: str) -> str:
  model = nnx.eval_shape(lambda: sj.Transformer(config, rngs=nnx.Rngs(0)))
  sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
  prompts = [[1] * prompt_length for _ in range(batch)]
  # Distinct prompts, so prefill is batched as in a benchmark (not shared).
  prompts = [[1 + row] + p[1:] for row, p in enumerate(prompts)]
  engine = sj.EngineConfig(num_slots=batch, attention=attention)
  inputs, layout, drafter, topology, draft_mode = generate_module.prepare(
      config, prompts, sampling, engine, drafter, spec)
  graphdef, params = nnx.split(model)
  drafter_params = drafter.params() if drafter is not None else ()
  lowered = rollout_programs._generate.lower(
      graphdef, params, drafter_params, *inputs, jax.random.key(0), sampling=sampling,
      layout=layout, drafter=drafter, topology=topology, draft_mode=draft_mode)
  return lowered.compile().as_text()


def measure(config, *, layers: tuple[int, int], speculative: bool, k: int, **shape) -> dict:
  counts = {}
  for num_layers in layers:
    target = config.replace(num_layers=num_layers)
    drafter = spec = None
    if speculative:
      small = nnx.eval_shape(lambda: sj.Transformer(config.replace(num_layers=1),
                                                    rngs=nnx.Rngs(1)))
      drafter, spec = sj.drafters.DraftModel(small), sj.SpecConfig(num_draft_tokens=k)
    counts[num_layers] = decode_loop_counts(compiled_rollout_text(
        target, drafter=drafter, spec=spec, **shape))
  low, high = layers
  opcodes = sorted(set(counts[low]) | set(counts[high]))
  per_layer = {op: (counts[high][op] - counts[low][op]) / (high - low) for op in opcodes}
  fixed = {op: counts[low][op] - per_layer[op] * low for op in opcodes}
  return {
      "per_layer_total": sum(per_layer.values()),
      "fixed_total": sum(fixed.values()),
      "per_layer": {op: n for op, n in per_layer.items() if n},
      "fixed": {op: n for op, n in fixed.items() if n},
      f"total_at_{config.num_layers}_layers": sum(fixed.values()) + config.num_layers * sum(
          per_layer.values()),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="bench-160m", choices=sorted(PRESETS))
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt-length", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--k", type=int, default=3, help="drafts per speculative round")
  parser.add_argument("--attention", nargs="+", default=["reference"], choices=ATTENTION_CHOICES,
                      help="count the loop with each (auto on CPU is the reference)")
  parser.add_argument("--layers", type=int, nargs=2, default=(2, 4),
                      help="the two layer counts whose difference gives per-layer counts")
  parser.add_argument("--tiny", action="store_true",
                      help="the preset's layout at toy widths (a quick dry run)")
  args = parser.parse_args(argv)
  config = PRESETS[args.preset]
  if args.tiny:
    config = config.replace(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_heads=4, num_kv_heads=2, head_dim=16)
  shape = dict(batch=args.batch, prompt_length=args.prompt_length,
               new_tokens=args.new_tokens)
  report = {"backend": jax.default_backend(), "preset": args.preset, "tiny": args.tiny,
            "config": dataclasses.asdict(config), **shape, "k": args.k,
            "layers_compared": list(args.layers), "by_attention": {}}
  for attention in args.attention:
    report["by_attention"][attention] = {
        part: measure(config, layers=tuple(args.layers), speculative=speculative, k=args.k,
                      attention=attention, **shape)
        for part, speculative in (("decode_step", False), ("speculative_round", True))}
  print(json.dumps(report, indent=1, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
