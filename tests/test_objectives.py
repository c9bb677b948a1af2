"""Policy objectives and advantage estimators by name: GSPO and CISPO against
hand-written references of the papers' formulas (values and gradients, with padding,
an empty response and micro-batches), in the loss and in the learner; unknown names
refused with the registered ones; a short `specrl train` run with each."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import parallel, rl
from specrl_jax.config import ConfigError
from specrl_jax.rl import tasks
from specrl_jax.rl.app import experiment, run_directory, train_command
from specrl_jax.rl.app.metrics import read_jsonl
from specrl_jax.rl.app.overrides import to_dict

B, T = 6, 7
AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
NEW_OBJECTIVES = ("gspo", "cispo")
VARIANTS = {"plain": {}, "kl+tis": {"beta": 0.3, "tis_cap": 1.5}}
# Bounds under which the inputs clip some sequences (GSPO's, from its paper: a sequence
# ratio averages its tokens' noise away) and some tokens (CISPO's cap).
CLIP = {"gspo": dict(clip_eps_low=3e-4, clip_eps_high=4e-4),
        "cispo": dict(clip_eps_low=0.2, clip_eps_high=0.28)}


def _inputs(seed=0, mask=None):
  """Ratios on both sides of the clip range, one row with no response token, and -inf
  at padded positions (which must never reach loss or gradient)."""
  rng = np.random.default_rng(seed)
  if mask is None:
    mask = rng.random((B, T)) < 0.7
    mask[:, 0] = False
    mask[2] = False
  logprobs = -rng.gamma(2.0, 1.0, (B, T))
  old = logprobs + rng.normal(0, 0.4, (B, T))
  ref = logprobs + rng.normal(0, 0.5, (B, T))
  rollout = old + rng.normal(0, 0.6, (B, T))
  advantages = rng.normal(size=B)
  for array in (logprobs, old, ref, rollout):
    array[~mask] = -np.inf
  return dict(logprobs=logprobs, old=old, ref=ref, rollout=rollout, advantages=advantages,
              mask=mask)


def _reference_weights(mask, aggregation):
  lengths = mask.sum(axis=1)
  if aggregation == "token-mean":
    return mask / max(mask.sum(), 1)
  if aggregation == "seq-mean-token-mean":
    nonempty = (lengths > 0).sum()
    return np.where(lengths[:, None] > 0, mask / np.maximum(lengths, 1)[:, None], 0) / nonempty
  return mask / (mask.shape[1] * mask.shape[0])


def _reference(x, config):
  """Loss and d loss / d logprobs in float64, sequence by sequence from the papers.

  GSPO: s_i = exp(mean_t (log pi - log pi_old)), loss_i = -min(s_i A_i, clip(s_i) A_i)
  on each of the sequence's tokens; d loss_i / d log pi_t = -s_i A_i / |y_i| while the
  unclipped branch is the minimum. CISPO: loss_t = -min(r_t, 1 + eps_high) A_i log pi_t
  with the weight held constant, so d / d log pi_t = -min(r_t, 1 + eps_high) A_i.
  """
  mask = x["mask"]
  weights = _reference_weights(mask, config.aggregation)
  lo, hi = 1 - config.clip_eps_low, 1 + config.clip_eps_high
  loss, grad = 0.0, np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    tokens = np.flatnonzero(mask[b])
    if tokens.size == 0:
      continue
    a = x["advantages"][b]
    lp, old = x["logprobs"][b, tokens], x["old"][b, tokens]
    tis = np.ones(tokens.size)
    if config.tis_cap is not None:
      tis = np.minimum(np.exp(old - x["rollout"][b, tokens]), config.tis_cap)
    w = weights[b, tokens]
    if config.objective == "gspo":
      s = np.exp(np.mean(lp - old))
      pg = -min(s * a, np.clip(s, lo, hi) * a)
      d_pg = -s * a / tokens.size if s * a <= np.clip(s, lo, hi) * a else 0.0
      loss += np.sum(w * tis * pg)
      grad[b, tokens] = np.sum(w * tis) * d_pg  # every token moves the one ratio
    else:
      clipped_weight = np.minimum(np.exp(lp - old), hi)
      loss += np.sum(w * tis * -clipped_weight * a * lp)
      grad[b, tokens] = w * tis * -clipped_weight * a
    if config.beta > 0:
      delta = x["ref"][b, tokens] - lp
      loss += config.beta * np.sum(w * (np.exp(delta) - delta - 1))
      grad[b, tokens] += config.beta * w * (1 - np.exp(delta))
  return loss, grad


def _value_and_grad(loss_fn):
  """Jitted: one compilation per call beats op-by-op dispatch of the loss's backward."""
  return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


