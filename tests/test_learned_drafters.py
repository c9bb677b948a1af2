"""Learned drafters (MTP, EAGLE-3): exact decoding, training, checkpoints, bad inputs.

What must hold: with either head, random or trained, in chains and trees, sampled or
top-b children, the emitted tokens follow the target's exact joint distribution and
greedy decoding equals plain decoding; training-time test computes what decoding a
chain computes; offline training lowers the loss and raises the acceptance length the
engine measures; the online objective trains the head inside the RL learner and is
checkpointed with the policy; EAGLE / SpecForge folders load with their exact math;
mismatched layers, vocabularies, tables and hidden sizes fail with clear errors.
"""

import functools
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import specrl_jax as sj
from specrl_jax import parallel, rl, testing
from specrl_jax.rl.loop import online_drafters
from specrl_jax.checkpoint import TrainCheckpointManager
from specrl_jax.config import ConfigError
from specrl_jax.models.attention import CausalNoCache
from specrl_jax.speculative.drafters import specforge, training
from specrl_jax.speculative.drafters.eagle3 import Eagle3, check_draft_to_target
from specrl_jax.speculative.drafters.mtp import MTP

VOCAB = 16
CONFIG = sj.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
LAYERS = (0, 1, 2)
DRAFT_VOCAB_SIZE = 12  # of the 16 target ids: the other four are never drafted
PROMPT = [3, 14, 15, 9, 2]
NUM_SAMPLES = 20_000
CHI_SQUARE_SAMPLING = sj.SamplingParams(temperature=1.0, max_new_tokens=4)
ENGINE = sj.EngineConfig(page_size=4, num_slots=2048)
TRAINING = training.DrafterTrainingConfig(num_updates=80, batch_size=32, learning_rate=5e-3,
                                          unroll_steps=3)


def _random_drafters(target, draft_vocab):
  return {"mtp": MTP(target, seed=1),
          "eagle3": Eagle3(target, target_layers=LAYERS, draft_to_target=draft_vocab, seed=2)}


@pytest.fixture(scope="module")
def target():
  return testing.peaked_random_model(CONFIG, seed=0, weight_scale=6.0)


@pytest.fixture(scope="module")
def rollouts(target):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, VOCAB, rng.integers(1, 7)).tolist() for _ in range(256)]
  return training.rollout_data(target, prompts, rng=jax.random.key(0),
                               sampling=sj.SamplingParams(temperature=1.0, max_new_tokens=12),
                               engine=sj.EngineConfig(page_size=4))


@pytest.fixture(scope="module")
def draft_vocab(rollouts):
  return training.build_draft_vocab(rollouts.tokens[rollouts.response_mask], VOCAB,
                                    DRAFT_VOCAB_SIZE)


@pytest.fixture(scope="module")
def trained(target, rollouts, draft_vocab):
  """{kind: (random drafter, trained drafter, training history)}."""
  result = {}
  for kind, drafter in _random_drafters(target, draft_vocab).items():
    done, history = training.train_offline(drafter, target, rollouts, TRAINING, log_every=20,
                                           log=lambda record: None)
    result[kind] = (drafter, done, history)
  return result


@pytest.fixture(scope="module")
def exact(target):
  return testing.enumerate_sequence_distribution(target, PROMPT, CHI_SQUARE_SAMPLING, 3)


# Each case decodes with the trained head and, where listed, the random one (the same
# compiled program: weights are arguments).
CASES = {
    "mtp-chain-sample": ("mtp", sj.SpecConfig(num_draft_tokens=3), ("random", "trained")),
    "mtp-tree-greedy": ("mtp", sj.SpecConfig(tree=(2, 2, 1), draft_mode="greedy"),
                        ("trained",)),
    "eagle3-tree-sample": ("eagle3", sj.SpecConfig(tree=(2, 2, 1)), ("random", "trained")),
}


@pytest.fixture(scope="module")
def samples(target, trained):
  """{(case, "random" | "trained"): GenerateOutput of NUM_SAMPLES copies of PROMPT}."""
  outputs = {}
  for seed, (case, (kind, spec, variants)) in enumerate(CASES.items()):
    random_drafter, trained_drafter, _ = trained[kind]
    for variant in variants:
      drafter = random_drafter if variant == "random" else trained_drafter
      outputs[case, variant] = sj.generate(
          target, [PROMPT] * NUM_SAMPLES, sampling=CHI_SQUARE_SAMPLING,
          rng=jax.random.key(10 + seed), drafter=drafter, spec=spec, engine=ENGINE)
  return outputs


