"""Acceptance length and speedup vs k for the n-gram, draft-model, MTP and EAGLE-3
drafters on one target: the shape of the paper's drafter table, at CPU scale.

Target and learned heads are experiments/train_drafter.py's: a 4 x 128 policy SFT'd on
2-3 digit worked sums, MTP and EAGLE-3 heads trained offline on its rollouts with a
3-step training-time-test unroll (loaded from artifacts/train_drafter/, or trained here
exactly as that script does). The draft model is a 1 x 96 transformer distilled from
the target (cached in artifacts/k_sweep/). Temperature 1, EOS stops. For each batch
size and k, chains of k drafts are timed against plain decoding on the same prompts in
the same process (every configuration compiled first, then interleaved, best of N).
Heads trained with a 3-step unroll draft positions past 3 without having been trained
for them: their acceptance at k > 3 says so.

  python experiments/k_sweep.py [--ks 1 2 3 5 7] [--batches 8 64] [--repeats 3]
                                [--out results]

Writes k_sweep.json and k_sweep.png to --out and prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import train_drafter  # noqa: E402

import specrl_jax as sj  # noqa: E402
from specrl_jax.models import tokenizer  # noqa: E402
from specrl_jax.rl import tasks  # noqa: E402
from specrl_jax.rl.loop.sft import SFTConfig, train_sft  # noqa: E402
from specrl_jax.speculative.drafters import specforge, training  # noqa: E402
from specrl_jax.speculative.drafters.mtp import MTP  # noqa: E402

FOLDER = common.ARTIFACTS / "k_sweep"
RESULTS = Path(__file__).resolve().parent.parent / "results"
DRAFT = sj.ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=96, intermediate_size=256,
                       num_layers=1, num_heads=3, num_kv_heads=1, head_dim=32)
DRAFTERS = ("ngram", "draft_model", "mtp", "eagle3")
LABELS = {"ngram": "n-gram", "draft_model": "draft model", "mtp": "MTP", "eagle3": "EAGLE-3"}


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def learned_heads(target: sj.Transformer) -> dict:
  """train_drafter.py's MTP and EAGLE-3 heads: loaded, or trained with its settings."""
  folder = train_drafter.FOLDER
  if (folder / "eagle3" / "config.json").exists() and (folder / "mtp" / "drafter.json").exists():
    return {"mtp": training.load_drafter(folder / "mtp", MTP(target)),
            "eagle3": specforge.load_specforge(folder / "eagle3", target)}
  log("k_sweep: no cached heads in artifacts/train_drafter; training them as "
      "train_drafter.py does")
  # The same problems, seeds and split as train_drafter.main.
  rng = np.random.default_rng(1)
  problems = [train_drafter.TASK.sample(rng) for _ in range(512 + 128)]
  rollouts = training.rollout_data(target, train_drafter.prompts_of(problems),
                                   sampling=train_drafter.SAMPLING, rng=jax.random.key(1),
                                   engine=sj.EngineConfig(num_slots=128))
  data = training.RolloutData(tokens=rollouts.tokens[:512],
                              response_mask=rollouts.response_mask[:512])
  heads, _ = train_drafter.load_or_train_drafters(target, data, force=False, updates=250)
  return heads


def draft_model(target: sj.Transformer, steps: int) -> sj.Transformer:
  """A one-layer draft model distilled from the target (cached per step count)."""
  folder = FOLDER / f"draft-distill{steps}"
  if (folder / "config.json").exists():
    return sj.load_hf(folder)
  started = time.perf_counter()
  draft, losses = train_sft(sj.Transformer(DRAFT, rngs=nnx.Rngs(1)), train_drafter.TASK,
                            SFTConfig(steps=steps, batch_size=32, learning_rate=3e-3, seed=1),
                            teacher=target)
  log(f"k_sweep: distilled the draft model in {time.perf_counter() - started:.0f}s, soft CE "
      f"{losses[0]:.3f} -> {losses[-1]:.3f}")
  sj.save_hf(draft, folder, tokenizer=tokenizer.builtin_tokenizer())
  return draft


