"""Which draft model the demo should distil: rollout speed-up and acceptance of draft
model variants on the demo's warm-started policy (prints JSON lines).

    python experiments/bench_demo_drafters.py [NAME ...]   # names from VARIANTS

The policy is SFT'd once with the demo preset's warm start; each variant then distils
its own draft model from it and runs the demo's speed check (RolloutArms: plain and
speculative rollouts of RL step 0's batch, interleaved, 7 repeats, median and quartiles
of the per-repeat speed-ups).
"""

import json
import sys
import time

from flax import nnx

from specrl_jax.rl.app.experiment import experiment_config
from specrl_jax.rl.app.rollout_speed import RolloutArms
from specrl_jax.rl.app.session import Session
from specrl_jax.rl.app.warm_start import fresh_models
from specrl_jax.rl.loop import sft

COMMON = ["--output.progress=false", "--output.directory=/tmp/bench_demo_drafters"]
W64 = ["--drafter.model.hidden_size=64", "--drafter.model.intermediate_size=128",
       "--drafter.model.num_heads=2"]
VARIANTS = {  # on top of the demo preset (a 128-wide one-layer drafter, k = 4, 200 steps)
    "64x1_k3_d100": W64 + ["--drafter.num_draft_tokens=3", "--warm_start.distill_steps=100"],
    "64x1_k3_d200": W64 + ["--drafter.num_draft_tokens=3"],
    "64x1_k4_d200": W64,
    "128x1_k3_d100": ["--drafter.num_draft_tokens=3", "--warm_start.distill_steps=100"],
    "128x1_k4_d100": ["--warm_start.distill_steps=100"],
    "128x2_k3_d100": ["--drafter.num_draft_tokens=3", "--warm_start.distill_steps=100",
                      "--drafter.model.num_layers=2"],
    "128x1_k4_d200": [],  # the demo's
}


def main(names) -> int:
  base = Session(experiment_config("demo", COMMON + ["--warm_start.distill_steps=0"]),
                 log=lambda _: None)
  policy = base.warm_start().policy
  for name in names or VARIANTS:
    config = experiment_config("demo", COMMON + VARIANTS[name])
    session = Session(config, log=lambda _: None)
    models = fresh_models(config)
    models.policy = policy
    c = config.warm_start
    started = time.perf_counter()
    models.draft, losses = sft.train_sft(
        models.draft, session.task,
        sft.SFTConfig(steps=c.distill_steps, batch_size=c.sft_batch_size,
                      learning_rate=c.distill_learning_rate, seed=config.task.seed + 1),
        teacher=models.policy)
    distil_seconds = time.perf_counter() - started
    _, online = session.drafter_for(models)
    check = RolloutArms(session, models).measure(nnx.split(models.policy)[1],
                                                  online.trainable, repeats=7)
    print(json.dumps({"name": name, "overrides": VARIANTS[name],
                      "distil_seconds": distil_seconds, "distil_loss": float(losses[-1]),
                      **check.as_dict()}), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