@pytest.mark.parametrize("case", [(c, v) for c, (_, _, vs) in CASES.items() for v in vs],
                         ids=lambda case: "-".join(case))
def test_samples_follow_the_exact_joint_distribution(samples, exact, case):
  out = samples[case]
  testing.assert_joint_matches(out.tokens, out.lengths, exact, name="-".join(case))
  testing.assert_per_position_matches(out.tokens, testing.marginals_from_joint(exact, VOCAB))


def test_training_lowers_the_loss_and_raises_the_measured_acceptance(trained, samples,
                                                                    greedy_chains):
  for kind in ("mtp", "eagle3"):
    _, _, history = trained[kind]
    assert history[-1]["loss"] < history[0]["loss"] - 0.05, (kind, history)
    first, last = history[0]["expected_acceptance"], history[-1]["expected_acceptance"]
    assert all(b > a for a, b in zip(first, last)), (kind, first, last)
  # Acceptance as the engine measures it, same program and rng, random vs trained head:
  # sampled chains (MTP) and greedy chains (EAGLE-3).
  measured = {"mtp": [samples["mtp-chain-sample", variant].stats["acceptance_length"]
                      for variant in ("random", "trained")],
              "eagle3": [out.stats["acceptance_length"] for out in greedy_chains]}
  for kind, (before, after) in measured.items():
    assert after > before + 0.2, (kind, before, after)


def test_drafts_never_leave_the_draft_vocabulary(trained, draft_vocab):
  _, drafter, _ = trained["eagle3"]
  outputs_1x5xD = jax.random.normal(jax.random.key(0), (1, 5, CONFIG.hidden_size))
  for sampling in (sj.SamplingParams(temperature=1.0), sj.SamplingParams(temperature=0.0)):
    log_q = np.asarray(drafter.target_log_q(drafter.params(), outputs_1x5xD, sampling))
    outside = np.setdiff1d(np.arange(VOCAB), draft_vocab)
    assert outside.size == VOCAB - DRAFT_VOCAB_SIZE
    assert np.all(log_q[..., outside] == -np.inf)
    assert np.all(np.isfinite(log_q[..., draft_vocab]))


PROMPTS = [[5], [3, 14, 15], [9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8], [3, 14, 15],
           [11, 0, 13, 2, 4, 4, 12, 10, 1]]
GREEDY_ENGINE = sj.EngineConfig(page_size=4, num_slots=3)
MAX_NEW = 12
DEPTH = 3
LONGER = sj.SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW + DEPTH + 1)


@pytest.fixture(scope="module")
def plain_greedy(target):
  """Plain greedy decoding of PROMPTS, DEPTH + 1 tokens longer than the speculative runs
  (whose last round may look that far ahead)."""
  return sj.generate(target, PROMPTS, sampling=LONGER, engine=GREEDY_ENGINE)


@pytest.fixture(scope="module")
def greedy_chains(target, trained):
  """(output with the random EAGLE-3 head, output with the trained one): greedy target,
  chains of DEPTH, one compiled program (weights are arguments)."""
  random_drafter, trained_drafter, _ = trained["eagle3"]
  return tuple(sj.generate(target, PROMPTS, drafter=drafter, engine=GREEDY_ENGINE,
                           sampling=sj.SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                           spec=sj.SpecConfig(num_draft_tokens=DEPTH))
               for drafter in (random_drafter, trained_drafter))


REFERENCE_ROWS, REFERENCE_WIDTH = 16, 32


@functools.partial(jax.jit, static_argnums=(0, 1))
def _target_features(drafter, target_graphdef, target_params, params, tokens_1xW):
  out = nnx.merge(target_graphdef, target_params).forward(tokens_1xW,
                                                          hidden_layers=drafter.hidden_layers)
  return drafter.head(params["weights"]).features(out.hidden, out.layer_hidden)