def _loss_fn(x, config, rows=slice(None), token_weights=None, metric_weights=None):
  as32 = {k: jnp.asarray(v[rows], jnp.float32) for k, v in x.items() if k != "mask"}

  def loss(logprobs):
    return rl.grpo_loss(logprobs, as32["old"], as32["advantages"], jnp.asarray(x["mask"][rows]),
                        ref_logprobs=as32["ref"], rollout_logprobs=as32["rollout"],
                        config=config, token_weights=token_weights,
                        metric_weights=metric_weights)
  return loss


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("aggregation", AGGREGATION_MODES)
@pytest.mark.parametrize("objective", NEW_OBJECTIVES)
def test_loss_and_gradient_match_the_papers_formulas(objective, aggregation, variant):
  x = _inputs()
  config = rl.GRPOConfig(objective=objective, aggregation=aggregation, **CLIP[objective],
                         **VARIANTS[variant])
  expected_loss, expected_grad = _reference(x, config)
  (loss, metrics), grad = _value_and_grad(_loss_fn(x, config))(
      jnp.asarray(x["logprobs"], jnp.float32))
  np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-7)
  assert 0 < metrics["clip_fraction"] < 1  # the inputs clip some sequences / tokens
  chex.assert_tree_all_finite(metrics)


@pytest.mark.parametrize("objective", NEW_OBJECTIVES)
def test_micro_batches_with_full_batch_weights_give_the_full_batch_loss_and_gradient(objective):
  x = _inputs()
  config = rl.GRPOConfig(objective=objective, aggregation="seq-mean-token-mean", beta=0.2,
                         tis_cap=1.5, **CLIP[objective])
  mask = jnp.asarray(x["mask"])
  weights, metric_weights = rl.aggregation_weights(mask, config), rl.valid_token_weights(mask)
  logprobs = jnp.asarray(x["logprobs"], jnp.float32)
  (full, full_metrics), full_grad = _value_and_grad(_loss_fn(x, config))(logprobs)
  losses, grads, metrics = [], [], []
  for rows in (slice(0, 2), slice(2, 6)):
    (loss, part_metrics), grad = _value_and_grad(
        _loss_fn(x, config, rows, weights[rows], metric_weights[rows]))(logprobs[rows])
    losses.append(loss)
    grads.append(grad)
    metrics.append(part_metrics)
  np.testing.assert_allclose(float(sum(losses)), float(full), rtol=1e-6)
  np.testing.assert_allclose(np.concatenate(grads), np.asarray(full_grad), rtol=1e-6, atol=1e-9)
  combined = rl.combine_metrics(jax.tree.map(lambda *v: jnp.stack(v), *metrics))
  chex.assert_trees_all_close(combined, full_metrics, rtol=1e-6)


def test_gspo_is_grpo_when_every_response_is_one_token():
  """A one-token sequence's ratio is its token's ratio: the two objectives coincide."""
  one_token = np.zeros((B, T), bool)
  one_token[:, 3] = True
  x = _inputs(mask=one_token)
  logprobs = jnp.asarray(x["logprobs"], jnp.float32)
  results = {}
  for objective in ("grpo", "gspo"):
    config = rl.GRPOConfig(objective=objective, clip_eps_high=0.28, tis_cap=1.5, beta=0.1)
    results[objective] = _value_and_grad(_loss_fn(x, config))(logprobs)
  chex.assert_trees_all_close(results["gspo"], results["grpo"], rtol=1e-6)


def test_cispo_keeps_the_gradient_of_tokens_the_ppo_clip_drops():
  x = _inputs()
  logprobs = jnp.asarray(x["logprobs"], jnp.float32)
  grads = {objective: np.asarray(_value_and_grad(_loss_fn(
      x, rl.GRPOConfig(objective=objective)))(logprobs)[1]) for objective in ("grpo", "cispo")}
  dropped = x["mask"] & (grads["grpo"] == 0) & (x["advantages"][:, None] != 0)
  assert dropped.any()  # PPO's clip did zero some tokens' gradients here
  assert np.all(grads["cispo"][dropped] != 0)


def test_advantage_estimators_by_name_are_grpo_and_dr_grpo():
  rewards = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0, 0.0, 2.0, 4.0, 6.0])
  groups = rewards.reshape(3, 4)
  centered = (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
  normalized = centered / (groups.std(axis=1, keepdims=True) + 1e-6).repeat(4)
  for name, expected in (("group-normalized", normalized), ("group-centered", centered)):
    got = rl.estimate_advantages(rewards, 4, rl.GRPOConfig(advantage=name))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6, err_msg=name)
  assert rl.GRPOConfig().advantage == "group-normalized" and rl.GRPOConfig().objective == "grpo"


