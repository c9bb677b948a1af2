"""The persistent compilation cache `specrl train` and the demo turn on: where it goes,
that programs land in it and are loaded from it, that a cache the user set wins, and
that nothing is left configured afterwards. (The speed-up itself is measured in
experiments/bench_compile_cache.py, not timed here.)"""

import os

import jax
import jax.numpy as jnp
import pytest

from specrl_jax import compile_cache
from specrl_jax.rl.app import train_command


def test_auto_puts_the_cache_beside_the_output_directory_and_off_turns_it_off(tmp_path):
  out = str(tmp_path / "runs" / "demo")
  assert compile_cache.cache_directory("auto", out) == str(
      tmp_path / "runs" / "jax_compilation_cache")
  assert compile_cache.cache_directory("off", out) is None
  assert compile_cache.cache_directory(str(tmp_path / "c"), out) == str(tmp_path / "c")
  config = train_command.parse_argv(["--preset=tiny", "--output.compilation_cache=off"])
  assert config.output.compilation_cache == "off"


def _hits():
  events = []
  jax.monitoring.register_event_listener(
      lambda name, **kwargs: events.append(name) if name == "/jax/compilation_cache/cache_hits"
      else None)
  return events


def test_programs_are_saved_to_the_cache_and_loaded_from_it(tmp_path, monkeypatch):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")  # conftest's "no cache"
  monkeypatch.setattr(compile_cache, "MIN_COMPILE_SECONDS", 0.0)  # however fast it compiles
  folder = str(tmp_path / "cache")
  hits = _hits()

  def program(x):
    for _ in range(8):
      x = jnp.sin(x @ x.T) + jnp.cos(x)
    return x

  x = jnp.ones((64, 64))
  with compile_cache.persistent_cache(folder) as used:
    assert used == folder
    jax.jit(program)(x).block_until_ready()
    assert os.listdir(folder)  # written
    jax.clear_caches()  # as a new process would start: nothing compiled in memory
    jax.jit(program)(x).block_until_ready()
  assert hits  # loaded from the folder, not compiled again
  assert not jax.config.jax_compilation_cache_dir  # nothing left configured


def test_a_cache_set_by_the_user_wins(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "theirs"))
  with compile_cache.persistent_cache(str(tmp_path / "ours")) as used:
    jax.jit(lambda x: x + 1)(1.0)
  assert not (tmp_path / "ours").exists()
  assert used is None or used == str(tmp_path / "theirs")
