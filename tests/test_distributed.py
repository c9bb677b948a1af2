"""Multi-process execution: two processes of 4 CPU devices (gloo collectives) compute
what one process of 8 devices does, share checkpoints with it in both directions,
move weights and trajectories between sub-meshes of different processes, share one
clock for the in-loop controller's round costs (process 0's), and fail with a clear
error in bounded time when the coordinator or a peer is missing.

The one-process references run in this pytest process (8 devices, see conftest.py);
the two-process runs are subprocesses on localhost.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import distributed_worker as worker
from specrl_jax.checkpoint import TrainCheckpointManager
from specrl_jax.config import ConfigError
from specrl_jax.parallel import batch_sharding, distributed, make_mesh
from specrl_jax.rl.app import train_command
from specrl_jax.rl.loop.learner import abstract_train_state
from specrl_jax.rl.app.metrics import read_jsonl
from specrl_jax.speculative.inloop_calibration import refresh

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
# Every subprocess is killed (SIGKILL: jax.distributed catches SIGTERM) after this.
LIMIT = 400
# A tiny policy briefly fine-tuned so that some rollouts earn reward: GRPO then has
# non-zero advantages and the parameters really move.
TRAIN_ARGS = ["--preset=tiny", "--policy.num_layers=1", "--warm_start.sft_steps=60",
              "--drafter.kind=none",
              "--rl.steps=2", "--rl.mesh=2,2,2", "--rl.prompts_per_step=4",
              # One slot per shard: the decode order whose samples earn some reward
              # (the tiny preset's num_slots=0 now gives each sample its own slot).
              "--rl.engine.num_slots=1",
              "--output.checkpoint_every=0", "--output.tensorboard=false",
              "--output.progress=false"]
TIMING = ("step_seconds", "samples_per_second", "tokens_per_second")
ASYNC_TIMING = {"rollout_seconds", "train_seconds", "exposed_rollout_seconds", "sync_seconds"}


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


# Cluster variables jax.distributed would detect: the tests set the ones they mean.
CLUSTER_VARIABLES = ("SLURM_", "OMPI_", "KUBERNETES_", "TPU_", "MEGASCALE_", "JAX_COORDINATOR")


def _env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARIABLES)}
  return dict(env, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4",
              PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                          os.environ.get("PYTHONPATH", "")]), **extra)


def _two_processes(command, extra=lambda process_id: []):
  """The commands of processes 0 and 1 of a job with a fresh localhost coordinator."""
  coordinator = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2"]
  return [command + coordinator + ["--process-id", str(i)] + extra(i) for i in range(2)]


def _start(commands, log_dir, envs=None) -> list[subprocess.Popen]:
  """One process per command, its output in log_dir/<index>.log."""
  processes = []
  for index, command in enumerate(commands):
    with open(os.path.join(log_dir, f"{index}.log"), "w") as log:
      processes.append(subprocess.Popen(command, env=envs[index] if envs else _env(),
                                        stdout=log, stderr=subprocess.STDOUT))
  return processes


def _wait(processes, log_dir, timeout=LIMIT) -> list[str]:
  """Waits for every process (killing any left after ``timeout``); their outputs."""
  try:
    for process in processes:
      process.wait(timeout=timeout)
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
  return [open(os.path.join(log_dir, f"{i}.log")).read() for i in range(len(processes))]


def _run_ok(commands, log_dir) -> list[str]:
  processes = _start(commands, log_dir)
  outputs = _wait(processes, log_dir)
  for process, output in zip(processes, outputs):
    assert process.returncode == 0, output[-5000:]
  return outputs


def _close(a, b):
  if isinstance(a, dict):  # a step's data position: the same rows, exactly
    assert a == b
    return
  np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


# ------------------------------------------------------------------ launch options

def test_launch_flags_become_a_distributed_config():
  launch, rest = train_command.parse_distributed_argv(
      ["--preset=tiny", "--coordinator", "10.0.0.1:1234", "--num-processes=4",
       "--process-id", "3", "--heartbeat-timeout=30", "--rl.steps=2"])
  assert rest == ["--preset=tiny", "--rl.steps=2"]
  assert launch == distributed.DistributedConfig(coordinator="10.0.0.1:1234", num_processes=4,
                                                 process_id=3, heartbeat_timeout=30)
  auto, _ = train_command.parse_distributed_argv(["--distributed", "--init-timeout", "60"])
  assert auto.auto_detect and auto.initialization_timeout == 60
  assert train_command.parse_distributed_argv(["--rl.steps=2"]) == (None, ["--rl.steps=2"])


@pytest.mark.parametrize("argv, message", [
    (["--coordinator", "h:1", "--num-processes", "2"], "all given, or none"),
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
     r"process_id=2.*0\.\.1"),
    (["--num-processes", "two"], "expected an integer"),
    (["--heartbeat-timeout", "5"], "only apply to a multi-process run"),
    (["--distributed", "--process-id", "0"], "not both"),
    (["--coordinator"], "needs a value"),
])
def test_bad_launch_flags_are_clear_errors(argv, message):
  with pytest.raises(ConfigError, match=message):
    train_command.parse_distributed_argv(argv)


def test_process_rows_are_the_block_this_process_feeds():
  sharding = batch_sharding(make_mesh((2, 2, 2)))
  assert distributed.process_rows(sharding, 16) == slice(0, 16)  # one process: all rows


# ------------------------------------------------------------------ failures are bounded

def _timed(command, timeout=120):
  started = time.monotonic()
  result = subprocess.run(command, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
  return result, time.monotonic() - started


def test_an_unreachable_coordinator_is_a_clear_error_not_a_hang():
  address = f"127.0.0.1:{_free_port()}"  # nothing listens there
  result, seconds = _timed([sys.executable, "-m", "specrl_jax.rl.app.train_command",
                            "--coordinator", address, "--num-processes", "2",
                            "--process-id", "1", "--init-timeout", "2"])
  assert result.returncode == 1, result.stderr[-3000:]
  assert f"could not reach the coordinator at {address} within 2s" in result.stderr
  assert seconds < 60


def test_processes_that_never_join_stop_the_coordinator_with_a_clear_error():
  result, seconds = _timed([sys.executable, "-m", "specrl_jax.rl.app.train_command",
                            "--coordinator", f"127.0.0.1:{_free_port()}",
                            "--num-processes", "2", "--process-id", "0",
                            "--init-timeout", "3"])
  assert result.returncode == distributed.INIT_TIMEOUT_EXIT_CODE, result.stderr[-3000:]
  assert "did not start within 3s" in result.stderr
  assert "not all 2 processes joined" in result.stderr
  assert seconds < 60


def test_joining_after_jax_created_its_devices_is_a_clear_error():
  code = ("import jax; from specrl_jax.parallel import distributed as d; jax.devices(); "
          "d.initialize(d.DistributedConfig(coordinator='127.0.0.1:{port}', "
          "num_processes=2, process_id=0, initialization_timeout=5))").format(port=_free_port())
  result, seconds = _timed([sys.executable, "-c", code])
  assert result.returncode == 1, result.stderr[-3000:]
  assert "JAX already created its devices in this process" in result.stderr
  assert seconds < 60


def test_processes_started_with_different_configurations_stop_before_training(tmp_path):
  processes = _start(_two_processes(
      [sys.executable, "-m", "specrl_jax.rl.app.train_command", *TRAIN_ARGS,
       f"--output.directory={tmp_path / 'run'}", "--init-timeout", "60"],
      extra=lambda process_id: [f"--rl.seed={process_id}"]), tmp_path)
  for process, output in zip(processes, _wait(processes, tmp_path)):
    assert process.returncode == 1, output[-3000:]
    assert "DistributedError: the processes disagree about the run configuration" in output
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_distributed_finds_the_processes_in_the_slurm_environment(tmp_path):
  """`--distributed` as under `srun`: SLURM's variables name the job's processes (here
  two on localhost). Both join, see all 8 devices, and reject a mesh that leaves some
  of them out."""
  port = str(_free_port())
  envs = [_env(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS="2",
               SLURM_PROCID=str(i), SLURM_LOCALID=str(i), JAX_COORDINATOR_PORT=port)
          for i in range(2)]
  command = [sys.executable, "-m", "specrl_jax.rl.app.train_command", *TRAIN_ARGS,
             "--rl.mesh=1,1,1", f"--output.directory={tmp_path / 'run'}", "--distributed",
             "--init-timeout", "60"]
  processes = _start([command, command], tmp_path, envs)
  for i, (process, output) in enumerate(zip(processes, _wait(processes, tmp_path))):
    assert process.returncode == 1, output[-3000:]
    assert f"process {i} of 2: 4 local / 8 global cpu devices" in output
    assert "RLSection.mesh=(1, 1, 1) has 1 devices but the 2 processes have 8" in output


def test_a_process_that_dies_stops_the_others_within_the_heartbeat_timeout(tmp_path):
  survivor, victim = _start(_two_processes(
      [sys.executable, "-m", "specrl_jax.rl.app.train_command", *TRAIN_ARGS,
       f"--output.directory={tmp_path / 'run'}", "--heartbeat-timeout", "3"]), tmp_path)
  try:
    deadline = time.monotonic() + LIMIT
    while "process 1 of 2" not in (tmp_path / "1.log").read_text():
      assert time.monotonic() < deadline and victim.poll() is None, (
          (tmp_path / "1.log").read_text()[-3000:])
      time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor.wait(timeout=120)
    seconds = time.monotonic() - killed
  finally:
    for process in (survivor, victim):
      if process.poll() is None:
        process.kill()
  output = (tmp_path / "0.log").read_text()
  assert survivor.returncode != 0
  assert "stopped sending heartbeats" in output, output[-3000:]
  assert seconds < 60


# ------------------------------------------------------------------ learner and async

@pytest.fixture(scope="module")
def learner_runs(tmp_path_factory):
  """One process of 8 devices in this process, then two of 4 as subprocesses."""
  root = tmp_path_factory.mktemp("learner")
  mesh = make_mesh((2, 2, 2))
  state, history = worker.learner_run(mesh)
  with TrainCheckpointManager(root / "one_process", async_save=False) as manager:
    manager.save(worker.STEPS, state)
  async_history, pushed = worker.async_round_trip(*worker.sub_meshes())
  reference = dict(params=worker.flat(jax.device_get(state.params)), history=history,
                   async_history=async_history, pushed=worker.flat(jax.device_get(pushed)))
  out = root / "two_processes"
  out.mkdir()
  _run_ok(_two_processes([sys.executable, WORKER, "--out", str(out), "--restore",
                          str(root / "one_process")]), root)
  two = dict(results=json.loads((out / "results.json").read_text()),
             **{name: dict(np.load(out / f"{name}.npz")) for name in
                ("params", "pushed", "restored")})
  return dict(root=root, mesh=mesh, reference=reference, two=two)


def _initial_params():
  return worker.flat(jax.device_get(jax.jit(worker.make_params)()))


def test_two_processes_take_the_learner_steps_of_one(learner_runs):
  reference, two = learner_runs["reference"], learner_runs["two"]
  assert len(two["results"]["learner"]) == worker.STEPS
  for ours, theirs in zip(two["results"]["learner"], reference["history"]):
    assert ours.keys() == theirs.keys()
    assert theirs["grad_norm"] > 0 and theirs["loss"] != 0
    for name in ours:
      _close(ours[name], theirs[name])
  initial = _initial_params()
  assert two["params"].keys() == reference["params"].keys()
  for name, value in two["params"].items():
    _close(value, reference["params"][name])
  assert any(not np.allclose(two["params"][n], initial[n]) for n in initial)  # trained


def test_a_checkpoint_saved_by_two_processes_restores_on_one(learner_runs):
  mesh = learner_runs["mesh"]
  target = abstract_train_state(worker.make_params, worker.LEARNER, mesh,
                                rng=jax.random.key(0))
  with TrainCheckpointManager(learner_runs["root"] / "two_processes" / "checkpoint") as manager:
    assert manager.latest_step() == worker.STEPS
    restored = manager.restore(target)
  restored = worker.flat(jax.device_get(restored.params))
  for name, value in restored.items():
    np.testing.assert_array_equal(value, learner_runs["two"]["params"][name])


def test_a_checkpoint_saved_by_one_process_restores_on_two(learner_runs):
  reference, restored = learner_runs["reference"]["params"], learner_runs["two"]["restored"]
  assert restored.keys() == reference.keys()
  for name, value in restored.items():
    np.testing.assert_array_equal(value, reference[name])


def test_weights_and_batches_cross_between_sub_meshes_of_different_processes(learner_runs):
  """Rollout mesh on process 0, train mesh on process 1: the pushed weights, the
  rollout log-probs sent back and the updates match one process's device_put."""
  reference, two = learner_runs["reference"], learner_runs["two"]
  for ours, theirs in zip(two["results"]["async"], reference["async_history"]):
    for name in ours:
      _close(ours[name], theirs[name])
  for name, value in two["pushed"].items():
    _close(value, reference["pushed"][name])


