"""Reward functions that misbehave, for tests/test_faults.py. A module of its own that
imports nothing heavy: worker processes import it to unpickle these functions."""

import os
import sys
import time


def length(response, targets):
  """A well-behaved reward: the response's length."""
  del targets
  return float(len(response))


def never_returns(response, targets):
  del response, targets
  while True:
    time.sleep(1)


def exits(response, targets):
  del response, targets
  sys.exit(3)


def dies(response, targets):
  del response, targets
  os._exit(7)


def hogs_memory(response, targets):
  del response, targets
  hoard = bytearray(1 << 30)  # 1 GiB, over the test's limit
  return float(len(hoard))


# Dataset rewards (prompt, completion, answer, **fields), for tests/test_hostile_data.py.

def dataset_dies_on_bad(prompt, completion, answer, **fields):
  del prompt, answer, fields
  if completion == "bad":
    os._exit(7)
  return None if completion == "none" else 1.0


def dataset_hangs_on_bad(prompt, completion, answer, **fields):
  del prompt, answer, fields
  while completion == "bad":
    time.sleep(1)
  return None if completion == "none" else 1.0
