"""Rollout-history drafting over RL epochs: acceptance length and rollout speed of plain
decoding, the n-gram drafter, the history drafter, EAGLE-3, and history + EAGLE-3.

The embedded arithmetic task (worked column sums, character tokenizer). The policy is
either the 38M-parameter SFT target of experiments/spec_pair.py with its offline-trained
EAGLE-3 head (``--policy medium``, the default: large enough that, as for a real policy,
verifying a few tokens costs little more than decoding one) or a 1.2M-parameter policy
warm-started by SFT here with an EAGLE-3 head trained on its rollouts of other problems
(``--policy tiny``: a decode step there is per-op overhead, and speculation does not
pay); the head stays frozen, as in the paper. Each epoch every method rolls out the same
prompts (``--group`` samples each, temperature 1); the history drafters then remember
their epoch's rollouts, and the policy takes a GRPO step on the plain rollouts (on-policy
group-relative policy gradient on the task's reward), so later epochs draft from an
older policy's rollouts, as in RL. History alone decodes plainly until at least
``--min-known`` of the prompts have earlier rollouts (its always-drafting numbers for
those epochs are reported too). Methods run interleaved, best of ``--repeats``; speed
is reported in wall-clock time and in this process's CPU time, which is steadier when
other jobs share the machine.

  python experiments/bench_history.py [--policy medium|tiny] [--epochs 5] [--prompts 8]
      [--group 4] [--slots 8] [--k 3]

Prints JSON and writes results/bench_history.json and results/bench_history.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from specrl_jax import checkpoint  # noqa: E402
from specrl_jax.config import SamplingParams, SpecConfig  # noqa: E402
from specrl_jax.models import tokenizer  # noqa: E402
from specrl_jax.models.transformer import Transformer  # noqa: E402
from specrl_jax.rl.algo.advantages import group_advantages  # noqa: E402
from specrl_jax.rl.app.model_section import ModelSection  # noqa: E402
from specrl_jax.rl.loop.sft import SFTConfig, train_sft  # noqa: E402
from specrl_jax.rl.tasks import Arithmetic, make_prompt_set  # noqa: E402
from specrl_jax.sampling.engine import EngineConfig  # noqa: E402
from specrl_jax.speculative.generate import prepare, rollout  # noqa: E402
from specrl_jax.speculative.drafters import training  # noqa: E402
from specrl_jax.speculative.drafters.ngram import NGram  # noqa: E402
from specrl_jax.speculative.drafters.eagle3 import Eagle3  # noqa: E402
from specrl_jax.speculative.drafters.history import History  # noqa: E402
from specrl_jax.speculative.drafters.history_store import HistoryConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "results"

_rollout = jax.jit(rollout, static_argnames=("graphdef", "sampling", "layout", "drafter",
                                              "topology", "draft_mode"))


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """One method's rollouts of one epoch, with what the engine and drafter counted."""
  tokens: np.ndarray
  lengths: np.ndarray
  seconds: float        # wall clock
  cpu_seconds: float    # this process's CPU time: steadier on a shared machine
  acceptance_length: float
  history: dict


def roll_out(policy: Transformer, prompts, drafter, sampling, spec, engine, rng) -> Rollouts:
  """``generate`` with the final drafter state kept (for the per-source statistics)."""
  inputs, layout, bound, topology, mode = prepare(policy.config, prompts, sampling, engine,
                                                  drafter, spec if drafter else None)
  graphdef, params = nnx.split(policy)
  start, start_cpu = time.perf_counter(), time.process_time()
  final = _rollout(graphdef, params, bound.params() if bound else (), *inputs, rng,
                   sampling=sampling, layout=layout, drafter=bound, topology=topology,
                   draft_mode=mode)
  final = jax.device_get(final)
  seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
  counters = final.counters
  acceptance = 1.0
  if bound is not None and int(counters["draft_rounds"]):
    acceptance = 1.0 + float(np.sum(counters["accepted_per_position"])) / int(
        counters["draft_rounds"])
  stats = bound.stats(final.drafter) if isinstance(bound, History) else {}
  return Rollouts(tokens=np.asarray(final.out_tokens_RxL), lengths=np.asarray(final.out_lengths_R),
                  seconds=seconds, cpu_seconds=cpu_seconds, acceptance_length=acceptance,
                  history=stats)


# ----------------------------------------------------------------- the policy

