"""What a run will do, said before it starts (``Session.plan``): the model, the data,
the reward, the drafter, sampling, steps, learning rate, mesh and output directory.
Presets set some of these silently (the ``dataset`` preset: learning rate 1e-6, 100
steps, 256 new tokens); the plan shows every one of them.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
from flax import nnx

from specrl_jax.config import ModelConfig
from specrl_jax.models.hf_config import model_config_from_hf
from specrl_jax.models.transformer import Transformer
from specrl_jax.rl.app import run_directory
from specrl_jax.rl.app.experiment import ExperimentConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataRows:
  """Rows the run trains on and holds out (held_out 0: no evaluation)."""
  source: str
  train: int
  held_out: int


def policy_model_config(config: ExperimentConfig, vocab_size: int) -> ModelConfig:
  """The policy's shape: its Hugging Face folder's config.json, else the fresh model's."""
  if config.policy.path:
    hf_config = run_directory.read_json(os.path.join(config.policy.path, "config.json"))
    return model_config_from_hf(hf_config or {})
  return config.policy.model_config(vocab_size)


def parameter_count(model_config: ModelConfig) -> int:
  """Parameters of a Transformer of this shape, counted on abstract arrays (nothing is
  allocated or initialised)."""
  abstract = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(abstract)))


def _count(n: int) -> str:
  for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= size:
      return f"{n / size:.2f}{unit}"
  return str(n)


def _drafter_line(config: ExperimentConfig, vocab_size: int) -> str:
  drafter = config.drafter
  k = f"{drafter.num_draft_tokens} draft tokens per round"
  online = ", trained online during RL" if drafter.online else ""
  if drafter.kind == "none":
    return "none: plain decoding"
  if drafter.kind == "ngram":
    return f"ngram (n={drafter.ngram_n}, from each prompt and its response so far), {k}"
  if drafter.kind == "history":
    fallback = f", else {drafter.fallback}" if drafter.fallback != "none" else ""
    return (f"history (earlier rollouts of the same prompt, its siblings, the sequence "
            f"itself{fallback}), {k}")
  if drafter.path:
    return f"{drafter.kind}: pretrained, loaded from {drafter.path}{online}; {k}"
  if drafter.kind == "draft_model":
    model = drafter.model
    size = _count(parameter_count(model.model_config(vocab_size)))
    source = (f"distilled from the policy for {config.warm_start.distill_steps} steps"
              if config.warm_start.distill_steps else
              "not distilled (warm_start.distill_steps=0: it starts untrained)")
    return (f"draft_model: a fresh {model.num_layers}-layer {model.hidden_size}-wide model "
            f"({size} parameters), {source}{online}; {k}")
  return f"{drafter.kind}: a fresh head on the policy's hidden states{online}; {k}"


def plan_lines(config: ExperimentConfig, *, vocab_size: int, rows: DataRows,
               reward: str, max_new_tokens: int, devices: int) -> list[str]:
  """The plan, one line per subject. vocab_size: the built-in vocabulary's, for a
  fresh policy (a Hugging Face folder's config.json has its own)."""
  model_config = policy_model_config(config, vocab_size)
  policy = (config.policy.path if config.policy.path else
            f"a fresh {model_config.num_layers}-layer {model_config.hidden_size}-wide model")
  rl, learner, warm = config.rl, config.learner_config(), config.warm_start
  held_out = (f"{rows.held_out} held out (evaluated every {config.data.eval_every} steps)"
              if rows.held_out and config.data.eval_every else
              f"{rows.held_out} held out" if rows.held_out else "none held out")
  sft = f"SFT {warm.sft_steps} steps, then " if warm.sft_steps else "no SFT, "
  decay = (f", decaying over {learner.decay_steps} steps" if learner.schedule != "constant"
           else "")
  resume = (" (resumes from its latest checkpoint)" if config.output.resume
            else " (starts over)")
  return [
      f"policy:   {policy}: {_count(parameter_count(model_config))} parameters, "
      f"{model_config.param_dtype} weights, {model_config.dtype} compute, "
      f"vocabulary {model_config.vocab_size}",
      f"data:     {rows.source}: {rows.train} rows to train on, {held_out}",
      f"reward:   {reward}",
      f"drafter:  {_drafter_line(config, vocab_size)}",
      f"sampling: temperature {rl.temperature}, at most {max_new_tokens} new tokens, "
      f"{rl.group_size} samples per prompt",
      f"steps:    {sft}{rl.steps} GRPO steps ({rl.mode}) of {rl.prompts_per_step} prompts x "
      f"{rl.group_size} samples",
      f"learning: rate {learner.learning_rate:g} ({learner.schedule}, {learner.warmup_steps} "
      f"warmup steps{decay}), max grad norm {learner.max_grad_norm}, KL beta "
      f"{learner.loss.beta:g}",
      f"mesh:     {_mesh_line(config, devices)}",
      f"output:   {config.output.directory}{resume}",
  ]


def _mesh_line(config: ExperimentConfig, devices: int) -> str:
  rl = config.rl
  if rl.mode == "async":
    return (f"rollouts on {rl.rollout_devices} and training on {rl.train_devices} of "
            f"{devices} devices, tensor {rl.mesh[2]}")
  return (f"(data, fsdp, tensor) = {rl.mesh}: {math.prod(rl.mesh)} of {devices} "
          f"{jax.default_backend()} devices")
