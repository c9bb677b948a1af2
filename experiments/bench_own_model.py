"""Every drafter of `specrl train` on one's own model, over RL epochs whose prompts recur.

The embedded arithmetic (worked column sums) rendered as a JSONL dataset through a BPE
tokenizer with a chat template, a Qwen3 saved by transformers and warm-started briefly
by SFT through `specrl train`'s own warm start (``--data.solution_field``); then GRPO
for ``--epochs`` passes over ``--prompts`` prompts with each drafter kind, built by
the drafter registry exactly as `specrl train` builds it (learned drafters train
online; the draft model is distilled first). Every step times each kind's rollout of
the same prompts, the kinds interleaved in a rotating order, ``--repeats`` times each
(median kept), then each kind takes its GRPO update on its own rollouts (lossless: the
same dynamics in distribution). Per step and kind: acceptance length and generation
speed-up over plain decoding (kind "none") of the same step.

  python experiments/bench_own_model.py [--epochs 3] [--prompts 16] [--group 4]
      [--kinds none,ngram,history,draft_model,eagle3,mtp] [--hidden 256] [--layers 4]
      [--slots 0]

Prints JSON and writes results/cpu/bench_own_model.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "results" / "cpu"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_workspace(root: Path, args) -> tuple[str, str]:
  """(model folder, dataset file): arithmetic rows and a fresh Qwen3 with its tokenizer."""
  import tokenizers
  import transformers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  from specrl_jax.rl.tasks import Arithmetic
  task = Arithmetic(min_digits=args.min_digits, max_digits=args.max_digits)
  rng = np.random.default_rng(0)
  problems = [task.sample(rng) for _ in range(args.prompts)]
  rows = [{"prompt": p.prompt, "solution": p.solution, "answer": p.solution.splitlines()[-1]}
          for p in problems]
  data = root / "arithmetic.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  bpe = tokenizers.Tokenizer(models.BPE(unk_token=None))
  bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
  corpus = [r["prompt"] + r["solution"] for r in rows] + ["user assistant system"]
  bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=args.vocab,
                                                      special_tokens=SPECIALS))
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
  tokenizer.chat_template = CHAT_TEMPLATE
  folder = root / "qwen3"
  tokenizer.save_pretrained(folder)
  config = transformers.Qwen3Config(
      vocab_size=bpe.get_vocab_size(), hidden_size=args.hidden,
      intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
      num_attention_heads=args.hidden // 64, num_key_value_heads=max(args.hidden // 128, 1),
      head_dim=64, tie_word_embeddings=False, max_position_embeddings=512)
  transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
  return str(folder), str(data)


def argv_for(kind: str, model: str, data: str, directory: Path, args, sft_steps: int):
  return [f"--model={model}", f"--dataset={data}", "--reward=exact_match",
          "--data.solution_field=solution", f"--data.max_response_tokens={args.max_new}",
          f"--warm_start.sft_steps={sft_steps}", f"--warm_start.distill_steps={args.distill}",
          "--warm_start.sft_learning_rate=3e-3", "--warm_start.sft_batch_size=16",
          f"--rl.prompts_per_step={args.prompts_per_step}", f"--rl.group_size={args.group}",
          f"--rl.steps={args.epochs * args.prompts // args.prompts_per_step}",
          "--learner.learning_rate=1e-5", f"--drafter.kind={kind}",
          f"--drafter.num_draft_tokens={args.k}", f"--rl.engine.num_slots={args.slots}",
          f"--drafter.history.rollout_tokens={args.max_new + 24}",
          "--output.progress=false", "--output.tensorboard=false", "--output.plots=false",
          f"--output.directory={directory}", "--output.resume=false"]


def warm_policy(root: Path, model: str, data: str, args) -> str:
  """The policy after `specrl train`'s SFT warm start, saved as a Hugging Face folder."""
  import specrl_jax as sj
  from specrl_jax.rl.app import train_command
  config = train_command.parse_argv(argv_for("none", model, data, root / "sft", args,
                                             args.sft_steps))
  session = train_command.Session(config, log=print)
  models = session.warm_start()
  folder = root / "policy"
  sj.save_hf(models.policy, folder)
  for name in os.listdir(model):
    if "token" in name or name == "generation_config.json" or name.endswith(".jinja"):
      shutil.copy(os.path.join(model, name), folder / name)
  return str(folder)


class Arm:
  """One drafter kind's session, compiled rollout and update, and its train state."""

  def __init__(self, kind: str, policy: str, data: str, root: Path, args):
    from specrl_jax.rl.app import train_command
    from specrl_jax.rl.loop.drafter_memory import rollout_memory
    self.kind = kind
    config = train_command.parse_argv(argv_for(kind, policy, data, root / kind, args, 0))
    self.session = train_command.Session(config, log=print)
    models = self.session.warm_start()
    drafter, online = self.session.drafter_for(models)
    mesh, _ = self.session.meshes()
    self.state = self.session.initial_state(models, online, mesh)
    program = self.session.sync_program(models, self.state, drafter, online, mesh)
    self.program, self.memory = program, rollout_memory(program.drafter)
    place = self.memory.place if self.memory else (lambda params, bank: params)
    self.generate = jax.jit(
        lambda state, prompts, rng, bank: program.rollout(
            state.compute_params(), place(program.rollout_drafter_params(state), bank),
            prompts, rng, state.step),
        in_shardings=(program.train_step.state_shardings, program.rows, program.replicated,
                      program.replicated))

  def bank(self):
    return self.memory.arrays() if self.memory else None

  def roll_out(self, prompts, rng):
    trajectories = self.generate(self.state, prompts, rng, self.bank())
    jax.block_until_ready(trajectories)
    return trajectories

  def learn(self, prompts, trajectories) -> None:
    if self.memory is not None:
      self.memory.observe(prompts.tokens_PxT, prompts.lengths_P, trajectories.batch.tokens,
                          trajectories.lengths_R, self.program.rollout_config.group_size)
    self.state, _ = self.program.train_jit(self.state, trajectories)


