"""Checkpoints: a run killed after saving resumes on another mesh as if never stopped.

Run as a script (``python tests/test_checkpoint.py DIR``) this file is the training
process that the test kills: it trains, saves, and SIGKILLs itself.
"""

import math
import os
import signal
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import parallel, rl
from specrl_jax.checkpoint import TrainCheckpointManager, restore_model, save_model

MODEL = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8)
CONFIG = rl.LearnerConfig(learning_rate=1e-3, schedule="cosine", warmup_steps=2,
                          decay_steps=10, num_micro_batches=2,
                          loss=rl.GRPOConfig(beta=0.05))
SAVED_MESH, RESUMED_MESH = (2, 4, 1), (2, 2, 2)
SAVED_STEPS, KEEP = 3, 2
B, T = 16, 10


def _drafter_loss(drafter_params, policy, batch):
  logits_BxTxV = policy.layer_hidden[0] @ drafter_params["lm_head"]
  targets_BxTxV = jax.nn.softmax(policy.logits, axis=-1)
  cross_entropy_BxT = -jnp.sum(targets_BxTxV * jax.nn.log_softmax(logits_BxTxV), axis=-1)
  return jnp.sum(cross_entropy_BxT * batch.response_mask) / math.prod(batch.tokens.shape), {}


DRAFTER = rl.DrafterObjective(loss_fn=_drafter_loss, hidden_layers=(1,))


def _batch(step):
  """A different, reproducible batch for every step."""
  rng = np.random.default_rng(100 + step)
  mask = np.arange(T)[None] >= rng.integers(2, T, (B, 1))
  return rl.Batch(
      tokens=rng.integers(0, MODEL.vocab_size, (B, T)).astype(np.int32), response_mask=mask,
      old_logprobs=np.where(mask, -math.log(64) + rng.normal(0, 0.3, (B, T)), 0)
      .astype(np.float32),
      advantages=np.asarray(rl.group_advantages(rng.normal(size=B), 4)))


def _init_args():
  graphdef, params = nnx.split(sj.Transformer(MODEL, rngs=nnx.Rngs(0)))
  drafter = {"lm_head": 0.02 * jax.random.normal(jax.random.key(1), (32, 64))}
  return graphdef, params, dict(rng=jax.random.key(0), with_reference=True,
                                drafter_params=drafter)


def _start(mesh):
  """A fresh run: model and drafter from fixed seeds, laid out on ``mesh``."""
  graphdef, params, options = _init_args()
  state = rl.init_train_state(params, CONFIG, mesh, **options)
  return state, rl.make_train_step(graphdef, CONFIG, mesh, state, drafter=DRAFTER)


def _train(state, step_fn, mesh, first, last):
  losses = []
  for step in range(first, last):
    state, metrics = step_fn(state, parallel.shard_batch(_batch(step), mesh))
    losses.append(float(metrics["loss"]))
  return state, losses


def _train_save_and_die(directory):
  mesh = parallel.make_mesh(SAVED_MESH)
  state, step_fn = _start(mesh)
  with TrainCheckpointManager(directory, max_to_keep=KEEP) as manager:
    for step in range(SAVED_STEPS):
      state, _ = _train(state, step_fn, mesh, step, step + 1)
      manager.save(int(state.step), state)
    manager.wait_until_finished()
    os.kill(os.getpid(), signal.SIGKILL)  # no clean shutdown: the files must suffice


def test_killed_run_resumes_on_another_mesh_with_the_uninterrupted_next_step(tmp_path):
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
  killed = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]

  manager = TrainCheckpointManager(tmp_path, max_to_keep=KEEP)
  assert manager.all_steps() == [2, 3] and manager.latest_step() == SAVED_STEPS

  resumed_mesh = parallel.make_mesh(RESUMED_MESH)
  _, params, options = _init_args()
  target = rl.abstract_train_state(params, CONFIG, resumed_mesh, **options)
  restored = manager.restore(target)  # the latest step, laid out as on the new mesh
  manager.close()
  fresh, resumed_step_fn = _start(resumed_mesh)
  assert int(restored.step) == SAVED_STEPS
  # Every leaf lands where the new mesh's rules put it.
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh)):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
  assert restored.params["embed"].sharding.mesh.shape == dict(zip(parallel.AXES, RESUMED_MESH))

  saved_mesh = parallel.make_mesh(SAVED_MESH)
  uninterrupted, step_fn = _start(saved_mesh)
  uninterrupted, _ = _train(uninterrupted, step_fn, saved_mesh, 0, SAVED_STEPS)
  # The checkpoint is the uninterrupted state at that step, bit for bit (same mesh,
  # same program, another process).
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored),
                              jax.tree.map(np.asarray, uninterrupted))
  _, [want] = _train(uninterrupted, step_fn, saved_mesh, SAVED_STEPS, SAVED_STEPS + 1)
  _, [got] = _train(restored, resumed_step_fn, resumed_mesh, SAVED_STEPS, SAVED_STEPS + 1)
  assert abs(got - want) <= 1e-5 * abs(want)


def test_model_weights_restore_onto_a_sharded_abstract_model(tmp_path):
  model = sj.Transformer(MODEL, rngs=nnx.Rngs(3))
  save_model(tmp_path / "model", model)
  mesh = parallel.make_mesh((1, 4, 2))
  abstract = nnx.eval_shape(lambda: sj.Transformer(MODEL, rngs=nnx.Rngs(0)))
  shardings = parallel.named_shardings(nnx.state(abstract), mesh, parallel.TRANSFORMER_RULES)
  restored = restore_model(tmp_path / "model", abstract, shardings=shardings)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, nnx.state(restored)),
                              jax.tree.map(np.asarray, nnx.state(model)))
  assert restored.layers[0].attn.q_proj[...].addressable_shards[0].data.shape == (8, 2, 8)
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  chex.assert_trees_all_close(restored(tokens), model(tokens), rtol=1e-5, atol=1e-6)


def test_restore_needs_a_checkpoint_and_a_target_layout(tmp_path):
  with TrainCheckpointManager(tmp_path / "empty") as manager:
    assert manager.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
      manager.restore({"x": jnp.zeros(2)})
    manager.save(0, {"x": jnp.zeros(2)})
    manager.wait_until_finished()
    with pytest.raises(ValueError, match="has no sharding"):
      manager.restore({"x": jax.ShapeDtypeStruct((2,), jnp.float32)})


if __name__ == "__main__":
  _train_save_and_die(sys.argv[1])
