"""The simulator's cost model predicts this project's own decode times on this CPU.

A small measurement (experiments/sim_vs_measured.py on a random 6 x 768 target and a
1 x 64 draft model): the cost model is given dense forward timings of the pieces,
the engine's per-round overheads calibrated on plain decoding at batches 1 and 4 and
on k = 1 at batch 1, and each run's measured acceptance; it then predicts the three
other (batch, k) decode times. The README's figure is the same comparison on the
38M-parameter pair (every point within 20%).

This is the one test that times anything, so it is marked slow (`make test-full`), out
of the default suite: predictions and measurements come from the same process minutes
apart, and on a shared machine (CI's two cores run three test workers) the other worker's
load moved one run by 25% against the pieces timed a minute later. The pass bar (the
median held-out error within 20%, none beyond 50%) still catches a wrong round count, a
missing drafter cost or a mis-modelled batch tail; the cost model's arithmetic is
checked without timing in tests/test_sim.py.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import sim_vs_measured  # noqa: E402

VOCAB = 256
# The README pair's target shape (6 x 768, 36M parameters here): big enough that a
# round's time is mostly matmuls, as in real use, rather than the dispatch of a few
# hundred tiny ops (on a 1M-parameter model the engine's bookkeeping dominates and a
# dense forward says little about a round).
TARGET = sj.ModelConfig(vocab_size=VOCAB, hidden_size=768, intermediate_size=2048,
                        num_layers=6, num_heads=12, num_kv_heads=4, head_dim=64)
DRAFT = sj.ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32)
NEW_TOKENS = 32


def measure_and_predict(target, draft):
  batches, ks = (1, 4), (1, 3)
  rows = sim_vs_measured.measure_runs(target, draft, batches=batches, ks=ks,
                                      new_tokens=NEW_TOKENS, repeats=2, seeds=2,
                                      prompts_of=sim_vs_measured.random_prompts(VOCAB))
  pieces = sim_vs_measured.measure_pieces(target, draft, batches=batches, ks=ks, repeats=10)
  rows, _ = sim_vs_measured.predict(rows, pieces, new_tokens=NEW_TOKENS, calibration=(1, 1))
  table = [(r["batch"], r["k"], round(r["decode_seconds"], 4), round(r["predicted_seconds"], 4))
           for r in rows]
  # Random models accept some drafts: the speculative rows are not plain decoding.
  assert all(r["acceptance_length"] > 1.2 for r in rows if r["k"]), table
  errors = np.abs([r["relative_error"] for r in rows if not r["calibration"]])
  assert len(errors) == 3, table
  return errors, table


@pytest.mark.slow
def test_the_cost_model_predicts_our_plain_and_speculative_decode_times():
  target = sj.Transformer(TARGET, rngs=nnx.Rngs(0))
  draft = sj.Transformer(DRAFT, rngs=nnx.Rngs(1))
  # Under a parallel test run the other worker's load can shift the runs against the
  # pieces timed a minute later; a second measurement decides then. A wrong model
  # fails both.
  errors, table = measure_and_predict(target, draft)
  if np.median(errors) > sim_vs_measured.TOLERANCE or errors.max() > 0.5:
    errors, table = measure_and_predict(target, draft)
  assert np.median(errors) <= sim_vs_measured.TOLERANCE, table
  assert errors.max() <= 0.5, table
