"""Host reward functions run where they cannot hang, crash or exhaust the trainer.

``call_with_timeout`` runs one call in a daemon thread of this process: a call past
its timeout is abandoned (Python cannot stop a thread; it runs on, harmless, until it
returns or the process exits) and reported. ``RewardWorkers`` runs calls in separate
worker processes for untrusted code: a call past its timeout, or a worker that exits
(``os._exit``, a crash, the kernel's OOM killer), kills only that worker, which is
restarted for the next batch; an optional memory limit (RLIMIT_AS) bounds what one
call may allocate.

Either way a failure is a ``SampleError`` naming the sample and what went wrong.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any

from specrl_jax.rl.tasks.reward_values import RewardValueError, reward_value

# How long a fresh worker may take to import and unpickle the reward function.
STARTUP_SECONDS = 120.0
_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "reward_worker_main.py")


class SampleError(Exception):
  """Scoring sample ``index`` failed: ``problem`` says how ("raised KeyError: 'x'",
  "did not return within 2.0 s", ...); ``cause`` is the exception, when there is one."""

  def __init__(self, index: int, problem: str, cause: BaseException | None = None):
    super().__init__(f"sample {index}: {problem}")
    self.index, self.problem, self.cause = index, problem, cause


def call_with_timeout(fn: Callable[..., Any], args: tuple, timeout: float | None,
                      index: int) -> float:
  """``fn(*args)`` as a float (``reward_values``), or SampleError if it raises anything
  (SystemExit included), returns no finite real number, or has not returned after
  ``timeout`` seconds (None: no limit)."""
  box: dict[str, Any] = {}

  def run():
    try:
      box["value"] = reward_value(fn(*args))
    except BaseException as error:  # noqa: B036 (SystemExit must not end the trainer)
      box["error"] = error

  if timeout is None:
    run()
  else:
    thread = threading.Thread(target=run, daemon=True, name=f"specrl-reward-{index}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
      raise SampleError(index, f"did not return within {timeout} s (the call was "
                               "abandoned; use worker processes to have it killed)")
  if "error" in box:
    error = box["error"]
    if isinstance(error, RewardValueError):
      raise SampleError(index, str(error), error)
    raise SampleError(index, f"raised {type(error).__name__}: {error}", error)
  return box["value"]


def call_all_with_timeout(fn: Callable[..., Any], samples: Sequence[tuple], timeout: float | None,
                          threads: int) -> list[float]:
  """``[call_with_timeout(fn, sample, ...) for sample in samples]`` computed by up to
  ``threads`` calls at once (each as ``call_with_timeout``: its own daemon thread and deadline); the
  first failure, by sample order, is raised as SampleError."""
  if threads <= 1 or len(samples) <= 1:
    return [call_with_timeout(fn, sample, timeout, i) for i, sample in enumerate(samples)]
  results: list[Any] = [None] * len(samples)
  gate = threading.Semaphore(threads)

  def run(index):
    try:
      results[index] = call_with_timeout(fn, samples[index], timeout, index)
    except SampleError as error:
      results[index] = error
    finally:
      gate.release()

  runners = []
  for index in range(len(samples)):
    gate.acquire()
    runner = threading.Thread(target=run, args=(index,), daemon=True)
    runner.start()
    runners.append(runner)
  for runner in runners:
    runner.join()
  for value in results:
    if isinstance(value, SampleError):
      raise value
  return results


def _stop(process: subprocess.Popen | None) -> int | None:
  if process is None:
    return None
  if process.poll() is None:
    process.kill()
  return process.wait()


class RewardWorkers:
  """``num_workers`` processes scoring samples with ``fn`` (which must pickle: a
  module-level function or a picklable callable object).

  failure_score: None, a call that times out or kills its worker fails the batch
  (SampleError); a number, that sample scores it instead and the failure is kept for
  ``take_failures`` (so one hostile completion, e.g. a CAS expression that never
  finishes, costs its own reward and not the run). Exceptions the function raises
  and values it returns that are no reward fail the batch either way: those are
  bugs of the function, not of one sample.
  """

  def __init__(self, fn: Callable[..., Any], *, num_workers: int, timeout: float | None,
               memory_limit_bytes: int | None = None, failure_score: float | None = None):
    try:
      self._payload = pickle.dumps(fn)
    except Exception as error:
      raise TypeError(f"reward function {fn!r} cannot be sent to a worker process "
                      f"({type(error).__name__}: {error}): give a module-level function "
                      "or a picklable callable object.") from error
    self.timeout = timeout
    self.failure_score = failure_score
    self._failures: list[SampleError] = []
    self._memory_limit = memory_limit_bytes
    self._processes: list[subprocess.Popen | None] = [None] * num_workers
    self._connections: list[Connection | None] = [None] * num_workers
    self._ready = [False] * num_workers
    self._lock = threading.Lock()
    weakref.finalize(self, lambda processes: [_stop(p) for p in processes], self._processes)

  def _start(self, worker: int) -> Connection:
    ours, theirs = Pipe()
    process = subprocess.Popen([sys.executable, _WORKER_SCRIPT, str(theirs.fileno())],
                               pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    theirs.close()
    ours.send((list(sys.path), self._payload, self._memory_limit))
    self._processes[worker], self._connections[worker] = process, ours
    self._ready[worker] = False
    return ours

  def _kill(self, worker: int) -> int | None:
    code = _stop(self._processes[worker])
    if self._connections[worker] is not None:
      self._connections[worker].close()
    self._processes[worker] = self._connections[worker] = None
    return code

  def _alive(self, worker: int) -> bool:
    process = self._processes[worker]
    return process is not None and process.poll() is None

  def _running(self, worker: int, index: int) -> Connection:
    """The worker's connection once it has loaded the function, (re)starting it
    first if it is not running."""
    if not self._alive(worker):
      self._kill(worker)
      self._start(worker)
    connection = self._connections[worker]
    if self._ready[worker]:
      return connection
    try:
      if not connection.poll(STARTUP_SECONDS):
        raise EOFError
      connection.recv()  # "ready": the function is loaded
    except (EOFError, OSError):
      code = self._kill(worker)
      raise SampleError(index, f"its worker process did not load the reward function "
                               f"(exit code {code}; its stderr says why)") from None
    self._ready[worker] = True
    return connection

  def score(self, samples: Sequence[tuple[str, Any]]) -> list[float]:
    """The rewards of ``samples`` ((text, targets) each), or SampleError for the
    first that fails (the other workers' calls in flight are killed with it)."""
    with self._lock:
      return self._score(samples)

  def _score(self, samples):
    rewards: list[float | None] = [None] * len(samples)
    todo = list(range(len(samples)))[::-1]
    for worker in range(min(len(self._processes), len(samples))):
      if not self._alive(worker):  # start them all at once: each takes seconds to load
        self._kill(worker)
        self._start(worker)
    busy: dict[int, tuple[int, float]] = {}  # worker -> (sample, deadline)
    try:
      while todo or busy:
        for worker in range(len(self._processes)):
          if worker not in busy and todo:
            index = todo.pop()
            self._running(worker, index).send(samples[index])
            limit = float("inf") if self.timeout is None else self.timeout
            busy[worker] = (index, time.monotonic() + limit)
        deadline = min(d for _, d in busy.values())
        remaining = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
        ready = wait([self._connections[w] for w in busy], timeout=remaining)
        for worker in [w for w in busy if self._connections[w] in ready]:
          index, _ = busy.pop(worker)
          try:
            kind, value = self._connections[worker].recv()
          except (EOFError, OSError):
            code = self._kill(worker)
            rewards[index] = self._failed(SampleError(
                index, f"killed its worker process (exit code {code}; e.g. os._exit, a "
                       "crash, or over its memory limit)"))
            continue
          if kind == "error":
            raise SampleError(index, f"raised {value} (in a worker process)")
          if kind == "refused":
            raise SampleError(index, f"{value} (in a worker process)")
          rewards[index] = value
        now = time.monotonic()
        for worker, (index, deadline) in list(busy.items()):
          if now >= deadline:
            busy.pop(worker)
            self._kill(worker)
            rewards[index] = self._failed(SampleError(
                index, f"did not return within {self.timeout} s (its worker process was "
                       "killed)"))
    except BaseException:
      for worker in busy:  # their answers would arrive as the next batch's
        self._kill(worker)
      raise
    return rewards

  def _failed(self, error: SampleError) -> float:
    if self.failure_score is None:
      raise error
    self._failures.append(error)
    return self.failure_score

  def take_failures(self) -> list[SampleError]:
    """The samples scored ``failure_score`` since the last call, in the order they failed."""
    with self._lock:
      failures, self._failures = self._failures, []
    return failures

  def close(self) -> None:
    for worker in range(len(self._processes)):
      self._kill(worker)