@functools.partial(jax.jit, static_argnums=0)
def _full_causal_decode(drafter, params, tokens_RxW, inputs_RxWxD):
  """The drafter over whole rows with plain causal attention (no cache), and the
  greedy draft (in target ids) after every entry."""
  positions_RxW = jnp.broadcast_to(jnp.arange(tokens_RxW.shape[1]), tokens_RxW.shape)
  outputs, _ = drafter.head(params["weights"]).decode(tokens_RxW, inputs_RxWxD, positions_RxW,
                                                      CausalNoCache())
  log_q = drafter.target_log_q(params, outputs, sj.SamplingParams(temperature=0.0))
  return outputs, jnp.argmax(log_q, axis=-1)


def _slow_chains(drafter, target, sequence, roots, depth, *, drafted):
  """For each root c: the drafter's outputs at c, ..., c + depth - 1 [R, depth, D] and
  its greedy drafts [R, depth], recomputed the slow way. Entries up to c read the
  target's features; entry c + k reads its parent's output (at c + k - 1) and holds the
  drafted token (``drafted``) or the sequence's own token. Each depth is one full causal
  forward over padded rows: later entries cannot change earlier ones."""
  tokens = np.zeros((REFERENCE_ROWS, REFERENCE_WIDTH), np.int32)
  tokens[:, :len(sequence)] = sequence
  target_graphdef, target_params = nnx.split(target)
  features = _target_features(drafter, target_graphdef, target_params, drafter.params(),
                              jnp.asarray(tokens[:1]))
  inputs = jnp.repeat(jnp.pad(features[:, :-1], ((0, 0), (1, 0), (0, 0))), REFERENCE_ROWS, 0)
  tokens = jnp.asarray(tokens)
  rows, roots = np.arange(len(roots)), np.asarray(roots)
  outputs, drafts = [], []
  for step in range(depth):
    all_outputs, greedy = _full_causal_decode(drafter, drafter.params(), tokens, inputs)
    outputs.append(all_outputs[rows, roots + step])
    drafts.append(greedy[rows, roots + step])
    inputs = inputs.at[rows, roots + step + 1].set(outputs[-1])
    if drafted:
      tokens = tokens.at[rows, roots + step + 1].set(drafts[-1])
  return np.stack(outputs, axis=1), np.stack(drafts, axis=1)


def test_the_engine_drafts_what_a_slow_reference_drafts(target, trained, plain_greedy,
                                                       greedy_chains):
  """With a greedy target (output equal to plain decoding) the chain is greedy and each
  round's acceptance follows from the drafts: the engine's round and per-depth
  acceptance counts equal a replay of the rounds with drafts from the slow reference.
  So features, KV and the feature store stay right across rounds, page boundaries,
  continuous batching and shared prompt pages. (EAGLE-3 here; MTP shares every line of
  this bookkeeping and differs only in the head the slow reference also runs.)"""
  drafter, out = trained["eagle3"][1], greedy_chains[1]
  np.testing.assert_array_equal(out.tokens, plain_greedy.tokens[:, :MAX_NEW])
  rounds, accepted = 0, np.zeros(DEPTH, int)
  for prompt, response in zip(PROMPTS, plain_greedy.tokens):
    sequence = prompt + response.tolist()
    roots = list(range(len(prompt), len(prompt) + MAX_NEW))
    _, drafts = _slow_chains(drafter, target, sequence, roots, DEPTH, drafted=True)
    root, generated = len(prompt), 1
    while generated < MAX_NEW:
      matches = np.cumprod(drafts[root - len(prompt)] == sequence[root + 1:root + 1 + DEPTH])
      rounds += 1
      accepted += matches
      root += int(matches.sum()) + 1
      generated += int(matches.sum()) + 1
  assert out.stats["draft_rounds"] == rounds
  np.testing.assert_allclose(out.stats["per_position_acceptance"], accepted / rounds)
  assert accepted[0] > 0


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_training_time_test_computes_what_chain_decoding_computes(target, kind):
  """Step i at position j is the depth-i node drafted from root j - i (drafted tokens
  being the true ones), as the slow reference recomputes it."""
  drafter = _random_drafters(target, np.arange(VOCAB))[kind]
  sequence = [4, 9, 1, 7, 7, 3, 12, 5, 0, 6]

  @jax.jit
  def training_time_test(weights, tokens_1xT):
    head = drafter.head(weights)
    out = target.forward(tokens_1xT, hidden_layers=drafter.hidden_layers)
    return training.unroll(head, tokens_1xT, head.features(out.hidden, out.layer_hidden), 4)

  steps = training_time_test(drafter.weights, jnp.asarray([sequence]))
  roots = [0, 3, 5]
  outputs, _ = _slow_chains(drafter, target, sequence, roots, 4, drafted=False)
  for row, root in enumerate(roots):
    for depth in range(4):
      np.testing.assert_allclose(steps[depth][0, root + depth], outputs[row, depth],
                                 atol=2e-5, err_msg=f"root {root} depth {depth}")


