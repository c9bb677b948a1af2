#!/usr/bin/env bash
# One pass of the checks that need an accelerator, sized for a short lease on one GPU:
# plain decode throughput (bench-160m), speculative vs plain decoding on a trained pair
# (SIZE=medium, the 38M pair, by default; SIZE=large, ~0.8B, where a drafter's steps
# are cheap next to the target's; trained there: cached pairs are not carried), then the sampler and speculative
# test files on that backend. Each stage has its own time limit, so a slow or failing
# stage still leaves the others' results. Logs and JSON go to $OUT (default
# results/device).
#
#   [SIZE=large] bash experiments/device_check.sh      # on the accelerator machine
set -u
out=${OUT:-results/device}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python=${PYTHON:-python3}
stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log, report the status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.out" 2> "$out/$name.err"
  echo "$name: exit $? in $((SECONDS - start)) s"
}

{ nvidia-smi -L 2>&1; $python -c 'import jax, flax, sys; print(sys.version); print(jax.__version__, flax.__version__, jax.devices())'; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
stage bench_decode 110 $python experiments/bench_decode.py --skip-hf --batches 1 8 32 --repeats 3
stage bench_spec 270 $python experiments/bench_spec.py --size "${SIZE:-medium}" --batches 1 8 \
  --ks 1 3 5 --samples 3 --no-ngram --no-adaptive
# Tests on the accelerator's backend at float32 matmul precision (GPUs default to TF32,
# which the logit-parity tolerances do not allow for). -v names each result as it
# comes: a stage cut at its limit prints no summary (on an H200 these two files took
# longer than 150 s, mostly compiling).
stage tests 150 env JAX_PLATFORMS= JAX_DEFAULT_MATMUL_PRECISION=float32 $python -m pytest \
  -v --tb=short -n 8 -m "not slow" -p no:cacheprovider tests/test_sampler.py \
  tests/test_speculative.py
grep -E "FAILED|ERROR" "$out/tests.out" | head -n 20
tail -n 3 "$out/tests.out"
$python - "$out" <<'SUMMARY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name, keys in (("bench_decode", ("batch", "temperature", "specrl_jax_tokens_per_second")),
                   ("bench_spec", ("batch", "config", "acceptance_length", "speedup_vs_plain"))):
  try:
    report = json.loads((out / f"{name}.out").read_text())
  except (OSError, ValueError) as error:
    print(f"{name}: no JSON ({error})")
    continue
  for row in report.get("results", report.get("rows", [])):
    print(name, *(row.get(key) for key in keys))
SUMMARY
