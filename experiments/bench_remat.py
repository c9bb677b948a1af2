"""Peak training memory of the GRPO train step under each remat policy, from the
compiled program's own memory analysis (``temp_size_in_bytes``: everything the step
allocates besides its arguments and outputs), with the loss and gradient norm of one
step to show they do not change. ``loss_and_grad_temp_bytes`` is the same for the loss
and its gradient compiled alone, without the optimizer's update around them, and
``unclipped_temp_bytes`` for the step without global-norm gradient clipping: on CPU
the clipping (every gradient before any update) is what keeps XLA's scheduler from
freeing the recomputed activations early, and most of remat's saving goes with it.

  python experiments/bench_remat.py [--layers 8] [--batch 8] [--length 96] [--hidden 32]

On CPU, XLA's default scheduler favours concurrency and hoists the recomputed forward
of every block before the backward, which undoes remat; the memory-minimising
scheduler (what GPU and TPU use) is selected here, before JAX starts, unless
XLA_FLAGS already says otherwise.

Measured on the shared 2-core CPU (2026-12-02) with the defaults: see
results/bench_remat.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

if "concurrency_optimized_scheduler" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                             "--xla_cpu_enable_concurrency_optimized_scheduler=false").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import specrl_jax as sj  # noqa: E402
from specrl_jax import parallel, rl  # noqa: E402
from specrl_jax.models.transformer import REMAT_POLICIES  # noqa: E402
from specrl_jax.rl.algo.aggregation import aggregation_weights, valid_token_weights  # noqa: E402
from specrl_jax.rl.loop.policy_loss import policy_and_drafter_loss  # noqa: E402

SAMPLING = sj.SamplingParams(temperature=1.0)


def batch_for(config: sj.ModelConfig, rows: int, length: int, seed: int = 0) -> rl.Batch:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.vocab_size, (rows, length)).astype(np.int32)
  mask = np.arange(length)[None] >= length // 4
  return rl.Batch(tokens=tokens, response_mask=np.broadcast_to(mask, (rows, length)),
                  advantages=rng.normal(size=rows).astype(np.float32),
                  old_logprobs=np.zeros((rows, length), np.float32))


def measure(config: sj.ModelConfig, batch: rl.Batch, remat: str) -> dict:
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  graphdef, params = nnx.split(sj.Transformer(config, rngs=nnx.Rngs(0)))
  learner = rl.LearnerConfig(remat=remat)
  state = rl.init_train_state(params, learner, mesh, rng=jax.random.key(0))
  step = rl.make_train_step(graphdef, learner, mesh, state, sampling=SAMPLING)
  compiled = step.jitted.lower(state, batch).compile()
  # The loss and its gradient alone (what remat acts on), without the optimizer.
  loss_fn = policy_and_drafter_loss(graphdef, learner, mesh, None, SAMPLING)
  grad = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)).lower(
      state.params, None, state, batch, aggregation_weights(batch.response_mask, learner.loss),
      valid_token_weights(batch.response_mask)).compile()
  unclipped = dataclasses.replace(learner, max_grad_norm=None)
  unclipped_state = rl.init_train_state(params, unclipped, mesh, rng=jax.random.key(0))
  unclipped_step = rl.make_train_step(graphdef, unclipped, mesh, unclipped_state,
                                      sampling=SAMPLING)
  unclipped_bytes = unclipped_step.jitted.lower(unclipped_state, batch).compile(
      ).memory_analysis()
  _, metrics = compiled(state, batch)
  return {"temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
          "unclipped_temp_bytes": int(unclipped_bytes.temp_size_in_bytes),
          "loss_and_grad_temp_bytes": int(grad.memory_analysis().temp_size_in_bytes),
          "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=96)
  parser.add_argument("--hidden", type=int, default=32)
  parser.add_argument("--policies", default=",".join(REMAT_POLICIES))
  args = parser.parse_args(argv)
  config = sj.ModelConfig(vocab_size=64, hidden_size=args.hidden,
                          intermediate_size=4 * args.hidden, num_layers=args.layers,
                          num_heads=4, num_kv_heads=2, head_dim=args.hidden // 4)
  batch = batch_for(config, args.batch, args.length)
  policies = {name: measure(config, batch, name) for name in args.policies.split(",")}
  print(json.dumps({"backend": jax.default_backend(), "layers": args.layers,
                    "batch": args.batch, "length": args.length, "hidden": args.hidden,
                    "xla_flags": os.environ.get("XLA_FLAGS", ""), "policies": policies},
                   indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
