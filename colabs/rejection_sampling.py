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
# # Lossless verification, step by step
#
# Speculative decoding is only useful for RL if it changes nothing about what the
# policy samples. This notebook takes the verification rule apart:
#
# 1. one draft token: accept with probability min(1, p/q), otherwise sample the
#    residual norm(max(0, p - q)); the emitted token follows p exactly;
# 2. chains of k drafts, and the expected tokens per target forward;
# 3. trees: several children per node, sampled without replacement or taken as q's
#    top tokens, with the residual updated after every rejected child;
# 4. a lossy shortcut, caught by the chi-square test;
# 5. the end-to-end exactness test of `sj.generate` against an exactly enumerated
#    target distribution.
#
# Sections 1-4 call the library's own `verify` (the function the decode loop runs)
# on hand-made p and q, with hundreds of thousands of slots at once.
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
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import specrl_jax as sj
from specrl_jax import testing
from specrl_jax.speculative.drafting import choose_children
from specrl_jax.speculative.topology import TreeTopology
from specrl_jax.speculative.verify import verify

FAST = os.environ.get("SPECRL_FAST", "0") == "1"
SLOTS = 20_000 if FAST else 200_000  # independent verifications per experiment
print(f"JAX {jax.__version__} on {jax.devices()}; fast settings: {FAST}")

# %% [markdown]
# ## 1. One draft token
#
# The target (policy) distribution p and the drafter's q over a vocabulary of 8. The
# drafter samples x ~ q; the verifier accepts it with probability min(1, p(x)/q(x)).
# The total acceptance probability is beta = sum_x min(p(x), q(x)). On rejection the
# token is drawn from the residual r = norm(max(0, p - q)). The emitted distribution
# is then
#
#   q(x) min(1, p(x)/q(x)) + (1 - beta) r(x) = min(p, q)(x) + max(0, p - q)(x) = p(x):
#
# the accepted mass fills p up to min(p, q), the residual fills in the rest.

# %%
V = 8
p = np.asarray([0.30, 0.22, 0.16, 0.12, 0.08, 0.06, 0.04, 0.02])
q = np.asarray([0.10, 0.35, 0.05, 0.20, 0.02, 0.13, 0.10, 0.05])
beta = np.minimum(p, q).sum()
residual = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()
emitted = q * np.minimum(1, p / q) + (1 - beta) * residual
print(f"acceptance probability beta = {beta:.3f}")
print("emitted == p:", np.allclose(emitted, p))

x = np.arange(V)
figure, axes = plt.subplots(1, 3, figsize=(14, 3.4))
axes[0].bar(x - 0.2, p, 0.4, label="p (target)")
axes[0].bar(x + 0.2, q, 0.4, label="q (drafter)")
axes[0].set_title("target and draft distributions")
axes[1].bar(x, np.minimum(p, q), label="accepted drafts: min(p, q)")
axes[1].bar(x, (1 - beta) * residual, bottom=np.minimum(p, q),
            label="after rejection: (1 - beta) r")
axes[1].step(x, p, where="mid", color="black", label="p")
axes[1].set_title("emitted = accepted + residual = p")
axes[2].bar(x, residual, color="tab:red")
axes[2].set_title("residual r = norm(max(0, p - q))")
for axis in axes:
  axis.set_xlabel("token")
  if axis.get_legend_handles_labels()[0]:
    axis.legend(fontsize=8)
figure.tight_layout()
plt.show()

# %% [markdown]
# Now the same with the library. `verify` takes, for N slots, the target's log-probs at
# the root and at every draft node, the draft tokens, and the drafter's log q at every
# internal node; it returns how many drafts each slot accepted and the emitted tokens.
# For this toy p and q do not depend on the context, so every node gets the same ones.

