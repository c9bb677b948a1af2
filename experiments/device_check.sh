#!/usr/bin/env bash
# The checks that need an accelerator, sized for 9 minutes on one GPU. Each stage runs
# under its own `timeout`, so a slow or failing stage still leaves the others' results,
# and prints its name, exit status and seconds as it ends. Stage output goes to
# $RESULTS/<stage>.log; a stage whose script prints JSON also leaves <stage>.json; the
# stage list with statuses is $RESULTS/device_check.json. RESULTS defaults to
# results/<device>/ (e.g. results/h200/; results/cpu-dry-run/ for a dry run).
#
#   bash experiments/device_check.sh                 # on the GPU machine
#   DRY_RUN=1 bash experiments/device_check.sh       # the stages on CPU at toy sizes (~5 min;
#                                                    # its limits allow for a loaded CPU)
#   STAGES="lowered tests" bash experiments/device_check.sh   # only the stages named
#
# Stages (limits in seconds, 520 in all; a start-up of about 20 s leaves the 9 minutes):
#   launch_count   70  kernels per decode step / speculative round from the compiled HLO
#                      (bench-160m shape; reference and Pallas attention; compiles only)
#   decode_1.7b   100  qwen3-1.7b bf16 random weights, batch 1/8/64/256, prompt 256,
#                      512 new tokens: tokens/s and fraction of the HBM roofline
#   decode_0.6b    45  qwen3-0.6b, batch 1/8/64/256
#   cmdbuf_1.7b    30  qwen3-1.7b batch 1 with the decode loop in CUDA graphs (below)
#   lowered        70  the programs tests/test_lowering.py lowers on CPU, compiled and run
#                      here with the Pallas kernels (qwen3-0.6b shapes, 4 layers): plain,
#                      chain, tree, adaptive, compaction; greedy tokens == the reference's
#   spec           85  speculative vs plain on the medium pair (trained here, within the
#                      limit): batch 1/8/64, chains k=1,3, trees, adaptive k
#   tests         120  the fast suite on the GPU backend, each result named as it comes
#                      (the kernel, lowering and engine-exactness files first)
#
# XLA command buffers (CUDA graphs): by default XLA captures fusions and library calls
# into graphs but not control flow; the cmdbuf stage adds WHILE and CONDITIONAL so one
# decode loop iteration (admit's cond included) can be one graph launch:
#   XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL
#              --xla_gpu_graph_min_graph_size=1"
# (and --xla_gpu_enable_command_buffer= with an empty list turns them off, to compare).
set -u
python=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "${DRY_RUN:-0}" = 1 ]; then
  export JAX_PLATFORMS=cpu SPECRL_ARTIFACTS=${SPECRL_ARTIFACTS:-$(mktemp -d)}
  device=cpu-dry-run
else
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 \
           | sed -E 's/^NVIDIA //; s/[^A-Za-z0-9]+/-/g' | tr 'A-Z' 'a-z')
  device=${device:-unknown-device}
fi
results=${RESULTS:-results/$device}
mkdir -p "$results"
summary="$results/device_check.json"
echo "[" > "$summary"

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log, keep its JSON, report
  local name=$1 limit=$2; shift 2
  if [ -n "${STAGES:-}" ] && [[ " $STAGES " != *" $name "* ]]; then return 0; fi
  local start=$SECONDS log="$results/$name.log"
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local status=$?
  # Scripts print one JSON document on stdout, progress on stderr (both in the log).
  "$python" - "$log" "$results/$name.json" <<'KEEP_JSON' 2>/dev/null
import json, sys
text = open(sys.argv[1]).read()
start = text.find("{\n")
if start >= 0:
  try:
    document, _ = json.JSONDecoder().raw_decode(text[start:])
    json.dump(document, open(sys.argv[2], "w"), indent=1)
  except ValueError:
    pass