# ------------------------------------------------------------------ sync RL via `specrl train`

@pytest.fixture(scope="module")
def rl_runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("rl")
  outputs = _run_ok(_two_processes(
      [sys.executable, "-m", "specrl_jax.rl.app.train_command", *TRAIN_ARGS,
       f"--output.directory={root / 'two'}"]), root)
  # One process of 8 devices, from the warm start the two processes wrote.
  shutil.copytree(root / "two" / "warm_start", root / "one" / "warm_start")
  config = train_command.parse_argv([*TRAIN_ARGS, f"--output.directory={root / 'one'}"])
  session = train_command.Session(config, log=lambda message: None)
  session.train(session.warm_start())
  return dict(root=root, outputs=outputs, session=session)


def test_two_processes_take_the_sync_rl_steps_of_one(rl_runs):
  root = rl_runs["root"]
  one, two = read_jsonl(root / "one" / "metrics.jsonl"), read_jsonl(root / "two" / "metrics.jsonl")
  assert [r["step"] for r in two] == [0, 1]  # logged once, by process 0
  # Heads are split over "tensor" beside the batch shards; every compared step trains.
  assert all(r["grad_norm"] > 0 for r in one + two)
  for ours, theirs in zip(two, one):
    assert ours.keys() == theirs.keys()
    for name in ours.keys() - set(TIMING):
      _close(ours[name], theirs[name])
  summary, quiet = rl_runs["outputs"]
  assert '"steps": 2' in summary and '"steps"' not in quiet


