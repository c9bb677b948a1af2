# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Drafter playground
#
# Write a new drafter in a few lines, plug it into `sj.generate`, prove that decoding
# with it is lossless with `specrl_jax.testing`, and measure its acceptance and speed.
#
# A drafter proposes the draft tree level by level:
#
# * `start(...)` returns log q at the root: the distribution of the token after the
#   last emitted one;
# * `extend(...)` returns log q after each node of the next tree level, given the
#   nodes' tokens (and the token paths leading to them).
#
# The engine draws the draft tokens from q (or takes q's top tokens), verifies them
# against the policy with exact rejection sampling and emits the accepted prefix. So a
# drafter can be *anything* that returns a distribution: however poor, the output
# distribution is the policy's; a better q only means more tokens per policy forward.
#
# In Colab pick a runtime (Runtime > Change runtime type: TPU, GPU or CPU), set
# SPECRL_SOURCE in the install cell below (where specrl_jax comes from: a path, a
# wheel or a URL; default: the installed package), and run all.
# With `SPECRL_FAST=1` (the test suite) the settings are tiny.

# %%
# Install specrl_jax from where you keep it. SPECRL_SOURCE is a pip requirement:
#   a path   "/content/specrl_jax" (a clone, or the repository uploaded to Colab),
#   a wheel  "/content/specrl_jax-0.1.0-py3-none-any.whl" (`python -m build` makes one),
#   a URL    "git+https://github.com/YOU/specrl_jax.git" (your fork).
# Default "" (or the SPECRL_SOURCE environment variable): install nothing and use the
# specrl_jax this kernel already imports (a local Jupyter in the project's .venv, the
# test suite). The project is not published to PyPI or a public repository yet, so in
# Colab set it before running this cell. In Colab the JAX build that matches the
# runtime's accelerator is installed with it.
import glob
import importlib.util
import os
import shutil
import subprocess
import sys

SPECRL_SOURCE = os.environ.get("SPECRL_SOURCE", "")
if SPECRL_SOURCE:
  packages = [SPECRL_SOURCE]
  if "google.colab" in sys.modules:
    if glob.glob("/dev/accel*") or "COLAB_TPU_ADDR" in os.environ:
      packages.insert(0, "jax[tpu]>=0.10,<0.13")
    elif shutil.which("nvidia-smi"):
      packages.insert(0, "jax[cuda12]>=0.10,<0.13")
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", *packages], check=True)
elif importlib.util.find_spec("specrl_jax") is None:
  raise RuntimeError("specrl_jax is not installed here: set SPECRL_SOURCE in this cell to "
                     "a path, a wheel or a pip URL of the project, then run it again.")

# %%
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import specrl_jax as sj
from specrl_jax import testing

FAST = os.environ.get("SPECRL_FAST", "0") == "1"
print(f"JAX {jax.__version__} on {jax.devices()}; fast settings: {FAST}")

# %% [markdown]
# ## 1. A drafter in ten lines: a bigram table
#
# q(next | last token) from a V x V table of log-probabilities. The table is an array,
# so it goes in `params()` (passed into the compiled program); the drafter object
# itself is a static, hashable argument. `start` looks up the row of each slot's last
# token; `extend` looks up the rows of the tree nodes' tokens.

# %%
class Bigram(sj.drafters.Drafter):
  """Drafts from a table log q[previous token, next token] (float32 [V, V])."""

  def __init__(self, log_q_VxV):
    self.log_q_VxV = jnp.asarray(log_q_VxV, jnp.float32)

  def params(self):
    return self.log_q_VxV

  def start(self, params, state, kv, inputs, sampling, max_pending):
    return params[inputs.last_token_N], state, kv, ()

  def extend(self, params, state, kv, scratch, inputs, level):
    return params[level.tokens_NxW], scratch


# %% [markdown]
# ## 2. A target and a bigram fitted to it
#
# The target is a tiny random transformer whose weights are scaled up so that its
# next-token distributions are peaked and depend strongly on the context (not only on
# the last token): exactly the kind of model on which a bookkeeping error in the
# speculative loop would show up. The prompt is a seed followed by the target's own
# greedy continuation. We fit the bigram to the target's samples.

# %%
VOCAB = 12
target_config = sj.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
target = testing.peaked_random_model(target_config, seed=0)
prompt = [1, 2, 3] + testing.greedy_reference(target, [[1, 2, 3]], 6)[0]
print("prompt:", prompt)

