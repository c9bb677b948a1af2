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
# # GRPO with speculative rollouts
#
# A few GRPO steps on a verifiable task (worked multi-digit additions), where every
# rollout is decoded speculatively: a small draft model proposes tokens, the policy
# verifies them with exact rejection sampling, and the draft model keeps training
# online on each batch. Because verification is lossless, the policy samples exactly
# what plain decoding would; speculation only changes how many policy forwards a
# rollout costs.
#
# What this notebook does:
# 1. the task and its reward;
# 2. a warm start (SFT of a tiny policy, a draft model distilled from it);
# 3. one rollout batch, plain and speculative, and a check that the rollout's
#    log-probs are exactly the policy's;
# 4. GRPO steps with speculative rollouts (one compiled call per step), then the same
#    steps with plain rollouts from the same warm start and seeds;
# 5. reward and acceptance plots.
#
# In Colab pick a runtime (Runtime > Change runtime type: TPU, GPU or CPU), set
# SPECRL_SOURCE in the install cell below (where specrl_jax comes from: a path, a
# wheel or a URL; default: the installed package), and run all.
# With `SPECRL_FAST=1` (the test suite) everything is tiny and runs in seconds.

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
import dataclasses
import time

import jax
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import specrl_jax as sj
from specrl_jax import testing
from specrl_jax.models import tokenizer
from specrl_jax.rl.loop import sync
from specrl_jax.rl.app.experiment import experiment_config
from specrl_jax.rl.app.train_command import Session

FAST = os.environ.get("SPECRL_FAST", "0") == "1"
print(f"JAX {jax.__version__} on {jax.devices()}; fast settings: {FAST}")

# %% [markdown]
# ## 1. The task
#
# `Arithmetic` samples additions and their worked, column-by-column solutions. The
# reward is a jittable function of token arrays (1 for the right answer after `#`
# followed by EOS, else 0), so it runs inside the compiled RL step.

# %%
# The "tiny" preset is what the test suite trains; "demo" is `make demo`'s setting.
# Both are frozen dataclasses; any field can be overridden like on the command line.
PRESET = "tiny" if FAST else "demo"
STEPS = 3 if FAST else 12
config = experiment_config(PRESET, [
    f"--rl.steps={STEPS}", "--output.progress=false", "--output.plots=false",
    "--output.tensorboard=false", "--output.resume=false",
    "--output.directory=runs/colab_grpo"])
session = Session(config)
task = session.task
problem = session.prompt_set.problems[0]
print(f"task {task.name}: prompt {problem.prompt!r}")
print(f"worked solution:\n{problem.solution}")

right = tokenizer.encode(problem.solution) + [tokenizer.EOS_ID]
wrong = tokenizer.encode(problem.solution[:-1] + "0") + [tokenizer.EOS_ID]
width = max(len(right), len(wrong))
tokens_RxL = np.full((2, width), -1, np.int32)
tokens_RxL[0, :len(right)], tokens_RxL[1, :len(wrong)] = right, wrong
targets = {k: np.repeat(v[None], 2, axis=0) for k, v in problem.targets.items()}
print("rewards of the solution and of a wrong final digit:",
      np.asarray(task.reward(targets, tokens_RxL, np.asarray([len(right), len(wrong)]))))

# %% [markdown]
# ## 2. Warm start
#
# RL from a random policy would never see a reward. The session SFTs the policy on
# worked solutions and distils the draft model from it (soft cross-entropy toward the
# policy's distribution: what a drafter needs to be accepted).

# %%
started = time.perf_counter()
models = session.warm_start()
policy, draft = models.policy, models.draft
print(f"warm start in {time.perf_counter() - started:.0f}s: policy "
      f"{policy.config.num_params():,} parameters, draft model {draft.config.num_params():,}")

# %% [markdown]
# ## 3. One speculative rollout batch
#
# `sj.generate` with `drafter=None` decodes plainly; with a drafter it decodes
# speculatively. Identical prompts (a GRPO group) are prefilled once and share their
# KV pages. The reported `logprobs` are the policy's warped log-probs of the emitted
# tokens, what GRPO's importance ratios need; we check them against full forwards of
# the policy.

# %%
group = config.rl.group_size
prompts = [p for p in session.prompt_set.prompts[:4] for _ in range(group)]
sampling = session.rollout_config.sampling
spec = sj.SpecConfig(num_draft_tokens=config.drafter.num_draft_tokens)
spec_out = sj.generate(policy, prompts, sampling=sampling, rng=jax.random.key(0),
                       drafter=sj.drafters.DraftModel(draft), spec=spec)