# Async meshes are sized by rollout_devices and train_devices; rl.mesh gives them only
# a tensor size (here 1).
ASYNC_ARGS = ["--rl.mesh=1,1,1", "--rl.mode=async", "--rl.rollout_devices=4",
              "--rl.train_devices=4", "--rl.max_policy_lag=1"]


@pytest.fixture(scope="module")
def async_rl_runs(rl_runs):
  """Async RL with the rollout mesh on process 0 and the train mesh on process 1 (the
  same device split as one process's devices 0-3 / 4-7), from the sync runs' warm start."""
  root = rl_runs["root"]
  for run in ("async_two", "async_one"):
    shutil.copytree(root / "two" / "warm_start", root / run / "warm_start")
  (root / "async_logs").mkdir()
  _run_ok(_two_processes(
      [sys.executable, "-m", "specrl_jax.rl.app.train_command", *TRAIN_ARGS, *ASYNC_ARGS,
       f"--output.directory={root / 'async_two'}"]), root / "async_logs")
  config = train_command.parse_argv([*TRAIN_ARGS, *ASYNC_ARGS,
                                     f"--output.directory={root / 'async_one'}"])
  session = train_command.Session(config, log=lambda message: None)
  session.train(session.warm_start())
  return dict(root=root, session=session)


def test_async_rl_with_rollouts_and_training_on_different_processes_matches_one(async_rl_runs):
  """Weights pushed from process 1's train mesh to process 0's rollout mesh, and
  trajectories sent back, device to device: the steps one process takes."""
  root = async_rl_runs["root"]
  one = read_jsonl(root / "async_one" / "metrics.jsonl")
  two = read_jsonl(root / "async_two" / "metrics.jsonl")
  assert [r["step"] for r in two] == [0, 1]
  assert [r["policy_lag"] for r in two] == [0, 1]
  # Heads are split over "tensor" beside the batch shards; every compared step trains.
  assert all(r["grad_norm"] > 0 for r in one + two)
  for ours, theirs in zip(two, one):
    assert ours.keys() == theirs.keys()
    for name in ours.keys() - set(TIMING) - ASYNC_TIMING:
      _close(ours[name], theirs[name])
  with TrainCheckpointManager(root / "async_two" / "checkpoints") as manager:
    assert manager.all_steps() == [2]
    restored = manager.restore(async_rl_runs["session"].state)
  ours = worker.flat(jax.device_get(restored.params))
  theirs = worker.flat(jax.device_get(async_rl_runs["session"].state.params))
  for name, value in ours.items():
    _close(value, theirs[name])