# One batch shape for fitting, the demo below and the timing in section 5, so that
# each configuration compiles once.
batch = [prompt] * 64
batch_sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=32)
counts_VxV = np.full((VOCAB, VOCAB), 0.1)  # add-0.1 smoothing: q > 0 everywhere
for seed in range(4):
  fit = sj.generate(target, batch, sampling=batch_sampling, rng=jax.random.key(seed))
  for row, length in zip(fit.tokens, fit.lengths):
    sequence = prompt + row[:length].tolist()
    np.add.at(counts_VxV, (sequence[:-1], sequence[1:]), 1.0)
bigram = Bigram(np.log(counts_VxV / counts_VxV.sum(axis=1, keepdims=True)))

plt.figure(figsize=(4, 3.4))
plt.imshow(np.exp(bigram.log_q_VxV), cmap="viridis")
plt.xlabel("next token")
plt.ylabel("previous token")
plt.title("the bigram drafter's q")
plt.colorbar()
plt.show()

# %% [markdown]
# ## 3. Plug it into `sj.generate`
#
# Any `SpecConfig`: a chain of k drafts, or a static tree (children per node at each
# depth), with drafts sampled from q (`draft_mode="sample"`) or q's top tokens
# (`"greedy"`).

# %%
out = sj.generate(target, batch, sampling=batch_sampling, rng=jax.random.key(5),
                  drafter=bigram, spec=sj.SpecConfig(num_draft_tokens=3))
print("first samples:\n", out.tokens[:4, :16])
print({k: out.stats[k] for k in ("acceptance_length", "per_position_acceptance",
                                 "target_calls", "generated_tokens")})

# %% [markdown]
# ## 4. Prove it lossless
#
# `testing.enumerate_sequence_distribution` computes the *exact* joint distribution of
# the first tokens of plain sampling from the target (by full forwards over every
# prefix). `testing.assert_joint_matches` runs a chi-square goodness-of-fit test of
# speculative samples against it (small bins merged; the threshold df + 10 sqrt(2 df)
# is about seven standard deviations, so a seeded test essentially never fails by
# chance while a real bias does). The joint, not per-position marginals, is what
# catches errors in how a position depends on earlier ones.

# %%
JOINT_LENGTH = 3
sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=8)
NUM_SAMPLES = 4_000 if FAST else 20_000
exact = testing.enumerate_sequence_distribution(target, prompt, sampling, JOINT_LENGTH)
print(f"{len(exact)} possible {JOINT_LENGTH}-token prefixes")
engine = sj.EngineConfig(page_size=4, num_slots=min(NUM_SAMPLES, 4096))

SPECS = {"chain k=3, sampled drafts": sj.SpecConfig(num_draft_tokens=3),
         "tree (2, 2, 1), sampled children": sj.SpecConfig(tree=(2, 2, 1)),
         "tree (3, 1), top-q children": sj.SpecConfig(tree=(3, 1), draft_mode="greedy")}
if FAST:  # each configuration compiles its own program
  SPECS = dict(list(SPECS.items())[:2])
samples = {}
for name, spec in SPECS.items():
  out = sj.generate(target, [prompt] * NUM_SAMPLES, sampling=sampling, engine=engine,
                    rng=jax.random.key(3), drafter=bigram, spec=spec)
  testing.assert_joint_matches(out.tokens, out.lengths, exact, name=name)
  samples[name] = out
  print(f"{name}: matches the exact joint ({NUM_SAMPLES} samples, acceptance length "
        f"{out.stats['acceptance_length']:.2f})")

# %% [markdown]
# The test has teeth: samples of the same target at temperature 0.7 instead of 1.0
# (what a warp mismatch between sampler and verifier would produce) are rejected. We
# draw them directly from the exact temperature-0.7 joint.

# %%
cooler = testing.enumerate_sequence_distribution(
    target, prompt, sj.SamplingParams(temperature=0.7, max_new_tokens=8), JOINT_LENGTH)
outcomes_07 = list(cooler)
probs_07 = np.asarray([cooler[o] for o in outcomes_07])
drawn = np.random.default_rng(0).choice(len(outcomes_07), NUM_SAMPLES, p=probs_07 / probs_07.sum())
biased_tokens = np.asarray([outcomes_07[i] for i in drawn])
try:
  testing.assert_joint_matches(biased_tokens, np.full(NUM_SAMPLES, JOINT_LENGTH), exact,
                               name="temperature 0.7")
  raise RuntimeError("the biased sampler passed: the test would be toothless")
