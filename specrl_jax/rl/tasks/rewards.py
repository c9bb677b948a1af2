"""Reward functions over text, and how ``--reward=`` names one.

A reward is ``reward(prompt: str, completion: str, answer, **fields) -> float``:
the dataset row's prompt (its chat messages, for a conversational prompt column),
the policy's decoded completion (up to its stop token),
the row's answer, and the row's other columns as keyword arguments (a function
without ``**fields`` receives only the columns it names).

    --reward=exact_match                 a built-in (see BUILTIN)
    --reward=my_rewards:score            a function of an importable module
    --reward=path/to/rewards.py:score    a function of a Python file

The built-in rewards take an answer as it is in the dataset: text or a number, or a
list of them, any of which is accepted (aliases: ``["7", "seven"]``). A null answer
is refused (a row without its answer is reported before training, ``row_checks``),
never compared as the text "None". A module or file that fails to import (a syntax
error, a missing package, ``sys.exit`` at import) is refused naming its file and line.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

from specrl_jax.config import ConfigError

TextReward = Callable[..., float]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def final_answer(completion: str) -> str:
  """The completion's final answer: the last <answer>...</answer>, else the last
  \\boxed{...}, else the text after the last '####', else the last non-empty line."""
  for pattern in (_ANSWER_TAG, _BOXED):
    found = pattern.findall(completion)
    if found:
      return found[-1].strip()
  if "####" in completion:
    return completion.rsplit("####", 1)[1].strip()
  lines = [line.strip() for line in completion.splitlines() if line.strip()]
  return lines[-1] if lines else ""


def _normalize(text: str) -> str:
  return " ".join(text.strip().rstrip(".").split()).casefold()


def accepted_answers(answer: Any, reward: str) -> list[str]:
  """The texts ``answer`` accepts: itself, or each element of a list or tuple."""
  values = list(answer) if isinstance(answer, (list, tuple)) else [answer]
  if not values:
    raise ValueError(f"the {reward} reward got an empty list of accepted answers")
  for value in values:
    if value is None or not isinstance(value, (str, int, float)):
      raise TypeError(f"the {reward} reward got the answer {type(value).__name__} {value!r}; "
                      "expected text, a number, or a list of them (the accepted answers)")
  return [str(v) if not isinstance(v, float) or not v.is_integer() else str(int(v))
          for v in values]


def exact_match(prompt: str, completion: str, answer: Any, **fields) -> float:
  """1.0 when the completion's ``final_answer`` equals the answer, or one of a list of
  answers (whitespace, case and a final period aside; 7.0 reads as 7), else 0.0."""
  del prompt, fields
  found = _normalize(final_answer(completion))
  return float(any(found == _normalize(a) for a in accepted_answers(answer, "exact_match")))


def format_reward(prompt: str, completion: str, answer: Any, **fields) -> float:
  """1.0 when the completion is "<think>...</think> <answer>...</answer>" (the
  format reward of DeepSeek-R1-style training), else 0.0."""
  del prompt, answer, fields
  return float(_FORMAT.match(completion) is not None)


def math_verify(prompt: str, completion: str, answer: Any, **fields) -> float:
  """1.0 when ``math-verify`` finds the completion's answer (LaTeX, \\boxed{} or a
  plain expression) mathematically equal to the answer, else 0.0. Its own signal
  timeouts are off (they work only on the main thread); the caller's per-call
  timeout bounds a call instead."""
  del prompt, fields
  try:
    import math_verify as mv
  except ImportError:
    raise ImportError("the math_verify reward needs the math-verify package: "
                      "pip install math-verify") from None
  logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" notes
  answers = accepted_answers(answer, "math_verify")
  predicted = mv.parse(completion, parsing_timeout=None)
  if not predicted:
    return 0.0
  for text in answers:
    gold = mv.parse(text, parsing_timeout=None)
    if gold and mv.verify(gold, predicted, timeout_seconds=None):
      return 1.0
  return 0.0


BUILTIN: dict[str, TextReward] = {
    "exact_match": exact_match,
    "format": format_reward,
    "math_verify": math_verify,
}


def _load_module(name: str):
  if name.endswith(".py") or os.sep in name:
    if not os.path.isfile(name):
      raise ConfigError(f"--reward: {name!r} is not a Python file")
    module_name = "specrl_user_reward_" + re.sub(r"\W", "_", os.path.abspath(name))
    if module_name in sys.modules:
      return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
      spec.loader.exec_module(module)
    except BaseException as error:  # noqa: B036 (sys.exit at import must not end the run)
      del sys.modules[module_name]
      raise ConfigError(f"--reward: {name} {_import_failure(error, os.path.abspath(name))}"
                        ) from None
    return module
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as error:
    if error.name and name.split(".")[0] == error.name.split(".")[0]:
      raise ConfigError(f"--reward: module {name!r} cannot be imported ({error}); give an "
                        "importable module or a path to a .py file") from None
    raise ConfigError(f"--reward: module {name} {_import_failure(error, None)}") from None
  except BaseException as error:  # noqa: B036
    raise ConfigError(f"--reward: module {name} {_import_failure(error, None)}") from None


def _import_failure(error: BaseException, path: str | None) -> str:
  """"failed to import at FILE line N: what happened" for an error raised while a
  reward module ran its top level (the deepest frame in ``path``, else the last)."""
  if isinstance(error, SyntaxError) and error.filename:
    where = f"{error.filename} line {error.lineno}"
  else:
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if path is None or os.path.abspath(f.filename) == path]
    frame = (mine or frames or [None])[-1]
    where = f"{frame.filename} line {frame.lineno}" if frame else "its top level"
  if isinstance(error, SystemExit):
    what = f"called sys.exit({error.code!r}) while being imported"
  elif isinstance(error, ModuleNotFoundError):
    what = f"imports {error.name!r}, which is not installed (pip install it)"
  else:
    what = f"raised {type(error).__name__}: {error}"
  return f"failed to import at {where}: it {what}; fix the module and run again"


def resolve_reward(spec: str) -> tuple[TextReward, str]:
  """(function, its display name) for a ``--reward`` value (module docstring)."""
  if spec in BUILTIN:
    return BUILTIN[spec], spec
  if ":" not in spec:
    raise ConfigError(f"--reward={spec!r} is invalid: expected one of {sorted(BUILTIN)}, "
                      "module:function or path/to/file.py:function")
  module_name, function_name = spec.rsplit(":", 1)
  module = _load_module(module_name)
  fn = getattr(module, function_name, None)
  if not callable(fn):
    raise ConfigError(f"--reward={spec!r}: {module_name} has no function {function_name!r}")
  return fn, spec


def keyword_filter(fn: TextReward) -> Callable[[dict[str, Any]], dict[str, Any]]:
  """``fields -> the fields fn accepts`` (all of them when it takes ``**fields``)."""
  try:
    parameters = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return lambda fields: fields
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return lambda fields: fields
  names = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}
  return lambda fields: {k: v for k, v in fields.items() if k in names}
