"""Predictable target/draft pairs for speculative benchmarks, trained and cached.

Each target is SFT'd on the arithmetic task (worked column sums), so its samples at
temperature 1 are structured; its draft model is distilled from the target's
distributions. Both are saved in Hugging Face format under artifacts/spec_pair[_SIZE]/
and reused by later runs.

Sizes: "small" (4 x 384, ~7M parameters: a decode step is dominated by per-op
overhead, as for any tiny model), "medium" (6 x 768, ~38M parameters: a decode step
reads ~150 MB of weights, so like a real policy it is memory-bound and verifying a few
tokens costs little more than decoding one) and "large" (16 x 2048, ~0.8B parameters,
for an accelerator: on an H200 the medium pair's steps are kernel launches, and its
drafter's launches cost as much as the target's; not trained or measured yet).

Learned heads for a pair's target (``load_or_train_heads``: MTP and EAGLE-3 trained
offline on the target's own rollouts, each cached in heads/ and trained when missing)
serve bench_spec --learned.

  python experiments/spec_pair.py [--size small|medium|large] [--force]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import specrl_jax as sj  # noqa: E402
from specrl_jax.models import tokenizer  # noqa: E402
from specrl_jax.rl.loop.sft import SFTConfig, train_sft  # noqa: E402
from specrl_jax.rl.tasks.arithmetic import Arithmetic  # noqa: E402

FOLDER = common.ARTIFACTS / "spec_pair"
TASK = Arithmetic(min_digits=2, max_digits=4)
TARGET = sj.ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=384,
                        intermediate_size=1024, num_layers=4, num_heads=6, num_kv_heads=2,
                        head_dim=64)
DRAFT = sj.ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=96,
                       intermediate_size=256, num_layers=1, num_heads=3, num_kv_heads=1,
                       head_dim=32)
MEDIUM_TARGET = sj.ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=768,
                               intermediate_size=2048, num_layers=6, num_heads=12,
                               num_kv_heads=4, head_dim=64)
LARGE_TARGET = sj.ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=2048,
                              intermediate_size=5632, num_layers=16, num_heads=16,
                              num_kv_heads=8, head_dim=128)
# name: (target config, draft config, target SFT learning rate)
SIZES = {"small": (TARGET, DRAFT, 1e-3), "medium": (MEDIUM_TARGET, DRAFT, 5e-4),
         "large": (LARGE_TARGET, DRAFT, 2e-4)}


def folder(size: str) -> Path:
  return FOLDER if size == "small" else FOLDER.with_name(f"spec_pair_{size}")


def load_or_train(force: bool = False, target_steps: int = 200, draft_steps: int = 150,
                  size: str = "small"):
  """(target, draft) Transformers; trains and caches them when missing."""
  if size not in SIZES:
    raise ValueError(f"size={size!r}: expected one of {sorted(SIZES)}.")
  target_config, draft_config, learning_rate = SIZES[size]
  pair_dir = folder(size)
  target_dir, draft_dir = pair_dir / "target", pair_dir / "draft"
  if not force and (target_dir / "config.json").exists() and (draft_dir / "config.json").exists():
    return sj.load_hf(target_dir), sj.load_hf(draft_dir)
  start = time.perf_counter()
  target, target_losses = train_sft(sj.Transformer(target_config, rngs=nnx.Rngs(0)), TASK,
                                    SFTConfig(steps=target_steps, batch_size=32,
                                              learning_rate=learning_rate), log_every=10)
  draft, draft_losses = train_sft(sj.Transformer(draft_config, rngs=nnx.Rngs(1)), TASK,
                                  SFTConfig(steps=draft_steps, batch_size=32,
                                            learning_rate=3e-3, seed=1),
                                  teacher=target, log_every=50)
  sj.save_hf(target, target_dir, tokenizer=tokenizer.builtin_tokenizer())
  sj.save_hf(draft, draft_dir, tokenizer=tokenizer.builtin_tokenizer())
  (pair_dir / "training.json").write_text(json.dumps({
      "seconds": time.perf_counter() - start, "target_final_loss": target_losses[-1],
      "draft_final_loss": draft_losses[-1], "target_steps": target_steps,
      "draft_steps": draft_steps}, indent=2))
  return target, draft


# EAGLE-3 learns more slowly than MTP on these targets: after 250 updates their expected
# acceptance per depth was 0.87 and 0.99; EAGLE-3 reached 0.98-0.99 by 1000
# (docs/drafters.md).
HEAD_UPDATES = {"mtp": 250, "eagle3": 1000}
HEAD_ROLLOUTS = 512
HEAD_DEPTH = 3  # unroll steps = the longest chain the heads are trained to draft
DRAFT_VOCAB_SIZE = 32


def load_or_train_heads(target: sj.Transformer, size: str = "small", *,
                        force: bool = False, updates: dict[str, int] | None = None,
                        rollouts: int = HEAD_ROLLOUTS) -> dict:
  """{"mtp": MTP, "eagle3": Eagle3} trained offline for the pair's target on its own
  rollouts at temperature 1; each cached next to the pair (heads/NAME) and trained
  only when missing (or with ``force``). updates: per head, default HEAD_UPDATES."""
  from specrl_jax.speculative.drafters import specforge, training
  from specrl_jax.speculative.drafters.eagle3 import Eagle3
  from specrl_jax.speculative.drafters.mtp import MTP
  import jax
  import numpy as np
  updates = {**HEAD_UPDATES, **(updates or {})}
  heads = folder(size) / "heads"
  saved = {"mtp": heads / "mtp" / "drafter.json", "eagle3": heads / "eagle3" / "config.json"}
  load = {"mtp": lambda: training.load_drafter(heads / "mtp", MTP(target)),
          "eagle3": lambda: specforge.load_specforge(heads / "eagle3", target)}
  missing = [name for name in saved if force or not saved[name].exists()]
  if not missing:
    return {name: load[name]() for name in saved}
  start = time.perf_counter()
  rng = np.random.default_rng(11)
  prompts = [tokenizer.encode(TASK.sample(rng).prompt, add_bos=True) for _ in range(rollouts)]
  sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=TASK.max_response_tokens,
                               stop_token_ids=(tokenizer.EOS_ID,))
  data = training.rollout_data(target, prompts, sampling=sampling, rng=jax.random.key(11),
                               engine=sj.EngineConfig(num_slots=64))
  table = training.build_draft_vocab(data.tokens[data.response_mask],
                                     target.config.vocab_size, DRAFT_VOCAB_SIZE)
  fresh = {"mtp": lambda: MTP(target), "eagle3": lambda: Eagle3(target, draft_to_target=table)}
  save = {"mtp": lambda d: training.save_drafter(heads / "mtp", d),
          "eagle3": lambda d: specforge.save_specforge(d, heads / "eagle3")}
  log_path = heads / "training.json"
  records = json.loads(log_path.read_text()) if log_path.exists() else {}
  for name in missing:
    head_start = time.perf_counter()
    config = training.DrafterTrainingConfig(num_updates=updates[name], unroll_steps=HEAD_DEPTH)
    trained, history = training.train_offline(
        fresh[name](), target, data, config, log_every=50,
        log=lambda record, name=name: print(f"  {name} {record}", file=sys.stderr))
    save[name](trained)
    records[name] = {"seconds": time.perf_counter() - head_start, "updates": updates[name],
                     "rollouts": rollouts, "unroll_steps": HEAD_DEPTH, "last": history[-1],
                     "every_50": history}
  log_path.write_text(json.dumps(records, indent=2, default=float))
  print(f"  heads {missing} trained in {time.perf_counter() - start:.0f} s", file=sys.stderr)
  return {name: load[name]() for name in saved}


def load_or_distill_for_task(task, size: str, steps: int = 150, *, force: bool = False
                             ) -> tuple[sj.Transformer, sj.Transformer]:
  """(target, draft): the pair's target, and its draft model distilled further, ``steps``
  more SFT steps, from the target's distributions on ``task``'s worked solutions (cached
  in draft_<task name>/): a drafter that has seen the task's inputs, e.g. the long
  tail's 5-16 digit operands that the pair's own 2-4 digit task never shows."""
  target, draft = load_or_train(size=size)
  name = f"draft_{task.name}_{task.min_digits}_{task.max_digits}"
  path = folder(size) / name
  if not force and (path / "config.json").exists():
    return target, sj.load_hf(path)
  start = time.perf_counter()
  draft, losses = train_sft(draft, task, SFTConfig(steps=steps, batch_size=32,
                                                   learning_rate=3e-3, seed=2),
                            teacher=target, log_every=25)
  sj.save_hf(draft, path, tokenizer=tokenizer.builtin_tokenizer())
  (path / "training.json").write_text(json.dumps({
      "seconds": time.perf_counter() - start, "steps": steps, "first_loss": losses[0],
      "final_loss": losses[-1]}, indent=2))
  return target, draft


def load_or_distill_on_rollouts(task, size: str, *, sampling: sj.SamplingParams,
                                rollouts: int = 512, updates: int = 200, force: bool = False
                                ) -> tuple[sj.Transformer, sj.Transformer]:
  """(target, draft): the pair's target, and its draft model distilled ``updates`` more
  steps on ``rollouts`` of the target's own responses to ``task``'s prompts at
  ``sampling`` (what an RL rollout of this policy asks the drafter to predict; cached
  in draft_rollouts_<task>/). Starts from ``load_or_distill_for_task``'s drafter."""
  import jax
  import numpy as np
  from specrl_jax.speculative.drafters import training
  target, draft = load_or_distill_for_task(task, size)
  name = f"draft_rollouts_{task.name}_{task.min_digits}_{task.max_digits}"
  path = folder(size) / name
  if not force and (path / "config.json").exists():
    return target, sj.load_hf(path)
  start = time.perf_counter()
  rng = np.random.default_rng(12)
  # Prompts the benchmark's steps do not use (they sample from the task with seeds 0..).
  prompts = [task.sample(rng).prompt_ids(task.tokenizer) for _ in range(rollouts)]
  data = training.rollout_data(target, prompts, sampling=sampling, rng=jax.random.key(12),
                               engine=sj.EngineConfig(num_slots=64))
  generated = time.perf_counter() - start
  draft, history = training.distill_draft_model(
      draft, target, data, sampling=sampling,
      config=training.DrafterTrainingConfig(num_updates=updates, batch_size=32,
                                            learning_rate=1e-3, warmup_updates=20, seed=12),
      log_every=50, log=lambda record: print(f"  distill {record}", file=sys.stderr))
  sj.save_hf(draft, path, tokenizer=tokenizer.builtin_tokenizer())
  (path / "training.json").write_text(json.dumps({
      "seconds": time.perf_counter() - start, "rollout_seconds": generated,
      "rollouts": rollouts, "response_tokens": int(data.response_mask.sum()),
      "updates": updates, "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"]},
      indent=2))
  return target, draft


