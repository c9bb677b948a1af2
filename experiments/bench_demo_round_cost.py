"""What a speculative round costs against a plain step in the demo's RL rollout, per
policy shape and engine width, to choose the demo's sizes (prints JSON lines).
Each name's overrides apply on top of the demo preset.

    python experiments/bench_demo_round_cost.py [NAME ...]   # names from SHAPES

Untrained weights (no warm start): acceptance is meaningless here, but the cost per
target call is not, and it needs no SFT. Each shape runs the demo's RolloutArms (the
plain and the speculative rollout of RL step 0's batch, interleaved repeats):
round_over_plain is the median speculative seconds per target call over the median
plain seconds per call; speculation pays where acceptance exceeds it.
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from specrl_jax.rl.app.experiment import experiment_config
from specrl_jax.rl.app.rollout_speed import RolloutArms
from specrl_jax.rl.app.session import Session
from specrl_jax.rl.loop.drafter_memory import rollout_memory

# The demo's first sizes (a 1.2M policy, 8 slots), where no drafter paid, and the sizes
# it has now (the preset: 11.5M policy, 4 slots).
SMALL, SMALL_DRAFTER = common.SMALL_DEMO, common.SMALL_DEMO_DRAFTER
WIDE = ["--policy.hidden_size=512", "--policy.intermediate_size=1536", "--policy.num_layers=2",
        "--policy.num_heads=8", "--policy.head_dim=64"]
M768 = ["--policy.hidden_size=768", "--policy.intermediate_size=2048", "--policy.num_layers=2",
        "--policy.num_heads=12", "--policy.head_dim=64"]
SHAPES = {
    "192x3_s8": SMALL,
    "192x3_s4": SMALL + ["--rl.engine.num_slots=4"],
    "192x3_s4_k2": SMALL + ["--rl.engine.num_slots=4", "--drafter.num_draft_tokens=2"],
    "192x3_s2": SMALL + ["--rl.engine.num_slots=2"],
    "192x3_s8_history": SMALL + ["--drafter.kind=history"],
    "512x2_s8": SMALL_DRAFTER + WIDE + ["--rl.engine.num_slots=8"],
    "512x2_s4": SMALL_DRAFTER + WIDE + ["--rl.engine.num_slots=4"],
    "768x2_s4": SMALL_DRAFTER + M768 + ["--rl.engine.num_slots=4"],
    "768x2_s2": SMALL_DRAFTER + M768 + ["--rl.engine.num_slots=2"],
    "512x3_s4_k3": SMALL_DRAFTER,  # the demo's policy and slots, the old drafter
    "512x3_s2_k3": SMALL_DRAFTER + ["--rl.engine.num_slots=2"],
    "demo": [],  # the preset as it is
}


def main(names) -> int:
  for name in names or SHAPES:
    config = experiment_config("demo", SHAPES[name] + [
        "--warm_start.sft_steps=0", "--warm_start.distill_steps=0", "--rl.prompts_per_step=4",
        f"--output.directory=/tmp/bench_demo_round_cost/{name}", "--output.progress=false"])
    session = Session(config, log=lambda _: None)
    models = session.warm_start()
    drafter, online = session.drafter_for(models)
    memory = rollout_memory(drafter)
    draft_params = (online.trainable if online else
                    memory.place(drafter.params(), memory.arrays()) if memory else ())
    started = time.perf_counter()
    check = RolloutArms(session, models).measure(nnx.split(models.policy)[1], draft_params,
                                                  repeats=5)
    plain_ms = 1e3 * statistics.median(check.plain_seconds) / check.target_calls_plain
    spec_ms = 1e3 * statistics.median(check.speculative_seconds) / check.target_calls_speculative
    print(json.dumps({"name": name, "overrides": SHAPES[name], **check.as_dict(),
                      "plain_ms_per_call": plain_ms, "speculative_ms_per_call": spec_ms,
                      "round_over_plain": spec_ms / plain_ms, "load": os.getloadavg(),
                      "wall_seconds": time.perf_counter() - started}), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
