"""Learned drafters for a small arithmetic policy: offline MTP / EAGLE-3 training from
the policy's own rollouts, and online drafter training during GRPO.

Stages (results cached under artifacts/train_drafter/; --force redoes them):
  1. target: a 4-layer policy SFT'd on worked column sums (rl.tasks.Arithmetic);
  2. rollouts: the target's own samples at temperature 1 (sj.generate);
  3. offline training of an MTP head and an EAGLE-3 head (training-time test, draft
     vocabulary from the rollouts' token frequencies);
  4. evaluation at temperature 1, k = 3: acceptance length, and tokens/s against plain
     decoding timed in the same run (interleaved, best of N);
  5. online RL: acceptance length over GRPO steps for a frozen vs an online-trained
     EAGLE-3 head, both starting from a weak (briefly trained) head -> a PNG plot.
Prints one JSON document.

  python experiments/train_drafter.py [--force] [--updates 300] [--rl-steps 16] [--no-rl]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import specrl_jax as sj  # noqa: E402
from specrl_jax import parallel, rl  # noqa: E402
from specrl_jax.models import tokenizer  # noqa: E402
from specrl_jax.rl.loop import online_drafters, rollout as rl_rollout, sync  # noqa: E402
from specrl_jax.rl import tasks  # noqa: E402
from specrl_jax.rl.loop.sft import SFTConfig, train_sft  # noqa: E402
from specrl_jax.speculative.drafters import specforge, training  # noqa: E402
from specrl_jax.speculative.drafters.eagle3 import Eagle3  # noqa: E402
from specrl_jax.speculative.drafters.mtp import MTP  # noqa: E402

FOLDER = common.ARTIFACTS / "train_drafter"
TASK = tasks.Arithmetic(min_digits=2, max_digits=3)
TARGET = sj.ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=128,
                        intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=2,
                        head_dim=32)
SAMPLING = sj.SamplingParams(temperature=1.0, max_new_tokens=TASK.max_response_tokens,
                             stop_token_ids=(tokenizer.EOS_ID,))
DRAFT_VOCAB_SIZE = 32  # of the target's 60 ids; the task's text uses fewer
K = 3


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def prompts_of(problems) -> list[list[int]]:
  return [tokenizer.encode(p.prompt, add_bos=True) for p in problems]


def load_or_train_target(force: bool, steps: int) -> tuple[sj.Transformer, dict]:
  folder = FOLDER / "target"
  if not force and (folder / "config.json").exists():
    return sj.load_hf(folder), json.loads((FOLDER / "target.json").read_text())
  start = time.perf_counter()
  with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON result
    model, losses = train_sft(sj.Transformer(TARGET, rngs=nnx.Rngs(0)), TASK,
                              SFTConfig(steps=steps, batch_size=32, learning_rate=3e-3),
                              log_every=50)
  sj.save_hf(model, folder, tokenizer=tokenizer.builtin_tokenizer())
  record = {"sft_steps": steps, "sft_final_loss": round(losses[-1], 4),
            "seconds": round(time.perf_counter() - start, 1)}
  (FOLDER / "target.json").write_text(json.dumps(record))
  return model, record


def accuracy(target: sj.Transformer, prompt_set) -> float:
  out = sj.generate(target, prompt_set.prompts, sampling=SAMPLING, rng=jax.random.key(7))
  rewards = TASK.reward(prompt_set.targets, out.tokens, out.lengths)
  return float(np.mean(rewards))


def load_or_train_drafters(target, data, force: bool, updates: int
                           ) -> tuple[dict[str, training.HiddenStateDrafter], dict]:
  """MTP and EAGLE-3 heads trained offline. The unroll is K steps: drafting K tokens
  uses exactly the first K (the paper's 7 serves k up to 7 and costs 7/K as much)."""
  mtp_dir, eagle_dir = FOLDER / "mtp", FOLDER / "eagle3"
  table = training.build_draft_vocab(data.tokens[data.response_mask], TARGET.vocab_size,
                                     DRAFT_VOCAB_SIZE)
  fresh = {"mtp": MTP(target), "eagle3": Eagle3(target, draft_to_target=table)}
  if not force and (eagle_dir / "config.json").exists() and (mtp_dir / "drafter.json").exists():
    drafters = {"mtp": training.load_drafter(mtp_dir, fresh["mtp"]),
                "eagle3": specforge.load_specforge(eagle_dir, target)}
    return drafters, json.loads((FOLDER / "drafters.json").read_text())
  configs = {name: training.DrafterTrainingConfig(num_updates=updates, unroll_steps=K)
             for name in fresh}
  drafters, records = {}, {}
  for name, drafter in fresh.items():
    start = time.perf_counter()
    trained, history = training.train_offline(
        drafter, target, data, configs[name], log_every=50,
        log=lambda record, name=name: log(f"  {name} {record}"))
    records[name] = {"updates": updates, "unroll_steps": configs[name].unroll_steps,
                     "seconds": round(time.perf_counter() - start, 1),
                     "first": history[0], "last": history[-1]}
    drafters[name] = trained
  training.save_drafter(mtp_dir, drafters["mtp"])
  specforge.save_specforge(drafters["eagle3"], eagle_dir)
  (FOLDER / "drafters.json").write_text(json.dumps(records))
  return drafters, records


def evaluate_speed(target, drafters, prompt_set, batches, repeats) -> list[dict]:
  """Acceptance and tokens/s of each drafter against plain decoding, per batch size."""
  spec = sj.SpecConfig(num_draft_tokens=K)
  rows = []
  for batch in batches:
    prompts = prompt_set.prompts[:batch]
    engine = sj.EngineConfig(num_slots=batch)
    configs = {"plain": {}, **{name: {"drafter": d, "spec": spec} for name, d in drafters.items()}}
    outputs = {}

    def runner(name, kwargs, seed):
      def run():
        outputs[name] = sj.generate(target, prompts, sampling=SAMPLING,
                                    rng=jax.random.key(seed), engine=engine, **kwargs)
      return run

    for name, kwargs in configs.items():  # compile
      runner(name, kwargs, 0)()
    seconds = common.interleaved(
        {name: runner(name, kwargs, 1) for name, kwargs in configs.items()}, repeats)
    plain_rate = outputs["plain"].stats["generated_tokens"] / seconds["plain"]
    for name in configs:
      out = outputs[name]
      rate = out.stats["generated_tokens"] / seconds[name]
      rows.append({"batch": batch, "drafter": name, "k": 0 if name == "plain" else K,
                   "acceptance_length": round(out.stats["acceptance_length"], 3),
                   "per_position_acceptance": [round(a, 3) for a in
                                               out.stats["per_position_acceptance"]],
                   "tokens_per_second": round(rate, 1),
                   "speedup_vs_plain": round(rate / plain_rate, 3)})
      log(f"  {rows[-1]}")
  return rows


def online_vs_frozen(target, weak: Eagle3, steps: int) -> dict:
  """Acceptance over GRPO steps: the same weak EAGLE-3 head frozen, or trained online
  on each step's rollouts (the policy trains identically in both runs)."""
  learner = rl.LearnerConfig(learning_rate=1e-4, schedule="constant", warmup_steps=2,
                             drafter_learning_rate=3e-3,
                             loss=rl.GRPOConfig(tis_cap=2.0))
  rollout = rl_rollout.RolloutConfig(group_size=8, prompts_per_step=6, sampling=SAMPLING)
  prompt_set = tasks.make_prompt_set(TASK, 512, seed=11)
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  graphdef, params = nnx.split(target)
  curves = {}
  for mode in ("frozen", "online"):
    online = None
    if mode == "online":
      # What online_drafters.online_drafter builds, with the unroll matched to k.
      static = weak.params()
      online = online_drafters.OnlineDrafter(
          drafter=weak, trainable=weak.weights,
          objective=online_drafters.online_objective(weak, loss_weight=1.0, unroll_steps=K),
          rollout_params=lambda trainable: dict(static, weights=trainable))
    state = rl.init_train_state(params, learner, mesh, rng=jax.random.key(0),
                                drafter_params=online.trainable if online else None)
    program = sync.build_program(graphdef, TARGET, TASK, learner, rollout, mesh, state,
                                 prompt_width=prompt_set.tokens_PxT.shape[1],
                                 drafter=None if online else weak, online=online,
                                 spec=sj.SpecConfig(num_draft_tokens=K))
    history = []
    start = time.perf_counter()
    for step in range(steps):
      indices = tasks.step_indices(len(prompt_set), step, rollout.prompts_per_step, seed=0)
      prompts = sync.prompts_on_mesh(prompt_set.take(indices), mesh)
      state, metrics = program.rl_step(state, prompts,
                                       jax.random.fold_in(jax.random.key(1), step))
      metrics = sync.to_host(metrics)
      history.append({"step": step, "acceptance_length": round(metrics["acceptance_length"], 3),
                      "reward_mean": round(metrics["reward_mean"], 3),
                      "drafter_loss": round(metrics.get("drafter/loss", float("nan")), 4)})
      log(f"  {mode} {history[-1]}")
    curves[mode] = {"seconds": round(time.perf_counter() - start, 1), "steps": history}
  return curves


def plot(curves: dict, path: Path) -> None:
  plt = common.pyplot()
  figure, axis = plt.subplots(figsize=(6, 3.5))
  for mode, curve in curves.items():
    steps = [r["step"] for r in curve["steps"]]
    axis.plot(steps, [r["acceptance_length"] for r in curve["steps"]], marker="o",
              label=f"EAGLE-3, {mode}")
  axis.set_xlabel("GRPO step")
  axis.set_ylabel(f"acceptance length (k = {K})")
  axis.set_title("Drafter frozen vs trained online during RL")
  axis.grid(alpha=0.3)
  axis.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--force", action="store_true", help="retrain even when cached")
  parser.add_argument("--sft-steps", type=int, default=400)
  parser.add_argument("--rollout-prompts", type=int, default=512)
  parser.add_argument("--updates", type=int, default=250, help="offline drafter updates")
  parser.add_argument("--weak-updates", type=int, default=15,
                      help="updates of the weak head the RL comparison starts from")
  parser.add_argument("--rl-steps", type=int, default=16)
  parser.add_argument("--no-rl", action="store_true")
  parser.add_argument("--batches", type=int, nargs="+", default=[8, 256])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  FOLDER.mkdir(parents=True, exist_ok=True)
  timings = {}

  start = time.perf_counter()
  target, target_record = load_or_train_target(args.force, args.sft_steps)
  evaluation_set = tasks.make_prompt_set(TASK, 256, seed=99)  # drawn apart from the rollouts
  target_record["accuracy_at_temperature_1"] = round(accuracy(target, evaluation_set), 3)
  timings["target"] = round(time.perf_counter() - start, 1)
  log(f"target: {target_record}")

  start = time.perf_counter()
  rng = np.random.default_rng(1)
  held_out_prompts = 128
  prompts = prompts_of([TASK.sample(rng)
                        for _ in range(args.rollout_prompts + held_out_prompts)])
  rollouts = training.rollout_data(target, prompts, sampling=SAMPLING, rng=jax.random.key(1),
                                   engine=sj.EngineConfig(num_slots=128))
  split = lambda rows: training.RolloutData(tokens=rollouts.tokens[rows],
                                            response_mask=rollouts.response_mask[rows])
  data = split(slice(0, args.rollout_prompts))
  held_out = split(slice(args.rollout_prompts, None))
  timings["rollouts"] = round(time.perf_counter() - start, 1)

  start = time.perf_counter()
  drafters, drafter_records = load_or_train_drafters(target, data, args.force, args.updates)
  timings["drafters"] = round(time.perf_counter() - start, 1)

  start = time.perf_counter()
  held_out_metrics = {name: training.evaluate(d, target, held_out, unroll_steps=K)
                      for name, d in drafters.items()}
  speed = evaluate_speed(target, drafters, evaluation_set, args.batches, args.repeats)
  timings["evaluation"] = round(time.perf_counter() - start, 1)
  largest = max(args.batches)
  at_largest = {row["drafter"]: row for row in speed if row["batch"] == largest}

  result = {
      "experiment": "train_drafter", "task": "arithmetic 2-3 digits, worked sums",
      "target": {"config": "4 layers x 128, SFT", **target_record},
      "temperature": SAMPLING.temperature, "k": K,
      "offline_training": drafter_records,
      "held_out_training_metrics": held_out_metrics,
      "speed": speed,
      "goals": {
          "measured_on": f"{largest} held-out prompts, temperature 1, k = {K}",
          "eagle3_acceptance_length": at_largest["eagle3"]["acceptance_length"],
          "eagle3_at_least_3.0": at_largest["eagle3"]["acceptance_length"] >= 3.0,
          "mtp_acceptance_length": at_largest["mtp"]["acceptance_length"],
          "mtp_at_least_2.5": at_largest["mtp"]["acceptance_length"] >= 2.5},
  }
  if not args.no_rl:
    start = time.perf_counter()
    weak, _ = training.train_offline(
        Eagle3(target, draft_to_target=drafters["eagle3"].draft_to_target), target, data,
        training.DrafterTrainingConfig(num_updates=args.weak_updates, unroll_steps=K))
    curves = online_vs_frozen(target, weak, args.rl_steps)
    plot(curves, FOLDER / "online_vs_frozen.png")
    (FOLDER / "online_vs_frozen.json").write_text(json.dumps(curves))
    result["online_rl"] = {
        mode: {"first": c["steps"][0]["acceptance_length"],
               "last": c["steps"][-1]["acceptance_length"],
               "curve": [r["acceptance_length"] for r in c["steps"]],
               "reward_curve": [r["reward_mean"] for r in c["steps"]]}
        for mode, c in curves.items()}
    result["online_rl"]["plot"] = str(FOLDER / "online_vs_frozen.png")
    timings["online_rl"] = round(time.perf_counter() - start, 1)
  result["seconds"] = timings
  (FOLDER / "result.json").write_text(json.dumps(result, indent=2))
  common.print_json(result)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