# The n-gram drafter needs no warm start of its own, so the sync runs' warm start serves.
REFRESH_ARGS = ["--drafter.kind=ngram", "--drafter.num_draft_tokens=2",
                "--drafter.adaptive=true", "--drafter.refresh_weight=0.5", "--rl.steps=4"]


@pytest.fixture(scope="module")
def async_refresh_run(rl_runs):
  """Two-process async RL (rollouts on process 0, training on process 1) with the
  in-loop controller's table measured at the start and refreshed after every rollout."""
  root = rl_runs["root"]
  shutil.copytree(root / "two" / "warm_start", root / "refresh" / "warm_start")
  (root / "refresh_logs").mkdir()
  _run_ok(_two_processes(
      [sys.executable, "-m", "specrl_jax.rl.app.train_command", *TRAIN_ARGS, *ASYNC_ARGS,
       *REFRESH_ARGS, f"--output.directory={root / 'refresh'}"]), root / "refresh_logs")
  return read_jsonl(root / "refresh" / "metrics.jsonl")


def test_two_processes_refresh_the_table_from_the_rollouts_seconds_on_process_0(
    async_refresh_run):
  """The table lives on process 1's train mesh, the rollout's clock on process 0: the
  refreshed table is the one process 0's logged seconds give (a process refreshing from
  its own clock would give another), and the next rollout chooses with it."""
  steps = async_refresh_run
  assert [r["step"] for r in steps] == [0, 1, 2, 3]
  labels = ("plain", "chain_k1", "chain_k2")
  table = [np.array([r[f"inloop_round_seconds_{x}"] for x in labels]) for r in steps]
  rounds = [np.array([r[f"inloop_rounds_{x}"] for x in labels]) for r in steps]
  fixed = steps[0]["inloop_fixed_seconds"]
  assert all(r["inloop_fixed_seconds"] == fixed for r in steps)
  # max_policy_lag 1: batch 3 chose with the table update 1 left. Batch 1's rounds ran
  # on the rollout mesh's 4 batch shards side by side, each a quarter of them.
  expected = refresh(table[1], fixed, rounds[1] / 4, steps[1]["rollout_seconds"], 0.5)
  np.testing.assert_allclose(table[3], expected, rtol=1e-5)
  ran = rounds[1] > 0
  assert ran.any() and not np.allclose(table[3][ran], table[1][ran], rtol=1e-3)
  np.testing.assert_array_equal(table[3][~ran], table[1][~ran])
  # Batch 0's rollout compiled its program (its seconds time that too): no refresh.
  np.testing.assert_array_equal(table[2], table[0])


def test_the_two_process_rl_checkpoint_restores_on_one_to_the_same_parameters(rl_runs):
  session = rl_runs["session"]
  with TrainCheckpointManager(rl_runs["root"] / "two" / "checkpoints") as manager:
    assert manager.all_steps() == [2]
    restored = manager.restore(session.state)
  ours = worker.flat(jax.device_get(restored.params))
  theirs = worker.flat(jax.device_get(session.state.params))
  for name, value in ours.items():
    _close(value, theirs[name])