def test_online_objective_trains_the_head_in_the_learner_and_checkpoints_with_it(
    target, rollouts, tmp_path):
  drafter = _random_drafters(target, np.arange(VOCAB))["eagle3"]
  objective = online_drafters.online_objective(drafter, loss_weight=0.5, unroll_steps=2)
  assert objective.hidden_layers == LAYERS
  config = rl.LearnerConfig(learning_rate=1e-4, drafter_learning_rate=3e-3)
  sampling = sj.SamplingParams(temperature=1.0)
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  graphdef, params = nnx.split(target)
  state = rl.init_train_state(params, config, mesh, rng=jax.random.key(0),
                              drafter_params=drafter.weights)
  step = rl.make_train_step(graphdef, config, mesh, state, sampling=sampling,
                            drafter=objective)
  tokens, mask = rollouts.tokens[:16], rollouts.response_mask[:16]
  old = np.asarray(rl.policy_log_probs(target, tokens, mask, sampling))
  batch = rl.Batch(tokens=tokens, response_mask=mask, old_logprobs=old,
                   advantages=np.linspace(-1, 1, 16).astype(np.float32))
  batch = parallel.shard_batch(batch, mesh)
  losses = []
  for _ in range(4):
    state, metrics = step(state, batch)
    losses.append(float(metrics["drafter/loss"]))
  assert losses[-1] < losses[0], losses
  assert metrics["drafter/expected_acceptance"].shape == (2,)
  chex.assert_trees_all_equal(state.drafter_params["shared"], drafter.weights["shared"])
  # The head is part of the train state: saved and restored with the policy.
  with TrainCheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
    manager.save(4, state)
    restored = manager.restore(state)
  chex.assert_trees_all_equal(restored.drafter_params, state.drafter_params)
  # The trained weights drop into the drafter for the next rollout.
  updated = drafter.with_weights(restored.drafter_params)
  assert hash(updated) == hash(drafter) and updated == drafter


def test_joint_training_sends_the_mtp_loss_into_the_policy(target, rollouts):
  drafter = MTP(target)
  graphdef, params = nnx.split(target)
  tokens, mask = rollouts.tokens[:8], rollouts.response_mask[:8]

  @jax.jit
  def mtp_term_gradients(params, trainable):
    def mtp_term(params, trainable):
      weights = {"trainable": trainable, "shared": drafter.weights["shared"]}
      total, metrics = online_drafters.joint_loss(graphdef, params, drafter, weights, tokens,
                                                  mask, loss_weight=0.3)
      return metrics["drafter_loss"], (total, metrics)
    return jax.grad(mtp_term, argnums=(0, 1), has_aux=True)(params, trainable)

  (policy, head), (total, metrics) = mtp_term_gradients(params, drafter.weights["trainable"])
  assert float(total) == pytest.approx(
      float(metrics["target_loss"]) + 0.3 * float(metrics["drafter_loss"]), rel=1e-5)
  norm = lambda tree: float(jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(tree))))
  # The MTP term alone trains the head and moves the policy, through the hidden states
  # the head reads.
  assert norm(head) > 0 and norm(policy) > 0


def test_draft_vocabulary_is_the_most_frequent_ids_sorted():
  tokens = [np.array([5, 5, 5, 2, 2, 9, -1, -1]), [9, 9, 9, 9, 1]]
  table = training.build_draft_vocab(tokens, vocab_size=12, draft_vocab_size=4)
  np.testing.assert_array_equal(table, [1, 2, 5, 9])
  # Ties go to the lower id; unseen ids fill up in id order.
  np.testing.assert_array_equal(training.build_draft_vocab([[7]], 12, 3), [0, 1, 7])
  with pytest.raises(ConfigError, match=r"token id 12: .*\[0, 12\)"):
    training.build_draft_vocab([[12]], 12, 3)


# --- EAGLE / SpecForge folders ----------------------------------------------------

SPECFORGE_TABLE = np.asarray([0, 2, 3, 5, 7, 8, 9, 11, 12, 13, 15])


