"""Where a decode step's time goes on a CPU: one layer-sized matmul [M, 1024] x
[1024, 2816] (bench-160m's MLP) at the row counts decoding meets (M = batch x tokens
per sequence), through XLA with the weight stored [in, out] (how specrl_jax stores it)
and [out, in] (how torch does), and through numpy and torch on the same machine.

Reported as the weight bytes read per second: at M = 1-8 a matmul should be bound by
reading the weight once, so this says how far each kernel is from that bound. Each
timing chains 24 distinct weights (beyond the caches) in one compiled loop.

  python experiments/bench_matmul.py [--rows 1 2 8 48] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

IN, OUT, WEIGHTS, LOOPS = 1024, 2816, 24, 4


def xla_seconds(x_MxK: np.ndarray, weights: list[np.ndarray], transposed: bool,
                repeats: int) -> float:
  """Per matmul; ``transposed``: weights stored [out, in], contracted on their dim 1."""
  product = ((lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
             if transposed else (lambda x, w: x @ w))

  def chained(x, ws):
    # Every output column feeds the next step: a slice of the product would let XLA
    # drop the unused columns' work.
    step = lambda _, x: x + 1e-3 * sum(product(x, w).sum(-1, keepdims=True) for w in ws)
    return jax.lax.fori_loop(0, LOOPS, step, x)

  run_jit = jax.jit(chained)
  ws = [jnp.asarray(w.T.copy() if transposed else w) for w in weights]
  x = jnp.asarray(x_MxK)
  run = lambda: jax.block_until_ready(run_jit(x, ws))
  run()
  return common.best_of(run, repeats) / (LOOPS * WEIGHTS)


def host_seconds(matmul, repeats: int) -> float:
  """Per matmul of ``matmul()``'s WEIGHTS, after one warm-up call."""
  matmul()
  return common.best_of(matmul, repeats) / WEIGHTS


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 48])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  torch.set_num_threads(os.cpu_count() or 1)
  rng = np.random.default_rng(0)
  weights = [rng.standard_normal((IN, OUT), dtype=np.float32) for _ in range(WEIGHTS)]
  torch_weights = [torch.from_numpy(w) for w in weights]
  torch_transposed = [torch.from_numpy(w.T.copy()) for w in weights]
  weight_bytes = IN * OUT * 4
  rows = []
  for m in args.rows:
    x = rng.standard_normal((m, IN), dtype=np.float32)
    x_torch = torch.from_numpy(x)
    with torch.no_grad():
      seconds = {
          "xla_weight_in_out": xla_seconds(x, weights, False, args.repeats),
          "xla_weight_out_in": xla_seconds(x, weights, True, args.repeats),
          "numpy": host_seconds(lambda: [x @ w for w in weights], args.repeats),
          "torch_weight_in_out": host_seconds(lambda: [x_torch @ w for w in torch_weights],
                                              args.repeats),
          "torch_linear_out_in": host_seconds(
              lambda: [torch.nn.functional.linear(x_torch, w) for w in torch_transposed],
              args.repeats)}
    row = {"rows": m, **{f"{name}_GBps": round(weight_bytes / s / 1e9, 1)
                         for name, s in seconds.items()},
           **{f"{name}_ms": round(1e3 * s, 3) for name, s in seconds.items()}}
    rows.append(row)
    print(row, file=sys.stderr)
  common.print_json({
      "benchmark": "bench_matmul", "shape": [IN, OUT], "dtype": "float32",
      "read_bandwidth_GBps": round(common.read_bandwidth_bytes_per_second() / 1e9, 1),
      "cpu_count": os.cpu_count(), "jax": jax.__version__, "torch": torch.__version__,
      "results": rows})
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
