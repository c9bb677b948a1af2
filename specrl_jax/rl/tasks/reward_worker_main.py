"""The worker process of ``reward_workers``: scores samples with a pickled reward
function, one request at a time.

Run as a script (``python reward_worker_main.py FD``), never imported as part of the
package, so that a worker loads only the reward function's own module and not JAX.
FD is its end of a socket pair; the first message is ``(sys.path, pickled function,
memory limit in bytes or None)``, then each request ``(text, targets)`` is answered
``("ok", reward)``, ``("error", "Type: message")`` (it raised) or ``("refused", what
it returned)`` (no finite real number: ``reward_values``).
"""

import importlib.util
import os
import pickle
import resource
import sys
from multiprocessing.connection import Connection


def _address_space_bytes() -> int:
  """This process's virtual memory size (Linux; 0 where /proc does not say)."""
  try:
    with open("/proc/self/status") as status:
      for line in status:
        if line.startswith("VmSize:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def _reward_values():
  """reward_values.py beside this script, loaded without importing the package."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_values.py")
  spec = importlib.util.spec_from_file_location("specrl_reward_values", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main() -> None:
  values = _reward_values()
  connection = Connection(int(sys.argv[1]))
  path, payload, memory_limit = connection.recv()
  sys.path[:] = path
  fn = pickle.loads(payload)
  if memory_limit is not None:
    # On top of what the function's own imports hold: the limit is on what a call
    # may allocate, not on how heavy its module is to load.
    limit = _address_space_bytes() + memory_limit
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  connection.send(("ready", os.getpid()))
  while True:
    try:
      text, targets = connection.recv()
    except EOFError:
      return
    try:
      answer = ("ok", values.reward_value(fn(text, targets)))
    except BaseException as error:  # SystemExit too: the parent decides what it means
      # By name: a dataset scorer checks with the package's copy of reward_values.
      if type(error).__name__ == values.RewardValueError.__name__:
        answer = ("refused", str(error))
      else:
        answer = ("error", f"{type(error).__name__}: {error}")
    connection.send(answer)


if __name__ == "__main__":
  main()
