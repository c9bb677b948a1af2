"""What a `specrl train` run reads besides its config: the policy's tokenizer, the
task (a built-in task or a dataset with its held-out split), and the per-step data
records (where the step is in the data, a few scored samples, periodic evaluation)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from specrl_jax.config import ConfigError
from specrl_jax.models import tokenizer
from specrl_jax.models.text_tokenizer import TextTokenizer
from specrl_jax.models.hf import read_hf_model_config
from specrl_jax.rl.app import run_directory
from specrl_jax.rl.app.data_fingerprint import Fingerprint
from specrl_jax.rl.app.data_fingerprint import recorded as data_fingerprint_record
from specrl_jax.rl.loop.evaluation import evaluate
from specrl_jax.rl.app.experiment import ExperimentConfig
from specrl_jax.parallel import distributed
from specrl_jax.rl.tasks import DatasetTask, PromptSet, Task
from specrl_jax.rl.tasks.python_reward import take_failures
from specrl_jax.rl.tasks.row_checks import check_rows, refuse


def _log(message: str) -> None:
  if distributed.is_primary():
    print(message, flush=True)


def policy_tokenizer(config: ExperimentConfig) -> TextTokenizer:
  """The policy folder's own tokenizer, else the built-in vocabulary's."""
  if not config.policy.path:
    return tokenizer.text_tokenizer()
  text_tokenizer = TextTokenizer.from_pretrained(config.policy.path)
  model_config = os.path.join(config.policy.path, "config.json")
  vocab_size = (run_directory.read_json(model_config) or {}).get("vocab_size")
  # Ids past the embedding table would be clamped by the gather, silently.
  if isinstance(vocab_size, int) and text_tokenizer.vocab_size > vocab_size:
    raise ConfigError(f"the tokenizer of {config.policy.path} has {text_tokenizer.vocab_size} "
                      f"tokens but {model_config} has vocab_size={vocab_size}: the model "
                      "cannot read all of its ids")
  return text_tokenizer


def policy_positions(config: ExperimentConfig) -> int:
  """The policy's max_position_embeddings; its Hugging Face folder (config.json, the
  weights' headers, the architecture) is checked now, before any work."""
  if not config.policy.path:
    return config.policy.model_config().max_position_embeddings
  return read_hf_model_config(config.policy.path).max_position_embeddings


def data_fingerprint(config: ExperimentConfig, task: Task | None, resuming: bool,
                     log: Callable[[str], None]) -> Fingerprint | None:
  """The fingerprint of the dataset the run reads (None: a given or built-in task),
  checked against the run directory's when ``resuming``."""
  if task is not None or not config.data.path:
    return None
  fingerprint = Fingerprint(config.data)
  recorded = data_fingerprint_record(config.output.directory)
  if resuming and recorded is not None:
    fingerprint.resume(recorded, log)
  return fingerprint


def check_lengths(config: ExperimentConfig, task: Task, prompt_set: PromptSet,
                  positions: int) -> None:
  """Refuses prompts plus responses longer than the policy has positions for."""
  longest = max((len(p) for p in prompt_set.prompts), default=0)
  response = task.max_response_tokens
  if longest + response > positions:
    where = f"{config.policy.path}/config.json" if config.policy.path else "the policy section"
    raise ConfigError(
        f"the longest prompt ({longest} tokens) plus {response} response tokens is "
        f"{longest + response} positions, past the policy's max_position_embeddings="
        f"{positions} ({where}): lower --data.max_response_tokens to at most "
        f"{max(positions - longest, 0)}, or --data.max_prompt_tokens")


def run_tasks(config: ExperimentConfig, text_tokenizer: TextTokenizer, task: Task | None,
              log: Callable[[str], None] = _log, fingerprint: Fingerprint | None = None
              ) -> tuple[Task, DatasetTask | None]:
  """(training task, held-out task or None): ``task`` when given, else the dataset's
  (``data.path``, its unusable rows refused or reported: ``data.on_bad_rows``; held out
  as ``fingerprint`` says), else the built-in ``task`` section's; checked against the
  policy's tokenizer. A dataset task given directly must have no unusable row (nothing
  is dropped unreported)."""
  held_out = None
  if task is None and config.data.path:
    task, held_out = config.data.make(
        text_tokenizer, log=log, held_out_rows=fingerprint.held_out if fingerprint else None)
  elif isinstance(task, DatasetTask):
    report = check_rows(task, source="the task's records")
    if report.bad:
      raise refuse(report)
  task = task if task is not None else config.task.make()
  task.check_tokenizer(text_tokenizer)
  return task, held_out


def check_data(config: ExperimentConfig) -> None:
  data = config.data
  if data.path and not data.solution_field and config.warm_start.sft_steps:
    raise ConfigError(
        f"WarmStartSection.sft_steps={config.warm_start.sft_steps} is invalid with a dataset "
        "without worked solutions: set --data.solution_field=COLUMN or "
        "--warm_start.sft_steps=0")


def data_position(prompt_set: PromptSet, indices: Sequence[int], step: int,
                  prompts_per_step: int) -> dict[str, Any]:
  """Where step ``step`` is in the data: its epoch and its prompts (dataset rows for
  a dataset task, else prompt-set indices)."""
  if "index" in prompt_set.targets:
    rows = [int(r) for r in prompt_set.targets["index"][list(indices)]]
  else:
    rows = [int(i) for i in indices]
  return {"epoch": step * prompts_per_step // len(prompt_set), "rows": rows}


def step_records(config: ExperimentConfig, task: Task, held_out: DatasetTask | None,
                 prompt_set: PromptSet, indices: Sequence[int], step: int, graphdef,
                 state) -> dict[str, Any]:
  """The data records of step ``step`` for its metrics line: ``data`` (position),
  ``samples`` (a few scored ones, dataset tasks) and, every ``data.eval_every``
  steps, the held-out split's ``eval_*`` metrics under the updated policy."""
  position = data_position(prompt_set, indices, step, config.rl.prompts_per_step)
  records: dict[str, Any] = {"data": position}
  samples = task.take_samples(position["rows"]) if isinstance(task, DatasetTask) else []
  if samples:
    records["samples"] = samples
  if isinstance(task, DatasetTask) and task.skipped_rows:
    records["data_skipped_rows"] = task.skipped_rows
  every = config.data.eval_every
  # One process's evaluation: the weights of a multi-process mesh are not all here.
  if (held_out is not None and every and (step + 1) % every == 0
      and jax.process_count() == 1):
    # The weights the rollouts sample with: a LoRA state's base merged with its adapters.
    model = nnx.merge(graphdef, jax.device_get(state.compute_params()))
    result = evaluate(model, held_out, k=config.data.eval_k,
                      temperature=config.rl.temperature, seed=step,
                      threshold=config.data.correct_threshold,
                      max_prompts=config.data.eval_max_prompts)
    records.update({f"eval_{name}": value for name, value in result.items()})
  # Samples scored 0 because their worker timed out or died (the evaluation's too).
  failures = take_failures()
  for line in failures:
    _log(f"warning: step {step}: {line}")
  if failures or (isinstance(task, DatasetTask) and task.workers):
    records["reward_failures"] = len(failures)
  return records