def step_record(arms, step: int, args, compiles: common.CompileCounter) -> dict:
  from specrl_jax.rl.loop.rollout import rollout_metrics
  from specrl_jax.rl.loop.sync import prompts_on_mesh
  session = arms[0].session
  prompts = prompts_on_mesh(session.step_prompts(step), arms[0].program.mesh)
  rng = session.step_rng(step)
  seconds = {arm.kind: [] for arm in arms}
  compiled = {arm.kind: 0 for arm in arms}
  first = {}
  for repeat in range(args.repeats):
    shift = (step + repeat) % len(arms)  # a rotating order: drifting load hits all alike
    for arm in arms[shift:] + arms[:shift]:
      before = compiles.count
      started = time.perf_counter()
      trajectories = arm.roll_out(prompts, rng)
      seconds[arm.kind].append(time.perf_counter() - started)
      compiled[arm.kind] += compiles.count - before
      first.setdefault(arm.kind, trajectories)
  record = {"step": step, "epoch": step * args.prompts_per_step // args.prompts, "kinds": {}}
  plain = statistics.median(seconds["none"]) if "none" in seconds else None
  for arm in arms:
    metrics = jax.device_get(rollout_metrics(first[arm.kind], args.max_new))
    median = statistics.median(seconds[arm.kind])
    record["kinds"][arm.kind] = {
        "generation_seconds": median,
        "generation_seconds_spread": [min(seconds[arm.kind]), max(seconds[arm.kind])],
        "acceptance_length": float(metrics["acceptance_length"]),
        "reward_mean": float(metrics["reward_mean"]),
        "generated_tokens": int(metrics["generated_tokens"]),
        "compilations_while_timed": compiled[arm.kind],
        "speedup_vs_plain": plain / median if plain else None}
    arm.learn(prompts, first[arm.kind])
  return record


def warm_up(arms) -> None:
  """Compiles every arm's rollout and update before anything is timed (on copies of the
  state, with a throwaway rng; nothing is remembered)."""
  from specrl_jax.rl.loop.sync import prompts_on_mesh
  session = arms[0].session
  prompts = prompts_on_mesh(session.step_prompts(0), arms[0].program.mesh)
  for arm in arms:
    trajectories = arm.roll_out(prompts, jax.random.key(12345))
    copy = jax.tree.map(lambda x: x.copy(), arm.state)
    arm.program.train_jit(copy, trajectories)


def summary(records, kinds, epochs) -> dict:
  out = {}
  for kind in kinds:
    by_epoch = {}
    for epoch in range(epochs):
      rows = [r["kinds"][kind] for r in records if r["epoch"] == epoch]
      if rows:
        by_epoch[epoch] = {
            "acceptance_length": statistics.median(r["acceptance_length"] for r in rows),
            "speedup_vs_plain": statistics.median(r["speedup_vs_plain"] or 0 for r in rows)}
    out[kind] = by_epoch
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kinds", default="none,ngram,history,draft_model,eagle3,mtp")
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--prompts-per-step", type=int, default=8)
  parser.add_argument("--group", type=int, default=4)
  parser.add_argument("--k", type=int, default=3)
  parser.add_argument("--max-new", type=int, default=48)
  parser.add_argument("--min-digits", type=int, default=2)
  parser.add_argument("--max-digits", type=int, default=3)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=96)
  # 0: a slot per sample (the dataset preset's). Few slots keep a verification's rows
  # below a CPU's ridge point, where a forward costs reading its weights.
  parser.add_argument("--slots", type=int, default=0)
  parser.add_argument("--sft-steps", type=int, default=150)
  parser.add_argument("--distill", type=int, default=100)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--output", default=str(RESULTS / "bench_own_model.json"))
  args = parser.parse_args(argv)
  kinds = args.kinds.split(",")
  if "none" not in kinds:
    kinds = ["none"] + kinds  # the plain baseline every speed-up is measured against
  root = Path(tempfile.mkdtemp(prefix="bench_own_model_"))
  model, data = write_workspace(root, args)
  policy = warm_policy(root, model, data, args)
  arms = [Arm(kind, policy, data, root, args) for kind in kinds]
  compiles = common.CompileCounter()
  warm_up(arms)
  steps = args.epochs * args.prompts // args.prompts_per_step
  records = []
  for step in range(steps):
    records.append(step_record(arms, step, args, compiles))
    print(json.dumps(records[-1]), flush=True)
  load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
  result = {"args": vars(args), "uptime": load, "steps": records,
            "by_epoch": summary(records, kinds, args.epochs),
            "policy_parameters": int(sum(np.size(x) for x in jax.tree.leaves(
                arms[0].state.params)))}
  print(json.dumps(result["by_epoch"], indent=2))
  Path(args.output).parent.mkdir(parents=True, exist_ok=True)
  Path(args.output).write_text(json.dumps(result, indent=2))
  shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