def test_unknown_names_are_refused_listing_the_registered_ones():
  with pytest.raises(ConfigError, match=r"GRPOConfig.objective='ppo' is invalid: expected "
                                        r"one of \['cispo', 'grpo', 'gspo'\]"):
    rl.GRPOConfig(objective="ppo")
  with pytest.raises(ConfigError, match=r"GRPOConfig.advantage='rloo' is invalid: expected "
                                        r"one of \['group-centered', 'group-normalized'\]"):
    rl.GRPOConfig(advantage="rloo")
  with pytest.raises(ConfigError, match=r"GRPOConfig.objective='gpso'.*'gspo'"):
    train_command.parse_argv(["--preset=tiny", "--learner.loss.objective=gpso"])
  with pytest.raises(ValueError, match="objective 'gspo' is already registered"):
    rl.register_objective("gspo")(lambda *args: None)
  with pytest.raises(ValueError, match="advantage estimator 'group-centered' is already"):
    rl.register_advantage("group-centered")(lambda *args: None)


def test_new_objectives_and_estimators_register_by_name():
  """docs/objectives.md's example: REINFORCE with a leave-one-out baseline (RLOO)."""
  @rl.register_objective("test-reinforce")
  def reinforce(logprobs_BxT, old_logprobs_BxT, advantages_B, valid_BxT, config):
    del old_logprobs_BxT, valid_BxT, config
    return rl.ObjectiveTerms(pg_BxT=-advantages_B[:, None] * logprobs_BxT,
                             clipped_BxT=jnp.zeros_like(logprobs_BxT))

  @rl.register_advantage("test-leave-one-out")
  def leave_one_out(rewards_B, group_size, config):
    del config
    rewards_PxG = jnp.asarray(rewards_B, jnp.float32).reshape(-1, group_size)
    others_PxG = (rewards_PxG.sum(axis=1, keepdims=True) - rewards_PxG) / (group_size - 1)
    return (rewards_PxG - others_PxG).reshape(-1)

  try:
    config = rl.GRPOConfig(objective="test-reinforce", advantage="test-leave-one-out")
    np.testing.assert_allclose(np.asarray(rl.estimate_advantages([1.0, 0, 0, 3, 3, 3], 3, config)),
                               [1, -0.5, -0.5, 0, 0, 0])
    x = _inputs()
    loss, metrics = _loss_fn(x, config)(jnp.asarray(x["logprobs"], jnp.float32))
    m = x["mask"]
    expected = -np.sum(np.broadcast_to(x["advantages"][:, None], (B, T))[m] * x["logprobs"][m])
    np.testing.assert_allclose(float(loss), expected / m.sum(), rtol=1e-5)
    assert float(metrics["clip_fraction"]) == 0.0
  finally:
    del rl.OBJECTIVES["test-reinforce"], rl.ADVANTAGES["test-leave-one-out"]


def test_a_run_recorded_with_normalize_std_resumes_with_the_estimator_it_used(tmp_path):
  """Runs recorded before advantages had names said normalize_std=True / False."""
  def with_advantage(name):
    config = experiment.PRESETS["tiny"]
    loss = dataclasses.replace(config.learner.loss, advantage=name)
    return dataclasses.replace(config, learner=dataclasses.replace(config.learner, loss=loss))

  record = to_dict(with_advantage("group-normalized"))
  del record["learner"]["loss"]["advantage"]
  record["learner"]["loss"]["normalize_std"] = False
  run_directory.write_json(str(tmp_path / run_directory.CONFIG), record)
  defaults = to_dict(experiment.ExperimentConfig())
  run_directory.check_resumable(str(tmp_path), [2], to_dict(with_advantage("group-centered")),
                                defaults=defaults)
  with pytest.raises(ConfigError, match="learner.loss.advantage: 'group-centered' -> "
                                        "'group-normalized'"):
    run_directory.check_resumable(str(tmp_path), [2],
                                  to_dict(with_advantage("group-normalized")), defaults=defaults)
  assert experiment.from_dict(record).learner.loss.advantage == "group-centered"


# The learner: one update of a tiny policy in two micro-batches, its loss and gradient
# norm against the full-batch hand-written reference through the model.
MODEL = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8)
ROWS, LENGTH, PROMPT = 8, 10, 3
SAMPLING = sj.SamplingParams(temperature=0.9)