# %%
def run_verify(p_V, q_V, branching, draft_mode="sample", slots=SLOTS, seed=0):
  """Drafts a tree of shape ``branching`` from q and verifies it against p."""
  topology = TreeTopology(tuple(branching))
  log_p, log_q = jnp.log(jnp.asarray(p_V, jnp.float32)), jnp.log(jnp.asarray(q_V, jnp.float32))
  draft_key, verify_key = jax.random.split(jax.random.key(seed))
  tokens, valid, parents = [], [], 1
  for depth, children in enumerate(branching):
    level_log_q = jnp.broadcast_to(log_q, (slots, parents, V))
    level_tokens, level_valid = choose_children(jax.random.fold_in(draft_key, depth),
                                                level_log_q, children, draft_mode)
    tokens.append(level_tokens)
    valid.append(level_valid)
    parents *= children
  internal = 1 + topology.num_nodes - topology.level_sizes[-1]
  return verify(verify_key,
                jnp.broadcast_to(log_p, (slots, 1 + topology.num_nodes, V)),
                jnp.concatenate(tokens, axis=1), jnp.concatenate(valid, axis=1),
                jnp.broadcast_to(log_q, (slots, internal, V)), topology, draft_mode)


verdict = run_verify(p, q, (1,))
first_token = np.asarray(verdict.tokens_NxE[:, 0])
print(f"accepted fraction {float(verdict.num_accepted_N.mean()):.4f} (beta = {beta:.4f})")
testing.assert_distribution_matches(first_token, p, name="first emitted token")
print("the first emitted token follows p (chi-square test passed)")

# %% [markdown]
# ## 2. Chains of k drafts
#
# A chain repeats the rule down the drafts: every accepted draft moves one position
# on, the first rejection ends the round with a residual sample, and when all k are
# accepted a bonus token comes from p. With the same acceptance probability a at
# every depth, the expected number of tokens per target forward is
# (1 - a^(k+1)) / (1 - a).

# %%
KS = (1, 3, 5) if FAST else (1, 2, 3, 4, 5, 6, 7)
measured = [1 + float(run_verify(p, q, (1,) * k, seed=k).num_accepted_N.mean()) for k in KS]
ks = np.arange(1, max(KS) + 1)
theory = (1 - beta ** (ks + 1)) / (1 - beta)
plt.figure(figsize=(5, 3.4))
plt.plot(ks, theory, "-", label="(1 - a^(k+1)) / (1 - a)")
plt.plot(KS, measured, "o", label="library verify")
plt.xlabel("k (draft tokens per round)")
plt.xticks(ks)
plt.ylabel("tokens per target forward")
plt.title(f"chain acceptance length, a = {beta:.2f}")
plt.legend()
plt.grid(alpha=0.3)
plt.show()
print({k: round(m, 3) for k, m in zip(KS, measured)})

# %% [markdown]
# ## 3. Trees: several children per node
#
# **Sampled children (without replacement).** The children x_1, x_2, ... of a node are
# drawn from q without replacement. Child j is accepted with probability
# min(1, p_j(x_j) / q_j(x_j)), where after each rejection p_j becomes the residual
# norm(max(0, p_{j-1} - q_{j-1})) and q_j is q with the tried children removed and
# renormalised. Let's follow two children by hand.

# %%
first = 1  # suppose the drafter drew token 1 first and it was rejected
p1 = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()
q1 = np.where(x == first, 0, q) / np.where(x == first, 0, q).sum()
figure, axes = plt.subplots(1, 2, figsize=(11, 3.2))
for axis, (title, pp, qq) in zip(axes, (("first child: p, q", p, q),
                                        (f"after rejecting token {first}: p1, q1", p1, q1))):
  axis.bar(x - 0.2, pp, 0.4, label="target side")
  axis.bar(x + 0.2, qq, 0.4, label="draft side")
  axis.set(title=title, xlabel="token")
  axis.legend()
figure.tight_layout()
plt.show()
print("acceptance probability of each possible second child after that rejection:",
      np.round(np.minimum(1, p1 / np.where(q1 > 0, q1, np.inf)), 3))

# %% [markdown]
# **Deterministic children** (`draft_mode="greedy"`, as EAGLE-style top-b trees): the
# children are q's top tokens, each a point mass. Child c is accepted with probability
# p(c) / p_remaining; on rejection p(c) is zeroed and p renormalised.
#
# With more children per node, more of p's mass is covered and the first step is
# accepted more often; the emitted token still follows p.

