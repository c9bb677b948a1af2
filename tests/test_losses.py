"""GRPO advantages, losses and trainer log-probs against plain numpy references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import rl
from specrl_jax.config import ConfigError

B, T = 6, 7
AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
VARIANTS = {  # name -> GRPOConfig overrides
    "plain": {},
    "kl": {"beta": 0.3},
    "tis": {"tis_cap": 1.5},
    "kl+tis": {"beta": 0.3, "tis_cap": 1.5},
}


def _inputs(seed=0):
  """Log-probs with clipping active on both sides, one all-masked row, and -inf /
  garbage at padded positions (which must never leak into loss or gradient)."""
  rng = np.random.default_rng(seed)
  mask = rng.random((B, T)) < 0.7
  mask[:, 0] = False
  mask[2] = False  # a row with no response token at all
  logprobs = -rng.gamma(2.0, 1.0, (B, T))
  old = logprobs + rng.normal(0, 0.4, (B, T))
  ref = logprobs + rng.normal(0, 0.5, (B, T))
  rollout = old + rng.normal(0, 0.6, (B, T))
  advantages = rng.normal(size=B)
  for array in (logprobs, old, ref, rollout):
    array[~mask] = -np.inf
  return dict(logprobs=logprobs, old=old, ref=ref, rollout=rollout, advantages=advantages,
              mask=mask)


def _numpy_reference(x, config: rl.GRPOConfig):
  """Loss and d loss / d logprobs, row by row in float64, straight from the papers."""
  mask = x["mask"]
  lo, hi = 1 - config.clip_eps_low, 1 + config.clip_eps_high
  per_token = np.zeros((B, T))
  grad_per_token = np.zeros((B, T))
  for b in range(B):
    for t in range(T):
      if not mask[b, t]:
        continue
      a = x["advantages"][b]
      ratio = np.exp(x["logprobs"][b, t] - x["old"][b, t])
      unclipped, clipped = ratio * a, np.clip(ratio, lo, hi) * a
      pg = -min(unclipped, clipped)
      # d(-ratio * A)/d logp = -ratio * A while the unclipped branch is the minimum.
      grad = -ratio * a if unclipped <= clipped else 0.0
      if config.tis_cap is not None:
        weight = min(np.exp(x["old"][b, t] - x["rollout"][b, t]), config.tis_cap)
        pg, grad = pg * weight, grad * weight
      if config.beta > 0:
        delta = x["ref"][b, t] - x["logprobs"][b, t]
        pg += config.beta * (np.exp(delta) - delta - 1)
        grad += config.beta * (1 - np.exp(delta))
      per_token[b, t], grad_per_token[b, t] = pg, grad

  lengths = mask.sum(axis=1)
  if config.aggregation == "token-mean":
    weights = mask / max(mask.sum(), 1)
  elif config.aggregation == "seq-mean-token-mean":
    nonempty = [b for b in range(B) if lengths[b] > 0]
    weights = np.zeros((B, T))
    for b in nonempty:
      weights[b] = mask[b] / lengths[b] / len(nonempty)
  else:
    weights = mask / (T * B)
  return float((per_token * weights).sum()), grad_per_token * weights


def _loss_fn(x, config):
  def loss(logprobs):
    return rl.grpo_loss(
        logprobs, jnp.asarray(x["old"], jnp.float32), jnp.asarray(x["advantages"], jnp.float32),
        jnp.asarray(x["mask"]), ref_logprobs=jnp.asarray(x["ref"], jnp.float32),
        rollout_logprobs=jnp.asarray(x["rollout"], jnp.float32), config=config)
  return loss


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("aggregation", AGGREGATION_MODES)
def test_loss_and_gradient_match_numpy_reference(aggregation, variant):
  x = _inputs()
  config = rl.GRPOConfig(aggregation=aggregation, clip_eps_low=0.2, clip_eps_high=0.28,
                         **VARIANTS[variant])
  expected_loss, expected_grad = _numpy_reference(x, config)
  (loss, metrics), grad = jax.value_and_grad(_loss_fn(x, config), has_aux=True)(
      jnp.asarray(x["logprobs"], jnp.float32))
  np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-7)
  assert metrics["clip_fraction"] > 0  # the inputs do exercise clipping
  chex.assert_tree_all_finite(metrics)


def test_metrics_are_token_means_over_valid_tokens():
  x = _inputs()
  config = rl.GRPOConfig(tis_cap=1.5)
  _, metrics = _loss_fn(x, config)(jnp.asarray(x["logprobs"], jnp.float32))
  m = x["mask"]
  ratio = np.exp(x["logprobs"][m] - x["old"][m])
  adv = np.broadcast_to(x["advantages"][:, None], (B, T))[m]
  clipped = np.clip(ratio, 0.8, 1.2) * adv < ratio * adv
  delta = x["ref"][m] - x["logprobs"][m]
  weight = np.exp(x["old"][m] - x["rollout"][m])
  expected = {
      "clip_fraction": clipped.mean(), "ratio_mean": ratio.mean(), "ratio_max": ratio.max(),
      "ratio_min": ratio.min(), "entropy": -x["logprobs"][m].mean(),
      "kl": (np.exp(delta) - delta - 1).mean(),
      "is_weight_mean": np.minimum(weight, 1.5).mean(),
      "is_capped_fraction": (weight > 1.5).mean(),
  }
  for name, value in expected.items():
    np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("aggregation", AGGREGATION_MODES)
def test_all_masked_batch_gives_zero_loss_and_zero_finite_gradient(aggregation):
  x = _inputs()
  x["mask"] = np.zeros((B, T), bool)
  config = rl.GRPOConfig(aggregation=aggregation, beta=0.1, tis_cap=2.0)
  (loss, _), grad = jax.value_and_grad(_loss_fn(x, config), has_aux=True)(
      jnp.asarray(x["logprobs"], jnp.float32))
  assert float(loss) == 0.0
  chex.assert_trees_all_equal(grad, jnp.zeros((B, T)))


def test_dr_grpo_normaliser_is_the_configured_constant():
  x = _inputs()
  short = rl.GRPOConfig(aggregation="seq-mean-token-sum-norm")
  long = rl.GRPOConfig(aggregation="seq-mean-token-sum-norm", max_response_length=4 * T)
  logprobs = jnp.asarray(x["logprobs"], jnp.float32)
  np.testing.assert_allclose(float(_loss_fn(x, short)(logprobs)[0]),
                             4 * float(_loss_fn(x, long)(logprobs)[0]), rtol=1e-6)


def test_micro_batch_losses_with_full_batch_weights_sum_to_the_full_loss():
  x = _inputs()
  config = rl.GRPOConfig(aggregation="seq-mean-token-mean", beta=0.2)
  mask = jnp.asarray(x["mask"])
  weights = rl.aggregation_weights(mask, config)
  metric_weights = rl.valid_token_weights(mask)
  as32 = {k: jnp.asarray(v, jnp.float32) for k, v in x.items() if k != "mask"}
  full, full_metrics = rl.grpo_loss(as32["logprobs"], as32["old"], as32["advantages"], mask,
                                    ref_logprobs=as32["ref"], config=config)
  parts = [rl.grpo_loss(as32["logprobs"][rows], as32["old"][rows], as32["advantages"][rows],
                        mask[rows], ref_logprobs=as32["ref"][rows], config=config,
                        token_weights=weights[rows], metric_weights=metric_weights[rows])
           for rows in (slice(0, 2), slice(2, 6))]
  np.testing.assert_allclose(float(sum(p[0] for p in parts)), float(full), rtol=1e-6)
  combined = rl.combine_metrics(jax.tree.map(lambda *v: jnp.stack(v), *[p[1] for p in parts]))
  chex.assert_trees_all_close(combined, full_metrics, rtol=1e-6)


def test_bad_configs_name_the_field():
  with pytest.raises(ConfigError, match="aggregation='seq-sum'"):
    rl.GRPOConfig(aggregation="seq-sum")
  with pytest.raises(ConfigError, match="clip_eps_low"):
    rl.GRPOConfig(clip_eps_low=1.0)
  with pytest.raises(ConfigError, match="tis_cap"):
    rl.GRPOConfig(tis_cap=0.0)
  with pytest.raises(ConfigError, match="beta"):
    rl.GRPOConfig(beta=-0.1)
  x = _inputs()
  logprobs = jnp.asarray(x["logprobs"], jnp.float32)
  with pytest.raises(ConfigError, match="ref_logprobs"):
    rl.grpo_loss(logprobs, logprobs, x["advantages"], x["mask"], config=rl.GRPOConfig(beta=0.1))
  with pytest.raises(ConfigError, match="rollout_logprobs"):
    rl.grpo_loss(logprobs, logprobs, x["advantages"], x["mask"],
                 config=rl.GRPOConfig(tis_cap=2.0))


def test_new_aggregation_modes_register_by_name():
  name = "test-sequence-sum"
  rl.register_aggregation(name)(lambda mask_BxT, config: mask_BxT.astype(jnp.float32))
  try:
    x = _inputs()
    loss, _ = _loss_fn(x, rl.GRPOConfig(aggregation=name))(jnp.asarray(x["logprobs"], jnp.float32))
    expected, _ = _numpy_reference(x, rl.GRPOConfig(aggregation="token-mean"))
    np.testing.assert_allclose(float(loss), expected * x["mask"].sum(), rtol=1e-5)
  finally:
    del rl.AGGREGATIONS[name]


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_match_numpy(normalize_std):
  rewards = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0, 0.0, 2.0, 4.0, 6.0])
  groups = rewards.reshape(3, 4)
  expected = groups - groups.mean(axis=1, keepdims=True)
  if normalize_std:
    expected = expected / (groups.std(axis=1, keepdims=True) + 1e-6)
  got = rl.group_advantages(rewards, 4, normalize_std=normalize_std)
  np.testing.assert_allclose(np.asarray(got), expected.reshape(-1), rtol=1e-6, atol=1e-6)
  assert np.all(np.asarray(got)[4:8] == 0)  # a group with equal rewards teaches nothing


def test_group_advantages_reject_partial_groups():
  with pytest.raises(ConfigError, match=r"group_size=4 .*divisor of the batch size 10"):
    rl.group_advantages(np.zeros(10), 4)


@pytest.mark.parametrize("sampling", [
    sj.SamplingParams(temperature=0.7),
    sj.SamplingParams(temperature=1.3, top_k=5),
    sj.SamplingParams(temperature=1.0, top_p=0.8),
])
def test_token_log_probs_are_the_warped_next_token_log_probs(sampling):
  config = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8)
  model = sj.Transformer(config, rngs=nnx.Rngs(0))
  tokens = np.random.default_rng(1).integers(0, 64, (3, 9)).astype(np.int32)
  mask = np.zeros((3, 9), bool)
  mask[:, 4:] = True
  mask[2, 7:] = False  # a shorter response, right-padded
  # Every other response token is the argmax, which any warp keeps (finite log-prob);
  # the others are random and may fall outside top-k / top-p (log-prob -inf).
  for t in range(5, 9, 2):
    tokens[:, t] = np.argmax(np.asarray(model(tokens))[:, t - 1], axis=-1)
  logits = np.asarray(model(tokens), np.float64)
  got = np.asarray(rl.policy_log_probs(model, tokens, mask, sampling))
  for b in range(3):
    for t in range(9):
      if not mask[b, t]:
        assert got[b, t] == 0.0
        continue
      scaled = logits[b, t - 1] / sampling.temperature
      keep = np.ones(64, bool)
      if sampling.top_k:
        keep &= scaled >= np.sort(scaled)[-sampling.top_k]
      probs = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
      if sampling.top_p < 1:
        order = np.argsort(-probs)
        before = np.cumsum(probs[order]) - probs[order]
        keep[order[before >= sampling.top_p]] = False
      kept = np.where(keep, scaled, -np.inf)
      expected = kept[tokens[b, t]] - np.log(np.exp(kept - scaled.max()).sum()) - scaled.max()
      np.testing.assert_allclose(got[b, t], expected, rtol=1e-4, atol=1e-5)