def _specforge_folder(path, hidden, rng, *, vocab=VOCAB, table=SPECFORGE_TABLE):
  """An EAGLE-3 head written the way SpecForge does: torch Linear layouts."""
  heads, kv_heads, head_dim, inter = 4, 2, 8, 48
  normal = lambda *shape: rng.normal(0, 0.2, shape).astype(np.float32)
  tensors = {
      "fc.weight": normal(hidden, 3 * hidden),
      "midlayer.input_layernorm.weight": 1 + normal(hidden),
      "midlayer.hidden_norm.weight": 1 + normal(hidden),
      "midlayer.self_attn.q_proj.weight": normal(heads * head_dim, 2 * hidden),
      "midlayer.self_attn.k_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
      "midlayer.self_attn.v_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
      "midlayer.self_attn.o_proj.weight": normal(hidden, heads * head_dim),
      "midlayer.post_attention_layernorm.weight": 1 + normal(hidden),
      "midlayer.mlp.gate_proj.weight": normal(inter, hidden),
      "midlayer.mlp.up_proj.weight": normal(inter, hidden),
      "midlayer.mlp.down_proj.weight": normal(hidden, inter),
      "norm.weight": 1 + normal(hidden),
      "lm_head.weight": normal(len(table), hidden),
      "d2t": (np.asarray(table) - np.arange(len(table))).astype(np.int64),
      "t2d": np.isin(np.arange(vocab), table),
  }
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "model.safetensors"))
  config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": vocab,
            "draft_vocab_size": len(table), "hidden_act": "silu", "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(LAYERS)}}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  return tensors, config


