"""The warm start of `specrl train`: SFT of the policy, distillation of the draft model
(when the drafter registry says the drafter distils one), cached in <directory>/warm_start under the configuration that produced it.

The cache is used only when its key.json (``run_directory.warm_start_key``) equals
the current configuration's; otherwise it is rebuilt, and the log says why. It is
written to warm_start.partial and renamed into place, so a process killed while
writing leaves the previous cache or none, never half of one.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from specrl_jax import checkpoint
from specrl_jax.models.hf import load_hf
from specrl_jax.models.transformer import Transformer
from specrl_jax.parallel import distributed
from specrl_jax.rl.app import drafter_registry, run_directory
from specrl_jax.rl.loop import sft
from specrl_jax.rl.app.experiment import ExperimentConfig
from specrl_jax.rl.tasks import Task


@dataclasses.dataclass
class Models:
  """The warm-started policy and the drafter's network where it has one of its own
  (a draft model: distilled here, or pretrained and loaded as it is)."""
  policy: Transformer
  draft: Transformer | None


def fresh_models(config: ExperimentConfig) -> Models:
  """The policy (the Hugging Face folder ``policy.path``, else a fresh model) and the
  drafter's network (``drafter_registry.draft_network``), before any warm start. The
  drafter's files are checked first, so that a mismatched one is refused before any
  model is loaded or anything compiles."""
  drafter_registry.check_section(config.drafter, config)
  drafter_registry.check_files(config)
  if config.policy.path:
    policy = load_hf(config.policy.path)
  else:
    policy = Transformer(config.policy.model_config(), rngs=nnx.Rngs(config.policy.seed))
  draft = drafter_registry.draft_network(config, policy.config.vocab_size)
  return Models(policy=policy, draft=draft)


def _replicate_on_all_devices(model: nnx.Module) -> None:
  """Replaces ``model``'s arrays by process 0's values replicated on every device of
  every process (a multi-process job's shared copy)."""
  state = multihost_utils.broadcast_one_to_all(jax.device_get(nnx.state(model)))
  sharding = distributed.everywhere()
  nnx.update(model, jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, x, x.shape), state))


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _train(models: Models, config: ExperimentConfig, task: Task,
           log: Callable[[str], None]) -> None:
  c = config.warm_start
  bars = config.output.progress and distributed.is_primary()
  if c.sft_steps:
    models.policy, losses = sft.train_sft(
        models.policy, task,
        sft.SFTConfig(steps=c.sft_steps, batch_size=c.sft_batch_size,
                      learning_rate=c.sft_learning_rate, noise=c.sft_noise,
                      seed=config.task.seed),
        progress="warm start: SFT policy" if bars else None)
    log(f"warm start: SFT {c.sft_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  if drafter_registry.distils(config) and c.distill_steps:
    models.draft, losses = sft.train_sft(
        models.draft, task,
        sft.SFTConfig(steps=c.distill_steps, batch_size=c.sft_batch_size,
                      learning_rate=c.distill_learning_rate, seed=config.task.seed + 1),
        teacher=models.policy, progress="warm start: distil drafter" if bars else None)
    log(f"warm start: drafter distilled {c.distill_steps} steps, soft CE "
        f"{losses[0]:.3f} -> {losses[-1]:.3f}")


def warm_start(config: ExperimentConfig, record: dict[str, Any], task: Task, *,
               log: Callable[[str], None] = print,
               timings: dict[str, float] | None = None) -> Models:
  """The warm-started models of ``config`` (``record``: the config as JSON data),
  loaded from the cache when it was made with the same configuration."""
  models = fresh_models(config)
  c = config.warm_start
  distils = drafter_registry.distils(config) and c.distill_steps > 0
  if not c.sft_steps and not distils:
    return models  # nothing to train, so nothing to cache (the policy is its folder's)
  folder = os.path.abspath(os.path.join(config.output.directory, "warm_start"))
  key = run_directory.warm_start_key(record)
  names = ["policy"] + (["draft"] if distils else [])
  multi = jax.process_count() > 1
  mismatch = (run_directory.warm_start_mismatch(folder, key) if os.path.isdir(folder)
              else "absent")
  if mismatch is None and not all(os.path.isdir(os.path.join(folder, n)) for n in names):
    mismatch = f"{folder} lacks one of {names}"
  cached = mismatch is None
  if multi:  # process 0's view decides, so that every process takes the same branch
    cached = bool(multihost_utils.broadcast_one_to_all(np.asarray(cached)))
  if cached:
    for name in names:
      model = getattr(models, name)
      # Several processes restore one global copy, replicated on every device.
      shardings = (jax.tree.map(lambda _: distributed.everywhere(), nnx.state(model))
                   if multi else None)
      checkpoint.restore_model(os.path.join(folder, name), model, shardings=shardings)
    log(f"warm start: loaded from {folder}")
    return models
  if mismatch != "absent":
    log(f"warm start: rebuilding it: {mismatch}")
  started = time.perf_counter()
  _train(models, config, task, log)
  if timings is not None:
    timings["warm_start_seconds"] = time.perf_counter() - started
  if multi:
    # Each process trained its own copy (on its first device); all continue from
    # process 0's, bit for bit, as global arrays that orbax can write together.
    for name in names:
      _replicate_on_all_devices(getattr(models, name))
  partial = folder + ".partial"
  if distributed.is_primary() and os.path.exists(partial):
    shutil.rmtree(partial)
  _sync("specrl warm start partial folder cleared")
  for name in names:
    checkpoint.save_model(os.path.join(partial, name), getattr(models, name))
  _sync("specrl warm start saved")
  if distributed.is_primary():
    run_directory.write_json(os.path.join(partial, run_directory.WARM_START_KEY), key)
    if os.path.exists(folder):
      shutil.rmtree(folder)
    os.replace(partial, folder)
  _sync("specrl warm start in place")
  return models