def sweep(target, drafters: dict, prompts: list[list[int]], ks, repeats: int) -> list[dict]:
  """One batch: plain and every (drafter, k), compiled, then interleaved best-of."""
  engine = sj.EngineConfig(num_slots=len(prompts))
  configs = {("plain", 0): {}}
  for name, drafter in drafters.items():
    for k in ks:
      configs[(name, k)] = dict(drafter=drafter, spec=sj.SpecConfig(num_draft_tokens=k))
  outputs = {}

  def runner(key, kwargs):
    def run():
      outputs[key] = sj.generate(target, prompts, sampling=train_drafter.SAMPLING,
                                 rng=jax.random.key(7), engine=engine, **kwargs)
    return run

  runs = {key: runner(key, kwargs) for key, kwargs in configs.items()}
  for key, run in runs.items():
    started = time.perf_counter()
    run()
    log(f"  batch {len(prompts)} {key}: compiled and ran in {time.perf_counter() - started:.1f}s")
  seconds = common.interleaved(runs, repeats)
  plain_rate = outputs[("plain", 0)].stats["generated_tokens"] / seconds[("plain", 0)]
  rows = []
  for (name, k), out in outputs.items():
    rate = out.stats["generated_tokens"] / seconds[(name, k)]
    rows.append({"batch": len(prompts), "drafter": name, "k": k,
                 "acceptance_length": round(out.stats["acceptance_length"], 3),
                 "per_position_acceptance": [round(a, 3)
                                             for a in out.stats["per_position_acceptance"]],
                 "tokens_per_second": round(rate, 1),
                 "speedup_vs_plain": round(rate / plain_rate, 3),
                 "target_calls": out.stats["target_calls"],
                 "generated_tokens": out.stats["generated_tokens"]})
  return rows


def plot(rows: list[dict], path: Path) -> None:
  batches = sorted({r["batch"] for r in rows})
  styles = ["o-", "s--", "^:", "d-."]
  series = []
  for color, name in zip(("tab:gray", "tab:blue", "tab:orange", "tab:green"), DRAFTERS):
    for style, batch in zip(styles, batches):
      mine = sorted((r for r in rows if r["drafter"] == name and r["batch"] == batch),
                    key=lambda r: r["k"])
      if mine:
        series.append((f"{LABELS[name]}, batch {batch}", style, color, [r["k"] for r in mine],
                       [r["acceptance_length"] for r in mine],
                       [r["speedup_vs_plain"] for r in mine]))
  figure, axes = common.plot_against_k(series, {r["k"] for r in rows if r["k"]})
  axes[1].legend(fontsize=7, ncol=2)
  figure.suptitle("Drafters vs k: 4 x 128 arithmetic policy, temperature 1")
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  common.pyplot().close(figure)


def table(rows: list[dict], batch: int) -> dict[str, dict[str, str]]:
  """{drafter: {k: "acceptance / speedup"}} at one batch size, as in PAPER.md."""
  return {LABELS[name]: {str(r["k"]): f"{r['acceptance_length']:.2f} / {r['speedup_vs_plain']:.2f}x"
                         for r in rows if r["drafter"] == name and r["batch"] == batch}
          for name in DRAFTERS}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 5, 7])
  parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--distill-steps", type=int, default=200)
  parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=DRAFTERS)
  parser.add_argument("--out", type=Path, default=RESULTS)
  args = parser.parse_args(argv)
  started = time.perf_counter()

  target, _ = train_drafter.load_or_train_target(force=False, steps=400)
  drafters = {}
  if "ngram" in args.drafters:
    drafters["ngram"] = sj.drafters.NGram(n=3)
  if "draft_model" in args.drafters:
    drafters["draft_model"] = sj.drafters.DraftModel(draft_model(target, args.distill_steps))
  if {"mtp", "eagle3"} & set(args.drafters):
    heads = learned_heads(target)
    drafters.update({name: heads[name] for name in ("mtp", "eagle3") if name in args.drafters})

  evaluation = tasks.make_prompt_set(train_drafter.TASK, max(args.batches), seed=99)
  rows = []
  for batch in args.batches:
    rows += sweep(target, drafters, evaluation.prompts[:batch], args.ks, args.repeats)
  payload = {
      "experiment": "k_sweep", "task": "arithmetic 2-3 digits, worked sums",
      "target": "train_drafter target (4 layers x 128, SFT)",
      "draft_model": f"1 layer x 96, distilled {args.distill_steps} steps",
      "heads_trained_unroll": train_drafter.K, "temperature": train_drafter.SAMPLING.temperature,
      "ks": args.ks, "batches": args.batches, "repeats": args.repeats,
      "devices": str(jax.devices()), "results": rows,
      "table_at_largest_batch": table(rows, max(args.batches)),
      "wall_seconds": round(time.perf_counter() - started, 1),
  }
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "k_sweep.json").write_text(json.dumps(payload, indent=2))
  plot(rows, args.out / "k_sweep.png")
  common.print_json(payload)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
