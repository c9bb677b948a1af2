"""Compile time of `specrl train` with the demo's configuration, a first run against
a second in a fresh process with the persistent compilation cache the first one filled
(``specrl_jax.compile_cache``; goal: the second compiles at least 3x faster).

Each run is its own process in its own output directory under one parent, so the
second shares only the cache (its warm start is redone, not loaded). Compile seconds
are JAX's own backend-compile durations (a cache hit counts its load time), summed
over every program of the run; tracing and lowering, which the cache does not save,
are reported apart. Step counts are cut (--rl-steps, --sft-steps) because they do not
change which programs compile, only how often each runs.

  python experiments/bench_compile_cache.py [--rl-steps 2] [--sft-steps 5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

EVENTS = {"/jax/core/compile/backend_compile_duration": "compile_seconds",
          "/jax/core/compile/jaxpr_trace_duration": "trace_seconds",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_seconds"}


def child(argv: list[str]) -> int:
  """One `specrl train` run with JAX's compile-time events summed; prints them."""
  import jax
  totals = dict.fromkeys(EVENTS.values(), 0.0)
  counts = {"programs_compiled_or_loaded": 0, "cache_hits": 0}

  def on_duration(name, seconds, **kwargs):
    if name in EVENTS:
      totals[EVENTS[name]] += seconds
      counts["programs_compiled_or_loaded"] += name.endswith("backend_compile_duration")

  def on_event(name, **kwargs):
    counts["cache_hits"] += name == "/jax/compilation_cache/cache_hits"

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)
  from specrl_jax.rl.app import train_command
  started = time.perf_counter()
  code = train_command.main(argv)
  print("RESULT " + json.dumps(dict(totals, **counts, exit_code=code,
                                    wall_seconds=time.perf_counter() - started)))
  return code


def run(parent: str, name: str, overrides: list[str]) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.setdefault("JAX_PLATFORMS", "cpu")
  argv = ["--preset=demo", f"--output.directory={os.path.join(parent, name)}",
          "--output.progress=false", "--output.plots=false", "--output.tensorboard=false",
          *overrides]
  out = subprocess.run([sys.executable, __file__, "--child", *argv], env=env,
                       capture_output=True, text=True, check=True)
  line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
  return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rl-steps", type=int, default=2)
  parser.add_argument("--sft-steps", type=int, default=5)
  parser.add_argument("--keep", default=None, help="parent folder to keep (default: a temp one)")
  args = parser.parse_args(argv)
  parent = args.keep or tempfile.mkdtemp(prefix="bench_compile_cache_")
  overrides = [f"--rl.steps={args.rl_steps}", f"--warm_start.sft_steps={args.sft_steps}",
               f"--warm_start.distill_steps={args.sft_steps}"]
  first = run(parent, "first", overrides)
  second = run(parent, "second", overrides)
  cache = os.path.join(parent, "jax_compilation_cache")
  report = {"config": "demo preset, " + " ".join(overrides), "first": first, "second": second,
            "compile_speedup": first["compile_seconds"] / max(second["compile_seconds"], 1e-9),
            "wall_speedup": first["wall_seconds"] / second["wall_seconds"],
            "cache_entries": len(os.listdir(cache)) if os.path.isdir(cache) else 0,
            "cache_megabytes": sum(os.path.getsize(os.path.join(cache, f))
                                   for f in os.listdir(cache)) / 2 ** 20
            if os.path.isdir(cache) else 0.0}
  print(json.dumps(report, indent=2))
  return 0


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    raise SystemExit(child(sys.argv[2:]))
  raise SystemExit(main())