except AssertionError as error:
  print("rejected, as it should be:\n", str(error)[:400])

# %%
outcomes = sorted(exact, key=exact.get, reverse=True)[:15]
name = next(iter(samples))
observed = testing.sequence_outcomes(samples[name].tokens, samples[name].lengths, JOINT_LENGTH)
frequency = {o: 0 for o in outcomes}
for o in observed:
  if o in frequency:
    frequency[o] += 1
x = np.arange(len(outcomes))
plt.figure(figsize=(10, 3))
plt.bar(x - 0.2, [exact[o] for o in outcomes], 0.4, label="exact (enumerated)")
plt.bar(x + 0.2, [frequency[o] / NUM_SAMPLES for o in outcomes], 0.4,
        label=f"speculative, {name}")
plt.xticks(x, ["".join(f"{t:x}" for t in o) for o in outcomes], rotation=60)
plt.xlabel("first three tokens (hex)")
plt.ylabel("probability")
plt.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Acceptance and speed
#
# Acceptance length is the number of tokens emitted per target forward (accepted
# drafts + 1). We compare the bigram with the built-in n-gram drafter (prompt and
# history lookup) for chains of k drafts, and time each configuration against plain
# decoding on the same batch (compiled first, then interleaved, best of N).
#
# On a CPU with a model this small a target forward costs about as much as the
# drafter and the bookkeeping, so do not expect wall-clock speedups here; what carries
# over to a large model is the acceptance length. `experiments/bench_spec.py` and
# `experiments/k_sweep.py` measure larger pairs.

# %%
KS = (3,) if FAST else (1, 2, 3, 4, 5)
REPEATS = 1 if FAST else 3
configs = {"plain": {}}
for k in KS:
  for drafter_name, drafter in (("bigram", bigram), ("n-gram", sj.drafters.NGram(n=3))):
    configs[f"{drafter_name} k={k}"] = dict(drafter=drafter,
                                            spec=sj.SpecConfig(num_draft_tokens=k))


def run(kwargs):
  return sj.generate(target, batch, sampling=batch_sampling, rng=jax.random.key(5),
                     **kwargs)


outputs = {name: run(kwargs) for name, kwargs in configs.items()}  # compiles
seconds = {name: [] for name in configs}
for _ in range(REPEATS):
  for name, kwargs in configs.items():
    started = time.perf_counter()
    outputs[name] = run(kwargs)
    seconds[name].append(time.perf_counter() - started)
plain_rate = outputs["plain"].stats["generated_tokens"] / min(seconds["plain"])
print(f"{'config':<14}{'acceptance':>11}{'tokens/s':>10}{'vs plain':>10}")
for name, out in outputs.items():
  rate = out.stats["generated_tokens"] / min(seconds[name])
  print(f"{name:<14}{out.stats['acceptance_length']:>11.2f}{rate:>10.0f}"
        f"{rate / plain_rate:>9.2f}x")

# %%
figure, axes = plt.subplots(1, 2, figsize=(11, 3.6))
for drafter_name in ("bigram", "n-gram"):
  names = [f"{drafter_name} k={k}" for k in KS]
  axes[0].plot(KS, [outputs[n].stats["acceptance_length"] for n in names], "o-",
               label=drafter_name)
  axes[1].plot(KS, [outputs[n].stats["generated_tokens"] / min(seconds[n]) / plain_rate
                    for n in names], "o-", label=drafter_name)
axes[0].set(xlabel="k (draft tokens per round)", ylabel="tokens per target forward",
            title="acceptance length")
axes[1].axhline(1.0, color="gray", ls="--", lw=0.8)
axes[1].set(xlabel="k (draft tokens per round)", ylabel="tokens/s relative to plain",
            title="speed (this machine)")
for axis in axes:
  axis.grid(alpha=0.3)
  axis.legend()
figure.tight_layout()
plt.show()

# %% [markdown]
# ## Next
#
# * `docs/drafters.md` describes the full interface: drafters that keep their own KV
#   cache (`kv_layers`, `prefill`, `tokens_to_feed`, `catch_up`), read the target's
#   hidden states (`hidden_layers`, `finish`, `record`), or carry per-slot state
#   (`init_state`, `on_admit`).
# * To train a drafter during RL, register an `OnlineDrafter` builder
#   (`specrl_jax.rl.loop.online_drafters.register`).
