"""The learner at real-size settings: float32 master weights under bfloat16 compute,
rematerialised blocks, and the log-prob pass skipped, each against the plain step."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import parallel, rl

SAMPLING = sj.SamplingParams(temperature=1.0)
MODEL = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=128, num_layers=4,
                       num_heads=4, num_kv_heads=2, head_dim=8)
B, T, PROMPT = 8, 48, 8


def _batch(model, *, seed=0, old=True):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, MODEL.vocab_size, (B, T)).astype(np.int32)
  positions = np.arange(T)[None]
  mask = (positions >= PROMPT) & (positions < PROMPT + rng.integers(1, T - PROMPT, B)[:, None])
  logprobs = np.asarray(rl.policy_log_probs(model, tokens, mask, SAMPLING), np.float32)
  rollout = np.where(mask, logprobs + rng.normal(0, 0.01, (B, T)), 0).astype(np.float32)
  return rl.Batch(tokens=tokens, response_mask=mask, advantages=rng.normal(size=B)
                  .astype(np.float32), old_logprobs=logprobs if old else None,
                  rollout_logprobs=rollout)


def _step(model, config, batch, *, steps=1):
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  graphdef, params = nnx.split(model)
  state = rl.init_train_state(params, config, mesh, rng=jax.random.key(0))
  step = rl.make_train_step(graphdef, config, mesh, state, sampling=SAMPLING)
  for _ in range(steps):
    state, metrics = step(state, batch)
  return state, jax.tree.map(np.asarray, metrics), step


def _leaves(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def _assert_same_update(got, want, before):
  """Per tensor, the update agrees to 1e-3 of its norm: Adam's first step is about
  lr * sign(gradient), so an entry whose gradient is ~0 may flip with rounding."""
  for a, b, w0 in zip(_leaves(got), _leaves(want), before):
    assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b - w0) + 1e-9


# ----------------------------------------------------------------- master weights

def test_a_bfloat16_model_trains_float32_weights_and_moments_and_computes_in_bfloat16():
  model = sj.Transformer(MODEL.replace(param_dtype="bfloat16", dtype="bfloat16"),
                         rngs=nnx.Rngs(0))
  batch = _batch(model)
  config = rl.LearnerConfig(learning_rate=1e-4, schedule="constant")
  state, metrics, _ = _step(model, config, batch)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
  # What the loss and the rollout read: the weights in the model's own dtype.
  assert {x.dtype for x in jax.tree.leaves(state.compute_params())} == {jnp.dtype(jnp.bfloat16)}
  # The first loss is the bf16 model's: the forward differentiated is the sampler's.
  _, bf16_metrics, _ = _step(model, dataclasses.replace(config, master_dtype=None), batch)
  assert metrics["loss"] == bf16_metrics["loss"]


def test_updates_below_bfloat16_resolution_are_kept_by_the_float32_master_copy():
  model = sj.Transformer(MODEL.replace(param_dtype="bfloat16", dtype="bfloat16"),
                         rngs=nnx.Rngs(0))
  before = _leaves(nnx.split(model)[1])
  batch = _batch(model)
  # Adam moves each weight by ~lr = 1e-6 per step, below half a bf16 ulp of all but
  # the smallest weights (|w| < ~256 lr): bf16 weights round those updates away.
  config = rl.LearnerConfig(learning_rate=1e-6, schedule="constant", max_grad_norm=None)
  master, _, _ = _step(model, config, batch, steps=3)
  bf16, _, _ = _step(model, dataclasses.replace(config, master_dtype=None), batch, steps=3)

  def moved_fraction(params):
    changed = [(a != b) for a, b, x in zip(_leaves(params), before, jax.tree.leaves(params))
               if x.ndim > 1]
    return sum(c.sum() for c in changed) / sum(c.size for c in changed)

  assert moved_fraction(bf16.params) < 0.05  # lost in bf16
  assert moved_fraction(master.params) > 0.9  # kept in f32
  for a, b in zip(_leaves(master.params), before):
    assert np.abs(a - b).max() < 1e-5  # ~3 lr: Adam's step, not a rounding jump


# ----------------------------------------------------------------- remat

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_remat_lowers_peak_training_memory_of_the_compiled_step():
  # A fresh process: the CPU scheduler that lets remat save memory is chosen by
  # XLA_FLAGS before JAX starts (the script adds it; see its docstring). The suite's
  # compile-speed flags (conftest) stay: the memory analysis is buffer assignment's,
  # the same within a few hundred bytes per policy with or without them, and the run
  # takes 22 CPU seconds instead of 60.
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(REPO))
  out = subprocess.run([sys.executable, str(REPO / "experiments" / "bench_remat.py"),
                        "--layers=4", "--length=64", "--policies=none,full,dots_saveable"],
                       env=env, capture_output=True, text=True, timeout=600, check=True)
  policies = json.loads(out.stdout)["policies"]
  none = policies["none"]
  # Full remat keeps one block's activations at a time: a small fraction of the rest.
  assert policies["full"]["loss_and_grad_temp_bytes"] < 0.4 * none["loss_and_grad_temp_bytes"]
  assert policies["full"]["unclipped_temp_bytes"] < 0.4 * none["unclipped_temp_bytes"]
  for name in ("full", "dots_saveable"):
    assert policies[name]["temp_bytes"] < 0.9 * none["temp_bytes"], policies
    assert policies[name]["loss_and_grad_temp_bytes"] < 0.8 * none["loss_and_grad_temp_bytes"]
    assert policies[name]["loss"] == none["loss"]
    np.testing.assert_allclose(policies[name]["grad_norm"], none["grad_norm"], rtol=1e-5)


def test_remat_leaves_the_loss_and_the_update_unchanged():
  model = sj.Transformer(MODEL, rngs=nnx.Rngs(0))
  batch = _batch(model)
  results = {remat: _step(model, rl.LearnerConfig(learning_rate=1e-3, remat=remat), batch)
             for remat in ("none", "dots_saveable", "full")}
  none_state, none_metrics, _ = results["none"]
  for remat in ("dots_saveable", "full"):
    state, metrics, _ = results[remat]
    np.testing.assert_allclose(metrics["loss"], none_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], none_metrics["grad_norm"], rtol=1e-5)
    _assert_same_update(state.params, none_state.params, _leaves(nnx.split(model)[1]))


def test_an_unknown_remat_policy_is_refused_with_the_allowed_names():
  with pytest.raises(sj.ConfigError, match=r"remat='some'.*'dots_saveable'.*'full'.*'none'"):
    rl.LearnerConfig(remat="some")


# ----------------------------------------------------------------- log-prob pass

def test_skipping_the_log_prob_pass_gives_the_update_of_the_pass_and_the_mismatch():
  model = sj.Transformer(MODEL, rngs=nnx.Rngs(0))
  with_old = _batch(model)  # old_logprobs: the learner's own, as the pass computes them
  config = rl.LearnerConfig(learning_rate=1e-3, loss=rl.GRPOConfig(tis_cap=2.0))
  passed, passed_metrics, _ = _step(model, config, with_old)
  skipped, skipped_metrics, _ = _step(model, dataclasses.replace(
      config, skip_log_prob_pass=True), dataclasses.replace(with_old, old_logprobs=None))
  _assert_same_update(skipped.params, passed.params, _leaves(nnx.split(model)[1]))
  np.testing.assert_allclose(skipped_metrics["loss"], passed_metrics["loss"], rtol=1e-5)
  np.testing.assert_allclose(skipped_metrics["grad_norm"], passed_metrics["grad_norm"],
                             rtol=1e-5)
  assert skipped_metrics["ratio_max"] == skipped_metrics["ratio_min"] == 1.0
  # The mismatch: |rollout - learner| per response token, in both modes.
  mask = with_old.response_mask
  gap = np.abs(with_old.rollout_logprobs - with_old.old_logprobs)[mask]
  for metrics in (passed_metrics, skipped_metrics):
    np.testing.assert_allclose(metrics["logprob_mismatch_mean"], gap.mean(), rtol=1e-3)
    np.testing.assert_allclose(metrics["logprob_mismatch_max"], gap.max(), rtol=1e-3)
    np.testing.assert_allclose(metrics["token_mult_prob_error"], np.exp(gap).mean(), rtol=1e-5)


def test_a_batch_without_old_log_probs_needs_the_pass_skipped():
  model = sj.Transformer(MODEL, rngs=nnx.Rngs(0))
  batch = _batch(model, old=False)
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  with pytest.raises(sj.ConfigError, match="old_logprobs.*skip_log_prob_pass=True"):
    rl.validate_batch(batch, mesh, rl.LearnerConfig())


# ----------------------------------------------------------------- LoRA

def test_lora_trains_adapters_on_a_frozen_base_and_computes_with_the_merged_weights():
  model = sj.Transformer(MODEL, rngs=nnx.Rngs(0))
  base = nnx.split(model)[1]
  batch = _batch(model)
  lora = rl.LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "o_proj", "down_proj"))
  config = rl.LearnerConfig(learning_rate=1e-2, schedule="constant", lora=lora)
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  state = rl.init_train_state(base, config, mesh, rng=jax.random.key(0))
  # B starts at zero: the merged policy is the base policy, exactly.
  assert _same_tree(state.compute_params(), base)
  names = sorted(state.params)
  assert len(names) == 3 * MODEL.num_layers and names[0] == "layers.0.attn.o_proj"
  assert state.params["layers.0.attn.o_proj"]["a"].shape == (4 * 8, 4)  # [H*Dh, r]
  step = rl.make_train_step(nnx.split(model)[0], config, mesh, state, sampling=SAMPLING)
  for _ in range(2):
    state, metrics = step(state, batch)
  assert _same_tree(state.frozen_params, base)  # the base never moves
  merged = state.compute_params()
  moved = {name for name, a, b in _named_pairs(merged, base) if not np.array_equal(a, b)}
  assert moved == {f"layers.{i}.{part}" for i in range(MODEL.num_layers)
                   for part in ("attn.q_proj", "attn.o_proj", "mlp.down_proj")}
  # What the loss differentiated is the merged model: its loss on the merged weights.
  merged_model = nnx.merge(nnx.split(model)[0], merged)
  full = rl.LearnerConfig(learning_rate=0.0, schedule="constant")
  _, merged_metrics, _ = _step(merged_model, full, batch)
  _, lora_metrics, _ = _step(merged_model, dataclasses.replace(
      config, learning_rate=0.0), batch)
  np.testing.assert_allclose(lora_metrics["loss"], merged_metrics["loss"], rtol=1e-6)
  # Adam state is the adapters' alone.
  assert sum(x.size for x in jax.tree.leaves(state.opt_state)) < 0.5 * sum(
      x.size for x in jax.tree.leaves(base))


def _same_tree(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _named_pairs(a, b):
  from specrl_jax.rl.loop.lora import _name
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    yield _name(path), np.asarray(x), np.asarray(y)