def _specforge_reference_logits(tensors, config, embed_VxH, tokens_T, fused_Tx3H):
  """SpecForge's step-0 forward written out in numpy on the torch-layout tensors."""
  eps, heads = config["rms_norm_eps"], config["num_attention_heads"]
  kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
  w = lambda name: tensors[name].astype(np.float64)
  norm = lambda x, name: w(name) * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
  length = len(tokens_T)
  fused = fused_Tx3H @ w("fc.weight").T
  previous = np.concatenate([np.zeros_like(fused[:1]), fused[:-1]])
  x = np.concatenate([norm(embed_VxH[tokens_T], "midlayer.input_layernorm.weight"),
                      norm(previous, "midlayer.hidden_norm.weight")], -1)
  q = (x @ w("midlayer.self_attn.q_proj.weight").T).reshape(length, heads, head_dim)
  k = (x @ w("midlayer.self_attn.k_proj.weight").T).reshape(length, kv_heads, head_dim)
  v = (x @ w("midlayer.self_attn.v_proj.weight").T).reshape(length, kv_heads, head_dim)
  inverse = 1.0 / config["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
  angles = np.arange(length)[:, None] * inverse
  cos = np.cos(np.concatenate([angles, angles], -1))[:, None]
  sin = np.sin(np.concatenate([angles, angles], -1))[:, None]
  rotate_half = lambda t: np.concatenate([-t[..., head_dim // 2:], t[..., :head_dim // 2]], -1)
  q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
  k, v = np.repeat(k, heads // kv_heads, 1), np.repeat(v, heads // kv_heads, 1)
  scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim)
  scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  attention = np.einsum("hts,shd->thd", probs, v).reshape(length, heads * head_dim)
  h = previous + attention @ w("midlayer.self_attn.o_proj.weight").T
  m = norm(h, "midlayer.post_attention_layernorm.weight")
  gate, up = m @ w("midlayer.mlp.gate_proj.weight").T, m @ w("midlayer.mlp.up_proj.weight").T
  h = h + (gate / (1 + np.exp(-gate)) * up) @ w("midlayer.mlp.down_proj.weight").T
  return norm(h, "norm.weight") @ w("lm_head.weight").T


def test_a_specforge_folder_loads_with_its_exact_math_and_round_trips(target, tmp_path):
  tensors, config = _specforge_folder(tmp_path / "eagle3", CONFIG.hidden_size,
                                      np.random.default_rng(0))
  drafter = specforge.load_specforge(tmp_path / "eagle3", target)
  assert drafter.hidden_layers == LAYERS
  np.testing.assert_array_equal(drafter.draft_to_target, SPECFORGE_TABLE)

  tokens = jnp.asarray([[4, 9, 1, 7, 7, 3, 12, 5]])
  out = target.forward(tokens, hidden_layers=LAYERS)
  head = drafter.head()
  logits = head.logits(training.unroll(head, tokens, head.features(out.hidden,
                                                                   out.layer_hidden), 1)[0])
  fused = np.concatenate([np.asarray(h[0], np.float64) for h in out.layer_hidden], -1)
  want = _specforge_reference_logits(tensors, config, np.asarray(target.embed[...], np.float64),
                                     np.asarray(tokens[0]), fused)
  np.testing.assert_allclose(np.asarray(logits[0]), want, rtol=1e-4, atol=1e-4)

  specforge.save_specforge(drafter, tmp_path / "again")
  written = load_file(str(tmp_path / "again" / "model.safetensors"))
  assert set(written) == set(tensors)
  for name, value in tensors.items():
    np.testing.assert_allclose(written[name], value, rtol=1e-6, err_msg=name)
  reloaded = specforge.load_specforge(tmp_path / "again", target)
  chex.assert_trees_all_equal(reloaded.weights, drafter.weights)


# --- Bad input ---------------------------------------------------------------------

def test_bad_layers_vocabularies_tables_and_hidden_sizes_raise_clear_errors(target, tmp_path):
  with pytest.raises(ConfigError, match=r"target layer 3 .*\[0, 2\]"):
    Eagle3(target, target_layers=(0, 1, 3))
  deeper = sj.Transformer(CONFIG.replace(num_layers=6), rngs=nnx.Rngs(0))
  for_deeper = Eagle3(deeper, target_layers=(1, 2, 5))
  with pytest.raises(ConfigError, match=r"target layer 5 .*3 layers"):
    sj.generate(target, PROMPTS, drafter=for_deeper)

  with pytest.raises(ConfigError, match=r"draft_to_target.*id 16.*\[0, 16\)"):
    Eagle3(target, draft_to_target=[0, 5, 16])
  with pytest.raises(ConfigError, match=r"draft_to_target.*distinct"):
    Eagle3(target, draft_to_target=[1, 1, 2])
  with pytest.raises(ConfigError, match=r"draft_to_target.*1-D integer"):
    check_draft_to_target(np.zeros((2, 2), np.int32), VOCAB)
  with pytest.raises(ConfigError, match=r"draft_to_target.*12 ids"):
    check_draft_to_target(np.arange(5), VOCAB, draft_vocab_size=12)
  larger_vocab = sj.Transformer(CONFIG.replace(vocab_size=32), rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match=r"vocab_size=32 .*vocab_size=16"):
    sj.generate(target, PROMPTS, drafter=MTP(larger_vocab))
  _specforge_folder(tmp_path / "other_vocab", CONFIG.hidden_size, np.random.default_rng(1),
                    vocab=32, table=np.arange(20, 32))
  with pytest.raises(ConfigError, match=r"vocab_size=32 .*vocab_size=16"):
    specforge.load_specforge(tmp_path / "other_vocab", target)

  _specforge_folder(tmp_path / "wide", 64, np.random.default_rng(1))
  with pytest.raises(ConfigError, match=r"hidden_size=64 .*target has hidden_size=32"):
    specforge.load_specforge(tmp_path / "wide", target)
  wide_target = sj.Transformer(CONFIG.replace(hidden_size=64), rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match=r"hidden_size=64 .*hidden_size=32"):
    sj.generate(target, PROMPTS, drafter=MTP(wide_target))
  with pytest.raises(ConfigError, match=r"MTP weight .*shape .*another hidden size"):
    MTP(target, weights=MTP(wide_target).weights)
  training.save_drafter(tmp_path / "wide_mtp", MTP(wide_target))
  with pytest.raises(ConfigError, match=r"another hidden size"):
    training.load_drafter(tmp_path / "wide_mtp", MTP(target))


def test_native_checkpoints_round_trip(target, trained, draft_vocab, tmp_path):
  for kind in ("mtp", "eagle3"):
    _, drafter, _ = trained[kind]
    training.save_drafter(tmp_path / kind, drafter)
    loaded = training.load_drafter(tmp_path / kind, _random_drafters(target, draft_vocab)[kind])
    chex.assert_trees_all_equal(loaded.weights, drafter.weights)
    assert (loaded.draft_to_target is None) == (drafter.draft_to_target is None)