def grpo_step(policy: Transformer, optimizer, opt_state, prompts, out: Rollouts, rewards_R,
              group: int):
  """One on-policy GRPO update (group-relative advantages, token-mean policy gradient)."""
  width = -(-max(len(p) + len(r) for p, r in zip(prompts, out.tokens)) // 8) * 8
  tokens = np.zeros((len(prompts), width), np.int32)
  mask = np.zeros((len(prompts), width), np.float32)
  for row, (prompt, response, length) in enumerate(zip(prompts, out.tokens, out.lengths)):
    tokens[row, :len(prompt)] = prompt
    tokens[row, len(prompt):len(prompt) + length] = response[:length]
    mask[row, len(prompt):len(prompt) + length] = 1.0
  advantages_R = group_advantages(jnp.asarray(rewards_R), group)
  graphdef, params = nnx.split(policy)
  params, opt_state = _grpo_update(graphdef, optimizer, params, opt_state, tokens, mask,
                                   advantages_R)
  # Finish the update here, not inside the next timed rollout (dispatch is asynchronous).
  params, opt_state = jax.block_until_ready((params, opt_state))
  return nnx.merge(graphdef, params), opt_state


def _grpo_update(graphdef, optimizer, params, opt_state, tokens_BxT, mask_BxT, advantages_B):
  def loss_fn(params):
    log_probs = jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens_BxT)[:, :-1])
    picked_BxT = jnp.take_along_axis(log_probs, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
    weights_BxT = mask_BxT[:, 1:] * advantages_B[:, None]
    return -jnp.sum(picked_BxT * weights_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)

  grads = jax.grad(loss_fn)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


_grpo_update = jax.jit(_grpo_update, static_argnames=("graphdef", "optimizer"))


def train_eagle3(policy: Transformer, task, sampling: SamplingParams, updates: int,
                 seed: int) -> Eagle3:
  """An EAGLE-3 head trained offline on the policy's own rollouts of other problems."""
  problems = make_prompt_set(task, 512, seed=seed + 1000, max_prompt_tokens=32)
  data = training.rollout_data(policy, problems.prompts, sampling=sampling,
                               rng=jax.random.key(seed), engine=EngineConfig(num_slots=256))
  layers = policy.config.num_layers
  head = Eagle3(policy, target_layers=(0, layers // 2, layers - 1), seed=seed)
  head, history = training.train_offline(
      head, policy, data, training.DrafterTrainingConfig(
          num_updates=updates, batch_size=32, learning_rate=3e-3, unroll_steps=4, seed=seed))
  print(f"  eagle3: {updates} updates, loss {history[0]['loss']:.3f} -> "
        f"{history[-1]['loss']:.3f}", file=sys.stderr, flush=True)
  return head


def warm_start(task, sampling: SamplingParams, args) -> tuple[Transformer, Eagle3]:
  """The SFT policy and its EAGLE-3 head, cached under artifacts/ (they only depend on
  the seed and the step counts)."""
  folder = common.ARTIFACTS / "bench_history" / (
      f"seed{args.seed}-sft{args.sft_steps}-eagle{args.eagle_updates}")
  policy = Transformer(ModelSection(seed=args.seed).model_config(), rngs=nnx.Rngs(args.seed))
  layers = policy.config.num_layers
  if (folder / "eagle3").exists():
    checkpoint.restore_model(folder / "policy", policy)
    head = Eagle3(policy, target_layers=(0, layers // 2, layers - 1), seed=args.seed)
    print(f"  loaded the policy and EAGLE-3 from {folder}", file=sys.stderr, flush=True)
    return policy, training.load_drafter(folder / "eagle3", head)
  policy, losses = train_sft(policy, task, SFTConfig(steps=args.sft_steps, seed=args.seed))
  print(f"  sft: {args.sft_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}",
        file=sys.stderr, flush=True)
  eagle = train_eagle3(policy, task, sampling, args.eagle_updates, args.seed)
  if folder.exists():
    shutil.rmtree(folder)
  checkpoint.save_model(folder / "policy", policy)
  training.save_drafter(folder / "eagle3", eagle)
  return policy, eagle


# ----------------------------------------------------------------- the benchmark

def plot(records, path: Path) -> None:
  plt = common.pyplot()
  epochs = [r["epoch"] for r in records]
  names = list(records[0]["methods"])
  figure, axes = plt.subplots(1, 3, figsize=(15, 4.6))
  panels = (("acceptance_length", "tokens per target call", "acceptance length"),
            ("speedup_vs_plain", "rollout tokens/s vs plain", "speedup (wall clock)"),
            ("cpu_speedup_vs_plain", "rollout tokens per CPU-second vs plain",
             "speedup (CPU time)"))
  for axis, (key, label, title) in zip(axes, panels):
    for name in names:
      axis.plot(epochs, [r["methods"][name][key] for r in records], "o-", label=name)
    always = [(r["epoch"], r["history_always_drafting"][key]) for r in records
              if "history_always_drafting" in r]
    if always:
      axis.plot(*zip(*always), "o", mfc="none", color="tab:green",
                label="history, drafting with no earlier rollouts")
    if key != "acceptance_length":
      axis.axhline(1.0, color="gray", lw=0.8, ls="--")
    axis.set(xlabel="epoch", ylabel=label, title=title)
    axis.set_xticks(epochs)
    axis.grid(alpha=0.3)
  handles, labels = axes[0].get_legend_handles_labels()
  figure.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
  figure.tight_layout(rect=(0, 0.08, 1, 1))
  figure.savefig(path, dpi=120)


def entry_of(out: Rollouts, plain: Rollouts, drafting: bool) -> dict:
  generated = int(out.lengths.sum())
  entry = {"drafting": drafting, "acceptance_length": round(out.acceptance_length, 3),
           "tokens_per_second": round(generated / out.seconds, 1),
           "seconds": round(out.seconds, 3), "cpu_seconds": round(out.cpu_seconds, 3),
           "speedup_vs_plain": round(plain.seconds / out.seconds, 3),
           "cpu_speedup_vs_plain": round(plain.cpu_seconds / out.cpu_seconds, 3)}
  if out.history:
    entry["history"] = {k: (round(v, 3) if isinstance(v, float) else v)
                        for k, v in out.history.items()}
  return entry


def medium_policy() -> tuple[Transformer, Eagle3, Arithmetic]:
  """spec_pair's 38M target, its cached EAGLE-3 head and the task it was SFT'd on."""
  import spec_pair
  policy, _ = spec_pair.load_or_train(size="medium")
  return policy, spec_pair.load_or_train_heads(policy, "medium")["eagle3"], spec_pair.TASK


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policy", choices=("medium", "tiny"), default="medium")
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--group", type=int, default=4)
  parser.add_argument("--slots", type=int, default=8)
  parser.add_argument("--k", type=int, default=3, help="draft tokens per round (a chain)")
  parser.add_argument("--sft-steps", type=int, default=300)
  parser.add_argument("--eagle-updates", type=int, default=300)
  parser.add_argument("--grpo-learning-rate", type=float, default=None,
                      help="Adam step size of the epochs' GRPO updates (default: 1e-5 for "
                           "the medium policy, which SFT left nearly converged; 3e-4 tiny)")
  parser.add_argument("--max-match", type=int, default=16)
  parser.add_argument("--min-match", type=int, default=8,
                      help="history + EAGLE-3: shorter history matches defer to EAGLE-3")
  parser.add_argument("--min-known", type=float, default=0.5,
                      help="history alone drafts only when this fraction of the prompts "
                           "has earlier rollouts (else it decodes plainly)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=Path, default=RESULTS)
  args = parser.parse_args(argv)

  started = time.perf_counter()
  if args.policy == "medium":
    policy, eagle, task = medium_policy()
  else:
    task = Arithmetic(min_digits=2, max_digits=3)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=task.max_response_tokens,
                            stop_token_ids=(tokenizer.EOS_ID,))
  spec = SpecConfig(num_draft_tokens=args.k)
  engine = EngineConfig(num_slots=args.slots)
  if args.policy == "tiny":
    policy, eagle = warm_start(task, sampling, args)

  prompt_set = make_prompt_set(task, args.prompts, seed=args.seed, max_prompt_tokens=32)
  prompts = [p for p in prompt_set.prompts for _ in range(args.group)]
  targets = {k: np.repeat(v, args.group, axis=0) for k, v in prompt_set.targets.items()}
  # Two epochs of each prompt's group; rows fit the prompt tail and the longest response.
  history_config = HistoryConfig(
      max_prompts=args.prompts, rollouts_per_prompt=2 * args.group,
      rollout_tokens=-(-(args.max_match + task.max_response_tokens + 1) // 8) * 8,
      max_match=args.max_match, siblings=4, finished_rollouts=2 * args.slots)
  history = History(config=history_config, min_match=1)
  combined = History(eagle, config=history_config, min_match=args.min_match)
  drafters = {"plain": None, "ngram": NGram(n=3), "history": history, "eagle3": eagle,
              "history+eagle3": combined}

  # Compile every method once (a fresh history drafter shares the compiled program).
  for name, drafter in drafters.items():
    fresh = drafter
    if isinstance(drafter, History):
      fresh = History(drafter.fallback, config=drafter.config)
    roll_out(policy, prompts, fresh, sampling, spec, engine, jax.random.key(10_000))
  print(f"  ready after {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)

  learning_rate = args.grpo_learning_rate or (1e-5 if args.policy == "medium" else 3e-4)
  optimizer = optax.adam(learning_rate)
  opt_state = optimizer.init(nnx.split(policy)[1])
  reward_fn = jax.jit(task.reward)
  records = []
  for epoch in range(args.epochs):
    # History alone steps aside until it knows the prompts: sibling matches alone do
    # not pay for a speculative round. Its always-drafting numbers are kept too.
    drafting = {name: name != "plain" for name in drafters}
    drafting["history"] = history.known_fraction(prompts) >= args.min_known
    runs = {name: (drafter if drafting[name] else None) for name, drafter in drafters.items()}
    if not drafting["history"]:
      runs["history (always drafting)"] = history
    outs: dict[str, list[Rollouts]] = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so load drifts hit every method alike
      for name, drafter in runs.items():
        outs[name].append(roll_out(policy, prompts, drafter, sampling, spec, engine,
                                   jax.random.key(epoch)))
    best = {name: dataclasses.replace(o[0], seconds=min(x.seconds for x in o),
                                      cpu_seconds=min(x.cpu_seconds for x in o))
            for name, o in outs.items()}
    plain = best["plain"]
    rewards = np.asarray(reward_fn(targets, jnp.asarray(plain.tokens),
                                   jnp.asarray(plain.lengths)))
    record = {"epoch": epoch, "mean_reward": round(float(rewards.mean()), 4),
              "mean_response_tokens": round(float(plain.lengths.mean()), 2),
              "history_known_fraction": history.known_fraction(prompts),
              "methods": {name: entry_of(best[name], plain, drafting.get(name, True))
                          for name in drafters}}
    if "history (always drafting)" in best:
      record["history_always_drafting"] = entry_of(best["history (always drafting)"], plain, True)
    records.append(record)
    print(json.dumps({"epoch": epoch, **{
        n: (m["acceptance_length"], m["speedup_vs_plain"], m["cpu_speedup_vs_plain"])
        for n, m in record["methods"].items()}}), file=sys.stderr, flush=True)
    history.observe(prompts, best["history (always drafting)" if not drafting["history"]
                                  else "history"])
    combined.observe(prompts, best["history+eagle3"])
    policy, opt_state = grpo_step(policy, optimizer, opt_state, prompts, plain, rewards,
                                  args.group)

  def mean(name, key, rows):
    return round(float(np.mean([r["methods"][name][key] for r in rows])), 3)

  later = records[1:] or records
  summary = {name: {"acceptance_length_epoch_0": records[0]["methods"][name]["acceptance_length"],
                    "mean_acceptance_length_later": mean(name, "acceptance_length", later),
                    "mean_speedup_later": mean(name, "speedup_vs_plain", later),
                    "mean_cpu_speedup_later": mean(name, "cpu_speedup_vs_plain", later),
                    "min_cpu_speedup": min(r["methods"][name]["cpu_speedup_vs_plain"]
                                           for r in records)}
             for name in drafters}
  payload = {
      "benchmark": "rollout-history drafting over RL epochs",
      "task": f"arithmetic, {task.min_digits}-{task.max_digits} digit worked sums",
      "devices": str(jax.devices()),
      "config": {"policy": args.policy, "epochs": args.epochs, "prompts": args.prompts, "group": args.group,
                 "num_slots": args.slots, "k": args.k, "grpo_learning_rate": learning_rate,
                 "sft_steps": args.sft_steps,
                 "eagle_updates": args.eagle_updates, "min_match": args.min_match,
                 "min_known": args.min_known, "repeats": args.repeats,
                 "history": dataclasses.asdict(history.config),
                 "policy_params": policy.config.num_params()},
      "epochs": records, "summary": summary,
      "wall_seconds": round(time.perf_counter() - started, 1),
  }
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "bench_history.json").write_text(json.dumps(payload, indent=2))
  plot(records, args.out / "bench_history.png")
  common.print_json(payload)
  return 0


if __name__ == "__main__":
  sys.exit(main())