KEEP_JSON
  local seconds=$((SECONDS - start))
  echo "$name: exit $status in ${seconds}s$([ $status = 124 ] && echo ' (cut at its limit)')"
  tail -n 3 "$log" | sed "s/^/  $name| /"
  printf '  {"stage": "%s", "exit": %d, "seconds": %d, "limit": %d},\n' \
    "$name" "$status" "$seconds" "$limit" >> "$summary"
}

{ command -v nvidia-smi > /dev/null && nvidia-smi -L 2>&1; $python -c 'import jax, flax, sys; print(sys.version); print(jax.__version__, flax.__version__, jax.devices())'; } \
  > "$results/env.txt" 2>&1
cat "$results/env.txt"

if [ "${DRY_RUN:-0}" = 1 ]; then
  launch="--tiny --batch 2 --prompt-length 16 --new-tokens 8 --attention reference"
  decode_large="--preset bench-160m --batches 1 --prompt-length 16 --new-tokens 8 --repeats 1"
  decode_small=$decode_large
  cmdbuf=$decode_large
  spec="--size small --train-steps 2 2 --batches 1 --ks 1 --samples 1 --no-ngram --no-trees
        --adaptive-warmup 1"
  tests=(tests/test_kernels.py -k "resolve_per_backend or dispatcher")
  lowered="--tiny --batch 2 --new-tokens 4 --page-size 8 --programs plain"
else
  launch="--preset bench-160m --batch 8 --attention reference auto"
  decode_large="--preset qwen3-1.7b --batches 1 8 64 256 --prompt-length 256 --new-tokens 512 --repeats 2"
  decode_small="--preset qwen3-0.6b --batches 1 8 64 256 --prompt-length 256 --new-tokens 512 --repeats 2"
  cmdbuf="--preset qwen3-1.7b --batches 1 --prompt-length 256 --new-tokens 512 --repeats 2"
  spec="--size medium --train-steps 120 100 --batches 1 8 64 --ks 1 3 --samples 2 --no-ngram
        --adaptive-warmup 3"
  # The kernels and the engine's exactness first: a stage cut at its limit keeps them.
  lowered="--preset qwen3-0.6b --layers 4 --batch 8 --new-tokens 32 --page-size 64"
  tests=(-n 8 -m "not slow" tests/test_kernels.py tests/test_lowering.py tests/test_sampler.py
         tests/test_speculative.py tests --ignore=tests/test_colabs.py)
fi
# --mesh D,F,T and --dtype: plain decoding on one chip at the presets' bf16.
decode_flags="--skip-hf --dtype bfloat16 --mesh 1,1,1"
limit() {  # limit DEVICE_SECONDS DRY_RUN_SECONDS (0: skip the stage in a dry run)
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "$2"; else echo "$1"; fi
}

stage launch_count "$(limit 70 240)" $python experiments/launch_count.py --layers 1 2 $launch
stage decode_1.7b "$(limit 100 180)" $python experiments/bench_decode.py $decode_flags $decode_large
if [ "${DRY_RUN:-0}" != 1 ]; then  # the same script as decode_1.7b: nothing new to dry-run
  stage decode_0.6b 45 $python experiments/bench_decode.py $decode_flags $decode_small
  stage cmdbuf_1.7b 30 env XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
    $python experiments/bench_decode.py $decode_flags $cmdbuf
fi
stage lowered "$(limit 70 180)" $python experiments/lowered_programs.py $lowered
stage spec "$(limit 85 360)" $python experiments/bench_spec.py $spec
# Float32 matmuls: GPUs default to TF32, which the logit-parity tolerances do not allow.
# -rA -v: every result by name as it comes, so a stage cut at its limit keeps the names.
stage tests "$(limit 120 120)" env JAX_DEFAULT_MATMUL_PRECISION=float32 $python -m pytest -rA -v --tb=short \
  -p no:cacheprovider "${tests[@]}"
[ -f "$results/tests.log" ] && grep -E "(FAILED|ERROR)" "$results/tests.log" | head -n 20

echo '  {"stage": "end"}' >> "$summary"
echo "]" >> "$summary"
echo "results in $results/"