# %%
BRANCHING = (1, 2, 3, 4)
rates = {}
for mode in ("sample", "greedy"):
  rates[mode] = []
  for children in BRANCHING:
    verdict = run_verify(p, q, (children,), draft_mode=mode, seed=10 + children)
    testing.assert_distribution_matches(np.asarray(verdict.tokens_NxE[:, 0]), p,
                                        name=f"{mode}, {children} children")
    rates[mode].append(float(verdict.num_accepted_N.mean()))
print("the emitted token follows p for every tree width and mode (chi-square tests passed)")

plt.figure(figsize=(5, 3.4))
for mode, label in (("sample", "children sampled from q"), ("greedy", "q's top children")):
  plt.plot(BRANCHING, rates[mode], "o-", label=label)
plt.xlabel("children of the root")
plt.xticks(BRANCHING)
plt.ylabel("P(a child is accepted)")
plt.title("one tree level")
plt.legend()
plt.grid(alpha=0.3)
plt.show()

# %% [markdown]
# ## 4. A lossy shortcut is caught
#
# "Typical acceptance" (Medusa) accepts a draft whenever the target gives it enough
# probability, here p(x) >= 0.1, without the residual correction. It accepts more,
# and it is biased: the test rejects it.

# %%
rng = np.random.default_rng(0)
drafts = rng.choice(V, SLOTS, p=q)
fallback = rng.choice(V, SLOTS, p=p)
typical = np.where(p[drafts] >= 0.1, drafts, fallback)
try:
  testing.assert_distribution_matches(typical, p, name="typical acceptance")
  raise RuntimeError("the lossy rule passed: the test would be toothless")
except AssertionError as error:
  print("rejected, as it should be:\n", error)

# %% [markdown]
# ## 5. The exactness test, end to end
#
# The checks above see one position. The decode loop also has to keep the KV cache,
# positions, tree masks and accepted paths straight across rounds, which only the
# *joint* distribution of several tokens exposes, on a target whose distributions
# depend on the whole context. `specrl_jax.testing` provides that test:
# `enumerate_sequence_distribution` computes the exact joint of plain sampling by full
# forwards over every prefix, and `assert_joint_matches` checks speculative samples
# against it. This is what `tests/test_speculative.py` runs for every verification
# mode, k, drafter, temperature and warp.

# %%
VOCAB = 12
config = sj.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
target = testing.peaked_random_model(config, seed=0)
# A draft model that agrees with the target often, but not always.
drafter = sj.drafters.DraftModel(testing.perturbed_model(target, seed=2, noise=0.3))
prompt = [1, 2, 3, 4]
sampling = sj.SamplingParams(temperature=0.8, top_k=6, max_new_tokens=6)
exact = testing.enumerate_sequence_distribution(target, prompt, sampling, length=3)
num_samples = 4_000 if FAST else 20_000
out = sj.generate(target, [prompt] * num_samples, sampling=sampling, rng=jax.random.key(0),
                  drafter=drafter, spec=sj.SpecConfig(tree=(2, 2, 1)),
                  engine=sj.EngineConfig(page_size=4, num_slots=min(num_samples, 4096)))
testing.assert_joint_matches(out.tokens, out.lengths, exact, name="tree (2, 2, 1)")
print(f"{num_samples} speculative samples (acceptance length "
      f"{out.stats['acceptance_length']:.2f}) match the exact joint of {len(exact)} "
      "three-token outcomes")

observed = testing.sequence_outcomes(out.tokens, out.lengths, 3)
counts = {}
for outcome in observed:
  counts[outcome] = counts.get(outcome, 0) + 1
outcomes = sorted(exact, key=exact.get, reverse=True)
expected = np.asarray([exact[o] for o in outcomes])
empirical = np.asarray([counts.get(o, 0) / num_samples for o in outcomes])
plt.figure(figsize=(4.5, 4))
plt.loglog(expected, np.maximum(empirical, 0.5 / num_samples), ".", alpha=0.6)
plt.plot([expected.min(), 1], [expected.min(), 1], "k--", lw=0.8)
plt.xlabel("exact probability")
plt.ylabel("speculative frequency")
plt.title("joint of the first three tokens")
plt.grid(alpha=0.3)
plt.show()
