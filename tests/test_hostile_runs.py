"""`specrl train` and `specrl eval` under careless and hostile use of runs (issue 36):
LoRA runs resume and evaluate; an output directory is locked by its run; a damaged
checkpoint is set aside for the one before; a changed dataset is refused on resume,
or continued with its held-out rows kept; prompts plus responses past the model's
positions, bad model folders and unwritable paths are refused in one line each.

Everything runs through the commands' ``main`` (a subprocess only to hold a lock),
on the tiny preset over a built-in-vocabulary dataset; most cases are refused before
anything compiles.
"""

import errno
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import cli
from specrl_jax.models import tokenizer as builtin
from specrl_jax.rl.app import data_fingerprint, run_lock, train_command
from specrl_jax.rl.app.metrics import read_jsonl

ROWS = [{"prompt": f"{a}+{b}", "answer": a + b} for a in range(1, 9) for b in range(1, 5)]


def _write_rows(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _argv(rows, directory, *extra):
  return ["--preset=tiny", "--drafter.kind=none", "--warm_start.sft_steps=0",
          f"--data.path={rows}", "--data.eval_fraction=0.25", "--data.eval_k=2",
          "--data.max_response_tokens=6", "--output.progress=false",
          "--output.tensorboard=false", "--output.checkpoint_every=1",
          f"--output.directory={directory}", *extra]


def _refused(capsys, command, argv, *fragments):
  """Runs ``command``'s main on ``argv``: it must fail with one line on stderr holding
  every fragment and no traceback; that line."""
  capsys.readouterr()
  rc = (train_command.main(argv) if command == "train" else cli.main(["eval", *argv]))
  captured = capsys.readouterr()
  err = captured.err.strip()
  assert rc == 1, err
  assert len(err.splitlines()) == 1 and "Traceback" not in err, err
  assert err.startswith(f"specrl {command}: "), err
  for fragment in fragments:
    assert fragment in err, (fragment, err)
  _refused.out = captured.out
  return err


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
  return _write_rows(tmp_path_factory.mktemp("data") / "rows.jsonl", ROWS)


# ------------------------------------------------------------------ LoRA runs

LORA = ("--learner.lora.rank=4", "--data.eval_every=2", "--rl.steps=2")


@pytest.fixture(scope="module")
def lora_run(rows_file, tmp_path_factory):
  """A LoRA run of 2 steps evaluated at step 2, then the identical command again."""
  import contextlib
  import io
  directory = tmp_path_factory.mktemp("lora") / "run"
  outputs = []
  for _ in range(2):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      rc = train_command.main(_argv(rows_file, directory, *LORA))
    outputs.append(out.getvalue())
    assert rc == 0, out.getvalue()
  return {"directory": directory, "first": outputs[0], "again": outputs[1]}


def test_a_lora_run_evaluates_periodically_on_the_merged_adapters(lora_run):
  records = read_jsonl(lora_run["directory"] / "metrics.jsonl")
  assert [r["step"] for r in records] == [0, 1]
  assert "eval_pass@1" in records[1] and records[1]["eval_num_prompts"] == 8
  assert "eval_pass@1" not in records[0]


def test_a_lora_run_resumes_with_the_identical_command(lora_run):
  assert "resumed from checkpoint step 2" in lora_run["again"], lora_run["again"]
  assert len(read_jsonl(lora_run["directory"] / "metrics.jsonl")) == 2


def test_specrl_eval_reads_a_lora_runs_checkpoint(lora_run, capsys):
  capsys.readouterr()
  assert cli.main(["eval", f"--checkpoint={lora_run['directory']}", "--k=2",
                   "--max_prompts=3"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["step"] == 2 and result["num_prompts"] == 3 and "pass@2" in result


# ------------------------------------------------------------------ damaged checkpoints

def _largest_file(folder):
  files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
  return max(files, key=os.path.getsize)


def test_a_damaged_checkpoint_is_set_aside_and_the_one_before_resumed(lora_run, rows_file,
                                                                      tmp_path, capsys):
  directory = tmp_path / "run"
  shutil.copytree(lora_run["directory"], directory)
  damaged = _largest_file(directory / "checkpoints" / "2")
  with open(damaged, "r+b") as file:
    file.truncate(os.path.getsize(damaged) // 2)
  capsys.readouterr()
  # To step 1 only: the step trained anew after the resume would add nothing here.
  assert train_command.main(_argv(rows_file, directory, *LORA, "--rl.steps=1")) == 0
  out = capsys.readouterr().out
  assert "warning: checkpoint step 2" in out and "is damaged" in out, out
  assert f"moved to {directory / 'checkpoints' / 'damaged-2'}" in out, out
  assert "resumed from checkpoint step 1" in out, out
  assert sorted(os.listdir(directory / "checkpoints")) == ["1", "damaged-2"]
  assert [r["step"] for r in read_jsonl(directory / "metrics.jsonl")] == [0]


def test_a_checkpoint_of_another_configuration_still_does_not_fit(lora_run, rows_file,
                                                                  tmp_path, capsys):
  directory = tmp_path / "run"
  shutil.copytree(lora_run["directory"], directory)
  os.remove(directory / "config.json")  # as an older run without its record
  _refused(capsys, "train", _argv(rows_file, directory, "--learner.lora.rank=2",
                                  "--data.eval_every=2", "--rl.steps=2"),
           "checkpoint step 2", "does not fit this configuration's train state")
  assert sorted(os.listdir(directory / "checkpoints")) == ["1", "2"]  # nothing set aside


# ------------------------------------------------------------------ changed datasets

def _run_begun_on(rows, directory, *extra):
  """A run directory as a run on ``rows`` leaves it (its data fingerprint and a
  checkpoint folder), without training: the data check comes before any work."""
  config = train_command.parse_argv(_argv(rows, directory, *extra))
  fingerprint = data_fingerprint.Fingerprint(config.data)
  os.makedirs(directory / "checkpoints" / "3")
  data_fingerprint.write(str(directory), fingerprint)
  return fingerprint


def test_a_resume_on_a_changed_dataset_is_refused_naming_the_rows(tmp_path, capsys):
  rows = _write_rows(tmp_path / "rows.jsonl", ROWS)
  _run_begun_on(rows, tmp_path / "run")
  edited = [dict(r) for r in ROWS]
  edited[5]["answer"] = 99
  _write_rows(rows, edited[:20] + edited[21:] + [{"prompt": "9+9", "answer": 18}] * 2)
  err = _refused(capsys, "train", _argv(rows, tmp_path / "run"),
                 "the data changed since the run began", "2 rows added (rows 31, 32)",
                 "1 rows removed (rows 20)", "1 rows edited (rows 5)",
                 "--data.allow_changed_dataset=true")
  assert str(rows) in err


def test_a_changed_dataset_continues_on_request_with_its_held_out_rows_kept(tmp_path):
  rows = _write_rows(tmp_path / "rows.jsonl", ROWS)
  before = _run_begun_on(rows, tmp_path / "run")
  held_before = [ROWS[i] for i in sorted(before.held_out)]
  added = [{"prompt": f"{a}+9", "answer": a + 9} for a in range(1, 9)]
  _write_rows(rows, ROWS + added)  # a third more rows: a fresh draw would differ
  logs = []
  config = train_command.parse_argv(_argv(rows, tmp_path / "run",
                                          "--data.allow_changed_dataset=true"))
  session = train_command.Session(config, log=logs.append)
  assert any("8 rows added" in line and "held out as before" in line for line in logs), logs
  assert list(session.eval_task.records) == held_before
  assert all(row in session.task.records for row in added)
  fresh = data_fingerprint.Fingerprint(config.data).held_out
  assert fresh != before.held_out  # what the run would have evaluated without the record


# ------------------------------------------------------------------ the lock

def test_a_second_run_on_a_locked_directory_is_refused_naming_the_holder(rows_file, tmp_path,
                                                                         capsys):
  directory = tmp_path / "run"
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys; from specrl_jax.rl.app import run_lock; "
       f"run_lock.acquire({str(directory)!r}); print('held', flush=True); sys.stdin.read()"],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
      env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
  try:
    assert holder.stdout.readline().strip() == "held"
    _refused(capsys, "train", _argv(rows_file, directory),
             "is in use by another `specrl train`", f"pid {holder.pid}",
             repr(socket.gethostname()), "started ")
  finally:
    holder.communicate("", timeout=60)
  assert not (directory / "config.json").exists()


def test_a_stale_lock_of_a_killed_run_is_taken_over_with_a_warning(lora_run, rows_file,
                                                                   tmp_path, capsys):
  directory = tmp_path / "run"
  shutil.copytree(lora_run["directory"], directory)
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  pid = int(gone.stdout)  # a process that has ended, as a killed run's
  (directory / run_lock.LOCK).write_text(json.dumps(
      {"pid": pid, "host": socket.gethostname(), "started": "2026-01-01 00:00:00 UTC"}))
  capsys.readouterr()
  assert train_command.main(_argv(rows_file, directory, *LORA)) == 0
  out = capsys.readouterr().out
  assert f"{directory / run_lock.LOCK} was left by a run that is gone (pid {pid}" in out, out
  assert "taking the lock over" in out and "resumed from checkpoint step 2" in out
  assert not (directory / run_lock.LOCK).exists()  # released when the run ended


# ------------------------------------------------------------------ refused up front

@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
  """A built-in-vocabulary model folder with 128 positions."""
  folder = tmp_path_factory.mktemp("model")
  model = sj.Transformer(sj.ModelConfig(vocab_size=builtin.VOCAB_SIZE, hidden_size=16,
                                        intermediate_size=32, num_layers=1, num_heads=2,
                                        num_kv_heads=1, head_dim=8,
                                        max_position_embeddings=128), rngs=nnx.Rngs(0))
  sj.save_hf(model, folder, tokenizer=builtin.text_tokenizer())
  return folder


def test_prompts_plus_responses_past_the_models_positions_are_refused(model_folder, rows_file,
                                                                     tmp_path, capsys):
  _refused(capsys, "train", _argv(rows_file, tmp_path / "run", f"--model={model_folder}",
                                  "--data.max_response_tokens=200"),
           "plus 200 response tokens", "max_position_embeddings=128",
           "lower --data.max_response_tokens to at most 12")


def test_a_model_folder_without_weights_is_refused_before_any_work(model_folder, rows_file,
                                                                   tmp_path, capsys):
  folder = tmp_path / "model"
  shutil.copytree(model_folder, folder)
  os.remove(folder / "model.safetensors")
  _refused(capsys, "train", _argv(rows_file, tmp_path / "run", f"--model={folder}",
                                  "--warm_start.sft_steps=50"),
           "holds neither model.safetensors")
  assert not (tmp_path / "run" / "warm_start").exists()


def test_an_unsupported_architecture_is_refused_before_any_work(model_folder, rows_file,
                                                                tmp_path, capsys):
  folder = tmp_path / "model"
  shutil.copytree(model_folder, folder)
  config = json.loads((folder / "config.json").read_text())
  config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
  (folder / "config.json").write_text(json.dumps(config))
  _refused(capsys, "train", _argv(rows_file, tmp_path / "run", f"--model={folder}",
                                  "--warm_start.sft_steps=50"), "GPT2LMHeadModel")
  assert not (tmp_path / "run" / "warm_start").exists()


def test_a_missing_model_folder_is_one_line(rows_file, tmp_path, capsys):
  _refused(capsys, "train", _argv(rows_file, tmp_path / "run",
                                  f"--model={tmp_path / 'nowhere'}"), "does not exist")


def test_eval_of_a_nonexistent_checkpoint_says_it_does_not_exist(tmp_path, capsys):
  _refused(capsys, "eval", [f"--checkpoint={tmp_path / 'nonexistent'}"],
           "does not exist", "run directory or a Hugging Face model folder")


def test_every_row_too_long_is_one_line(rows_file, tmp_path, capsys):
  _refused(capsys, "train", _argv(rows_file, tmp_path / "run", "--data.max_prompt_tokens=2"),
           "prompt")


def test_a_memory_budget_that_cannot_fit_is_one_line(rows_file, tmp_path, capsys):
  _refused(capsys, "train", _argv(rows_file, tmp_path / "run",
                                  "--rl.engine.memory_budget_bytes=4096"), "MemoryBudgetError")


def test_an_unwritable_output_directory_is_one_line(rows_file, tmp_path, capsys):
  locked = tmp_path / "read_only"
  locked.mkdir()
  locked.chmod(0o500)
  if os.access(locked, os.W_OK):  # root writes anyway: a path no one may create
    locked = "/sys/specrl_unwritable" if os.path.isdir("/sys") else pytest.skip("no /sys")
  _refused(capsys, "train", _argv(rows_file, f"{locked}/run"), f"{locked}",
           "give a writable --output.directory")


def test_a_full_disk_is_one_line(rows_file, tmp_path, capsys, monkeypatch):
  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "run" / "x"))
  monkeypatch.setattr(run_lock, "_publish", full)
  _refused(capsys, "train", _argv(rows_file, tmp_path / "run"), "No space left on device",
           "free space on that disk")


def test_a_compilation_cache_under_a_file_is_one_line(rows_file, tmp_path, capsys,
                                                       monkeypatch):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  (tmp_path / "file").write_text("")
  _refused(capsys, "train", _argv(rows_file, tmp_path / "run",
                                  f"--output.compilation_cache={tmp_path / 'file' / 'cache'}"),
           "OutputSection.compilation_cache", "is a file")
