#!/usr/bin/env bash
# A short check of the tree on one GPU (~3 min on an H100), where benchmarks/gpu_session.sh
# is the full measurement: install (wheels of what the image lacks in .whl/, docs/gpu.md),
# the GPU tests, cuDNN against dense attention, two 1B training runs, and the CPU fast suite
# on the GPU machine's JAX. Everything lands under $OUT (log.txt, env.txt, runs.jsonl, ...).
#
#   OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu_check}
CLUSTER=${CLUSTER:-h200-1}  # the preset gpu_train.py's planner predictions are for
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.90
T0=$SECONDS
say() { echo "== $((SECONDS - T0)) s: $*" | tee -a "$OUT/log.txt"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$OUT/env.txt" 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/env.txt" 2>&1 || echo "pip -e failed" >>"$OUT/env.txt"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$OUT/env.txt" 2>&1
python3 -c "import jax, flax, optax, shardlib; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" >>"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
(JAX_PLATFORMS=cpu nice -n 19 timeout -k 5 330 python3 -m pytest -n 10 -m "not slow" -p no:cacheprovider -o addopts="-q --dist loadfile" >"$OUT/pytest_cpu.txt" 2>&1) &
CPU=$!
say "GPU tests"
JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest tests/tools/test_gpu.py -o addopts="" -q -p no:cacheprovider -rA >>"$OUT/log.txt" 2>&1; say "exit $?"
say "attention: cuDNN vs dense"
timeout 90 python3 benchmarks/gpu_attention.py --json "$OUT/attention.json" --seqs 2048,8192 >>"$OUT/log.txt" 2>&1; say "exit $?"
say "train 1B: dense and cuDNN attention, selective remat"
timeout 150 python3 benchmarks/gpu_train.py --jsonl "$OUT/runs.jsonl" --cluster "$CLUSTER" --only 1b-selective,1b-cudnn-none >>"$OUT/log.txt" 2>&1; say "exit $?"
wait $CPU; say "CPU suite exit $?: $(tail -1 "$OUT/pytest_cpu.txt")"
python3 benchmarks/gpu_train.py --jsonl "$OUT/runs.jsonl" --table >>"$OUT/log.txt" 2>&1
grep -E "passed|failed|error" "$OUT/log.txt" | tail -5
say done
