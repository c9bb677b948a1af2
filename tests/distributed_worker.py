"""One process of the multi-process tests (tests/test_distributed.py starts two).

    python tests/distributed_worker.py --coordinator HOST:PORT --num-processes 2 \
        --process-id I --out DIR [--restore CHECKPOINT_DIR]

With 4 CPU devices per process it runs, over the 8 devices of both processes:
learner steps on a (2, 2, 2) mesh fed with process-local rows, a cooperative orbax
save (``DIR/checkpoint``), a restore of ``--restore`` (written by one process), and an
async-style round trip between a rollout sub-mesh on process 0 and a train sub-mesh on
process 1. Process 0 writes the results to ``DIR`` (npz/json) for the test to compare
with one process running the same functions on 8 devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from specrl_jax.checkpoint import TrainCheckpointManager
from specrl_jax.config import ModelConfig
from specrl_jax.models.transformer import Transformer
from specrl_jax.parallel import batch_sharding, distributed, make_mesh
from specrl_jax.rl.loop.learner import (
    Batch, LearnerConfig, abstract_train_state, init_train_state, make_log_prob_step,
    make_train_step,
)

MODEL = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
LEARNER = LearnerConfig(learning_rate=1e-2, schedule="constant", max_grad_norm=1.0)
ROWS, WIDTH, STEPS = 8, 12, 2


def make_params():
  return nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))[1]


def graphdef():
  return nnx.split(nnx.eval_shape(lambda: Transformer(MODEL, rngs=nnx.Rngs(0))))[0]


def host_batch(step: int) -> Batch:
  """Step ``step``'s global batch as host arrays (old log-probs filled in later)."""
  rng = np.random.default_rng(step)
  lengths = rng.integers(6, WIDTH + 1, ROWS)
  position = np.arange(WIDTH)[None, :]
  return Batch(tokens=rng.integers(3, MODEL.vocab_size, (ROWS, WIDTH)).astype(np.int32),
               response_mask=(position >= 4) & (position < lengths[:, None]),
               old_logprobs=np.zeros((ROWS, WIDTH), np.float32),
               advantages=rng.standard_normal(ROWS).astype(np.float32))


def load_batch(step: int, sharding: NamedSharding) -> Batch:
  """The global batch, each process reading only the rows its devices hold."""
  rows = distributed.process_rows(sharding, ROWS)
  local = jax.tree.map(lambda x: x[rows], host_batch(step))
  return distributed.local_batch_to_global(local, sharding, ROWS)


def to_host(tree):
  """Full host copies of global arrays, on every process."""
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def flat(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def learner_run(mesh):
  """STEPS GRPO updates on ``mesh``: (final state, per-step metrics as floats)."""
  state = init_train_state(make_params, LEARNER, mesh, rng=jax.random.key(0))
  step_fn = make_train_step(graphdef(), LEARNER, mesh, state)
  log_probs = make_log_prob_step(graphdef(), mesh, state.params)
  history = []
  for step in range(STEPS):
    batch = load_batch(step, batch_sharding(mesh))
    batch = batch.replace(old_logprobs=log_probs(state.params, batch.tokens,
                                                 batch.response_mask))
    state, metrics = step_fn(state, batch)
    history.append({k: float(v) for k, v in to_host(metrics).items()})
  return state, history


def async_round_trip(rollout_mesh, train_mesh, everywhere):
  """The async pipeline's traffic: weights pushed train -> rollout mesh, rollout
  log-probs computed there and sent back with the batch, an update on the train mesh,
  metrics sent to every device. Returns (metrics per step, the final weights pushed
  to the rollout mesh: readable on the processes that hold it)."""
  state = init_train_state(make_params, LEARNER, train_mesh, rng=jax.random.key(0))
  step_fn = make_train_step(graphdef(), LEARNER, train_mesh, state)
  rollout_params = NamedSharding(rollout_mesh, P())  # whole weights on each rollout device
  rollout_log_probs = make_log_prob_step(graphdef(), rollout_mesh, state.params)
  train_log_probs = make_log_prob_step(graphdef(), train_mesh, state.params)
  history = []
  for step in range(STEPS):
    pushed = distributed.transfer(state.params, rollout_params)
    batch = load_batch(step, batch_sharding(rollout_mesh))
    batch = batch.replace(rollout_logprobs=rollout_log_probs(pushed, batch.tokens,
                                                             batch.response_mask))
    batch = distributed.transfer(batch, batch_sharding(train_mesh))
    batch = batch.replace(old_logprobs=train_log_probs(state.params, batch.tokens,
                                                       batch.response_mask))
    state, metrics = step_fn(state, batch)
    metrics = distributed.transfer(metrics, everywhere)  # readable by every process
    history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
  return history, distributed.transfer(state.params, rollout_params)


def sub_meshes():
  """(rollout mesh on 2 of process 0's devices, train mesh on process 1's 4, a
  replicated sharding over all 8)."""
  devices = jax.devices()
  rollout = make_mesh((2, 1, 1), devices=devices[:2])
  train = make_mesh((1, 2, 2), devices=devices[4:8])
  return rollout, train, NamedSharding(make_mesh((8, 1, 1)), P())


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--coordinator", required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--restore")
  args = parser.parse_args(argv)
  distributed.initialize(distributed.DistributedConfig(
      coordinator=args.coordinator, num_processes=args.num_processes,
      process_id=args.process_id, initialization_timeout=60, heartbeat_timeout=20,
      shutdown_timeout=20))
  primary = distributed.is_primary()
  mesh = make_mesh((2, 2, 2))
  results = {}

  state, results["learner"] = learner_run(mesh)
  params = to_host(state.params)
  with TrainCheckpointManager(os.path.join(args.out, "checkpoint"), async_save=False) as saved:
    saved.save(STEPS, state)
  if args.restore:
    with TrainCheckpointManager(args.restore) as written_by_one:
      restored = written_by_one.restore(abstract_train_state(
          make_params, LEARNER, mesh, rng=jax.random.key(0)))
    restored_params = to_host(restored.params)

  results["async"], pushed = async_round_trip(*sub_meshes())
  if primary:
    np.savez(os.path.join(args.out, "params.npz"), **flat(params))
    np.savez(os.path.join(args.out, "pushed.npz"), **flat(jax.device_get(pushed)))
    if args.restore:
      np.savez(os.path.join(args.out, "restored.npz"), **flat(restored_params))
    with open(os.path.join(args.out, "results.json"), "w") as file:
      json.dump(results, file)
  return 0


if __name__ == "__main__":
  sys.exit(main())