def experiment_overrides(size: str, own_task: bool = True) -> list[str]:
  """The size's target and draft model shapes, and (own_task) the pair's task, as
  ``specrl train`` overrides of the experiment's policy, drafter and task."""
  target, draft, _ = SIZES[size]
  shape = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
           "head_dim")
  return ([f"--policy.{f}={getattr(target, f)}" for f in shape]
          + [f"--drafter.model.{f}={getattr(draft, f)}" for f in shape]
          + ([f"--task.min_digits={TASK.min_digits}", f"--task.max_digits={TASK.max_digits}"]
             if own_task else []))


def use_as_warm_start(session, target: sj.Transformer, draft: sj.Transformer) -> None:
  """Writes ``target`` and ``draft`` where ``session`` (an ``rl.app`` Session whose
  shapes are ``experiment_overrides``') loads its warm start from, under the key of its
  configuration, so that they are used rather than rebuilt."""
  import shutil
  from specrl_jax import checkpoint
  from specrl_jax.rl.app import run_directory
  warm = Path(session.config.output.directory) / "warm_start"
  if warm.exists():
    shutil.rmtree(warm)
  checkpoint.save_model(str(warm / "policy"), target)
  checkpoint.save_model(str(warm / "draft"), draft)
  run_directory.write_json(str(warm / run_directory.WARM_START_KEY),
                           run_directory.warm_start_key(session.record))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--force", action="store_true", help="retrain even when cached")
  parser.add_argument("--size", choices=sorted(SIZES), default="small")
  args = parser.parse_args(argv)
  load_or_train(force=args.force, size=args.size)
  print((folder(args.size) / "training.json").read_text())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