@pytest.fixture(scope="module")
def learner_setup():
  graphdef, params = nnx.split(sj.Transformer(MODEL, rngs=nnx.Rngs(0)))
  params = jax.tree.map(np.asarray, params)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, MODEL.vocab_size, (ROWS, LENGTH)).astype(np.int32)
  lengths = rng.integers(1, LENGTH - PROMPT + 1, ROWS)
  lengths[5] = 0  # a row whose response is empty
  positions = np.arange(LENGTH)[None]
  mask = (positions >= PROMPT) & (positions < PROMPT + lengths[:, None])

  @jax.jit
  def log_probs(params):
    return rl.policy_log_probs(nnx.merge(graphdef, params), tokens, mask, SAMPLING)

  @jax.jit
  def pullback(params, d_logprobs_BxT):  # d loss / d params from d loss / d log-probs
    return jax.grad(lambda p: jnp.sum(log_probs(p) * d_logprobs_BxT))(params)

  logprobs = np.asarray(log_probs(params), np.float64)
  old = np.where(mask, logprobs + rng.normal(0, 0.3, (ROWS, LENGTH)), 0).astype(np.float32)
  batch = rl.Batch(tokens=tokens, response_mask=mask, old_logprobs=old,
                   advantages=np.asarray(rl.group_advantages(rng.normal(size=ROWS), 4)))
  reference_inputs = dict(logprobs=logprobs, old=old.astype(np.float64), mask=mask,
                          advantages=np.asarray(batch.advantages, np.float64))
  return dict(graphdef=graphdef, params=params, batch=batch, pullback=pullback,
              reference_inputs=reference_inputs)


@pytest.mark.parametrize("objective", NEW_OBJECTIVES)
def test_the_learners_micro_batched_step_is_the_full_batch_reference(learner_setup, objective):
  setup = learner_setup
  loss_config = rl.GRPOConfig(objective=objective, aggregation="seq-mean-token-mean",
                              **CLIP[objective])
  config = rl.LearnerConfig(learning_rate=1e-3, num_micro_batches=2, max_grad_norm=None,
                            loss=loss_config)
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  state = rl.init_train_state(setup["params"], config, mesh, rng=jax.random.key(0))
  step = rl.make_train_step(setup["graphdef"], config, mesh, state, sampling=SAMPLING)
  _, metrics = step(state, parallel.shard_batch(setup["batch"], mesh))
  expected_loss, d_logprobs = _reference(setup["reference_inputs"], loss_config)
  grads = setup["pullback"](setup["params"], jnp.asarray(d_logprobs, jnp.float32))
  expected_grad_norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads)))
  assert float(metrics["loss"]) == pytest.approx(expected_loss, rel=1e-5)
  assert float(metrics["grad_norm"]) == pytest.approx(expected_grad_norm, rel=1e-4)
  assert 0 < float(metrics["clip_fraction"]) < 1


def _spread(response, targets):
  """A reward that differs between samples without a trained policy (no warm start)."""
  del targets
  return float(len(response) % 3)


# Each with its paper's settings: GSPO's bounds and sequence mean, CISPO's one-sided
# cap (4, Tinker's default) and Dr.GRPO's advantages, to reach them from the flags too.
RUN_FLAGS = {
    "gspo": ["--learner.loss.clip_eps_low=3e-4", "--learner.loss.clip_eps_high=4e-4",
             "--learner.loss.aggregation=seq-mean-token-mean"],
    "cispo": ["--learner.loss.clip_eps_high=3.0", "--learner.loss.advantage=group-centered"],
}


@pytest.mark.parametrize("objective", NEW_OBJECTIVES)
def test_a_five_step_train_run_with_each_new_objective(tmp_path, objective):
  config = train_command.parse_argv([
      "--preset=tiny", "--drafter.kind=none", "--rl.steps=5", "--output.checkpoint_every=0",
      "--output.progress=false", "--output.tensorboard=false", f"--output.directory={tmp_path}",
      "--warm_start.sft_steps=0", "--learner.num_micro_batches=2",
      f"--learner.loss.objective={objective}", *RUN_FLAGS[objective]])
  session = train_command.Session(
      config, task=tasks.PythonRewardTask(task=config.task.make(), fn=_spread),
      log=lambda message: None)
  assert session.learner.loss.objective == objective
  models = session.warm_start()
  initial = jax.device_get(nnx.split(models.policy)[1])
  session.train(models)
  recorded = json.loads((tmp_path / "config.json").read_text())["learner"]["loss"]
  assert recorded["objective"] == objective  # what a resumed run must match
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(5))
  assert all(np.isfinite(r["loss"]) and r["update_finite"] for r in records)
  assert any(r["grad_norm"] > 0 for r in records)
  trained = jax.tree.leaves(jax.device_get(session.state.params))
  assert any(not np.array_equal(a, b) for a, b in zip(trained, jax.tree.leaves(initial)))
