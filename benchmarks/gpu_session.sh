#!/usr/bin/env bash
# One lease of a single-GPU machine: install the project as it is, measure, test.
#
#   OUT=/tmp/gpu_out bash benchmarks/gpu_session.sh [budget_seconds]
#   SMOKE=1 OUT=/tmp/smoke bash benchmarks/gpu_session.sh     # the script itself, on a CPU
#   SECTIONS="matmul dense1b" OUT=... bash benchmarks/gpu_session.sh  # named sections only
#
# The default sections are the fast-by-default ones (the defaults, packed documents, FP8,
# the chunked loss, activation bytes, the GPU tests); the first lease's (matmul, dense1b,
# attention, offload, precision, dense7b8, noflags, seq8192) stay runnable by name.
# Wheels of what the machine's image lacks (grain, tensorboardX and their own needs) travel
# in .whl/ (docs/gpu.md says which and how). Sections run in order of importance, each in its
# own process under a timeout; none starts after the budget is spent. The CPU test suite
# runs niced beside them (the GPU sections need a few of the 16 cores). Everything lands
# under $OUT: env.txt, log.txt, matmul.json, runs.jsonl, attention.json, pytest_*.txt.
set -u
OUT=${OUT:-/tmp/gpu_out}
BUDGET=${1:-470}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.90
T0=$SECONDS
say() { echo "== $((SECONDS - T0)) s: $*" | tee -a "$OUT/log.txt"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
section() {  # section NAME TIMEOUT COMMAND...: run it if the budget allows, log its output
  local name=$1 limit=$2
  shift 2
  if [ "$(left)" -lt 20 ]; then say "$name: skipped (budget spent)"; return; fi
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  say "$name (up to $limit s)"
  timeout -k 5 "$limit" "$@" >>"$OUT/log.txt" 2>&1
  say "$name: exit $?"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 --version
} >"$OUT/env.txt" 2>&1
if [ -z "${SMOKE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$OUT/env.txt" 2>&1
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/env.txt" 2>&1 ||
    echo "pip install -e . failed: importing from the checkout" >>"$OUT/env.txt"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python3 -c "import jax, flax, optax, orbax.checkpoint, shardlib; print('jax', jax.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" >>"$OUT/env.txt" 2>&1
shardlib --help >/dev/null 2>>"$OUT/env.txt" && echo "shardlib CLI: ok" >>"$OUT/env.txt"
cat "$OUT/env.txt"

SMALL=()
QUICK=()
ATT=()
SUITE=(python3 -m pytest -n 8 -p no:cacheprovider -o addopts="-q --dist loadfile")
if [ -n "${SMOKE:-}" ]; then  # tiny shapes, one CPU test file: checks the script, not a GPU
  SMALL=(--set model=llama-small,seq=128,steps=3)
  QUICK=(--quick)
  ATT=(--seqs 128 --batch 1)
  SUITE=(python3 -m pytest -p no:cacheprovider -o addopts="-q" tests/core/test_mesh.py)
fi

# the CPU suite, as CI runs it, on this machine's software (niced: the GPU work comes first)
(JAX_PLATFORMS=cpu nice -n 19 timeout -k 5 $((BUDGET + 60)) "${SUITE[@]}" \
  >"$OUT/pytest_cpu.txt" 2>&1) &
CPU_SUITE=$!

CLUSTER=${CLUSTER:-h200-1}  # the preset the planner's predictions beside each run are for
R=(python3 benchmarks/gpu_train.py --jsonl "$OUT/runs.jsonl" --cluster "$CLUSTER" "${SMALL[@]}")
G=(env JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false)
run_section() {  # one named section of a lease; SECTIONS lists the ones to run, in order
  case $1 in
    gputests) section "GPU tests" 150 "${G[@]}" \
      python3 -m pytest tests/tools/test_gpu.py -o addopts="" -q -p no:cacheprovider -rA ;;
    defaults) section "train: the defaults (attention_impl=auto), 1B and 7B width" 150 \
      "${R[@]}" --only 1b-auto-none,7b8-auto-none ;;
    defaults_b8) section "train: the defaults, batch 8" 150 \
      "${R[@]}" --only 1b-auto-none-b8,7b8-auto-none-b8 ;;
    packed) section "attention: packed documents, cuDNN vs dense" 60 \
      python3 benchmarks/gpu_attention.py --packed --json "$OUT/packed.json" "${ATT[@]}" ;;
    fp8) section "train: FP8 against bf16, 7B width, 200 steps" 220 "${R[@]}" --only "$FP8_RUNS" ;;
    loss) section "train: chunked loss" 90 "${R[@]}" --only "$LOSS_RUNS" ;;
    activations) section "activation bytes: compiled on the GPU" 90 \
      python3 benchmarks/activation_bytes.py --gpu "${QUICK[@]}" ;;
    # the first lease's sections (docs/gpu.md)
    matmul) section matmul 90 \
      python3 benchmarks/matmul.py --cluster "$CLUSTER" --json "$OUT/matmul.json" "${QUICK[@]}" ;;
    dense1b) section "train: 1B, dense attention, remat none/selective/full" 200 \
      "${R[@]}" --only 1b-none,1b-selective,1b-full ;;
    attention) section "attention: cuDNN vs dense" 120 \
      python3 benchmarks/gpu_attention.py --json "$OUT/attention.json" "${ATT[@]}" ;;
    offload) section "train: cuDNN attention, host offload" 200 \
      "${R[@]}" --only 1b-cudnn-none,1b-cudnn-full,1b-full-offload-opt,1b-offload-residuals ;;
    precision) section "fp32 precision: GPU against CPU" 60 \
      "${G[@]}" python3 benchmarks/gpu_precision.py default highest ;;
    dense7b8) section "train: 7B width, 8 layers" 200 \
      "${R[@]}" --only 7b8-none,7b8-selective,7b8-full ;;
    noflags) section "train: without shardlib's XLA flags" 90 \
      "${R[@]}" --only 1b-selective --no-gpu-flags --tag=-noflags ;;
    seq8192) section "train: seq 8192" 120 "${R[@]}" --only 1b-cudnn-seq8192,1b-dense-seq8192 ;;
    *) say "unknown section $1" ;;
  esac
}
FP8_RUNS=${FP8_RUNS:-7b8-fp8-200,7b8-bf16-200}
LOSS_RUNS=${LOSS_RUNS:-1b-auto-none-chunked-loss}
SECTIONS=${SECTIONS:-gputests defaults fp8 packed loss defaults_b8 activations}
for name in $SECTIONS; do run_section "$name"; done

say "waiting for the CPU suite"
wait $CPU_SUITE
say "CPU suite: exit $? ($(tail -1 "$OUT/pytest_cpu.txt"))"
python3 benchmarks/gpu_train.py --jsonl "$OUT/runs.jsonl" --cluster "$CLUSTER" --table
grep -E "passed|failed" "$OUT/log.txt" | tail -3
say "done"