print(f"{len(prompts)} samples, {spec_out.stats['generated_tokens']} tokens; acceptance length "
      f"{spec_out.stats['acceptance_length']:.2f} tokens per policy forward, per-position "
      f"acceptance {np.round(spec_out.stats['per_position_acceptance'], 2)}")
print("first sample:", repr(tokenizer.decode(spec_out.tokens[0].tolist())))

reference = testing.response_log_probs(policy, prompts, spec_out.tokens, spec_out.lengths,
                                       sampling)
print("max |rollout log-prob - policy log-prob| =",
      float(np.max(np.abs(reference - spec_out.logprobs))))

# %% [markdown]
# ## 4. GRPO steps
#
# `sync.build_program` compiles one RL step: the speculative rollout (sharded over the
# mesh's data axes) -> rewards -> group advantages -> the learner's log-probs -> the
# GRPO update, plus the draft model's online distillation loss. The policy and drafter
# weights the next rollout reads are the ones the update just wrote: nothing is copied
# between steps.

# %%
def run_grpo(kind: str) -> list[dict]:
  """GRPO from the shared warm start with ``kind`` rollouts ("draft_model" or "none")."""
  session.config = dataclasses.replace(config, drafter=dataclasses.replace(config.drafter,
                                                                           kind=kind))
  drafter, online = session.drafter_for(models)
  mesh, _ = session.meshes()
  state = session.initial_state(models, online, mesh)
  program = sync.build_program(
      nnx.split(policy)[0], policy.config, task, session.learner, session.rollout_config,
      mesh, state, prompt_width=session.prompt_width, drafter=drafter, online=online,
      spec=session.spec if drafter is not None else None, engine=session.engine)
  records = []
  for step in range(STEPS):
    started = time.perf_counter()
    prompts_on_mesh = sync.prompts_on_mesh(session.step_prompts(step), mesh)
    state, metrics = program.rl_step(state, prompts_on_mesh, session.step_rng(step))
    metrics = sync.to_host(metrics)
    metrics["seconds"] = time.perf_counter() - started
    records.append(metrics)
    print(f"{kind:>11} step {step}: reward {metrics['reward_mean']:.3f}, acceptance length "
          f"{metrics['acceptance_length']:.2f}, drafter loss "
          f"{metrics.get('drafter/loss', float('nan')):.3f}, {metrics['seconds']:.1f}s")
  return records


speculative = run_grpo("draft_model")
plain = run_grpo("none")

# %% [markdown]
# ## 5. Reward and acceptance
#
# The first step includes compilation. With the same seeds, prompts and warm start, the
# two runs differ only through the random draws of the rollouts (speculative decoding
# consumes its random numbers differently), so their reward curves agree in
# distribution, not sample for sample. `experiments/reward_curves.py` runs this
# comparison over several seeds with a significance test.

# %%
steps = np.arange(STEPS)
figure, axes = plt.subplots(1, 3, figsize=(14, 3.6))
for name, records in (("speculative", speculative), ("plain", plain)):
  axes[0].plot(steps, [r["reward_mean"] for r in records], "o-", label=name)
axes[0].set(xlabel="GRPO step", ylabel="mean reward", title="reward")
axes[1].plot(steps, [r["acceptance_length"] for r in speculative], "o-", color="tab:blue")
axes[1].set(xlabel="GRPO step", ylabel="tokens per policy forward",
            title=f"acceptance length (k = {config.drafter.num_draft_tokens})")
per_position = np.asarray([r["per_position_acceptance"] for r in speculative])
for depth in range(per_position.shape[1]):
  axes[2].plot(steps, per_position[:, depth], "o-", label=f"draft token {depth + 1}")
axes[2].set(xlabel="GRPO step", ylabel="accepted fraction of rounds",
            title="per-position acceptance")
for axis in axes:
  axis.set_xticks(steps)
  axis.grid(alpha=0.3)
  if axis.get_legend_handles_labels()[0]:
    axis.legend()
figure.tight_layout()
plt.show()

calls = {name: sum(r["target_calls"] for r in records)
         for name, records in (("speculative", speculative), ("plain", plain))}
print(f"policy forwards over the run: plain {calls['plain']}, speculative "
      f"{calls['speculative']} ({calls['plain'] / calls['speculative']:.2f}x fewer)")
