#!/usr/bin/env bash
# The GPU checks of issue 17 on a machine with a CUDA GPU and torch, gpytorch, botorch,
# linear_operator, pytest, hypothesis, pyarrow installed (the package itself from this checkout).
# Usage: bash scripts/gpu_check.sh OUT_DIR STEP...   with STEP among
#   tests      the device-sensitive tests (tests/test_devices.py: CPU and CUDA; tests/test_triton_fly.py:
#              the fused Triton kernels compiled for the GPU, one tile shape per key)
#   bench      benchmarks/gpu.py (ceilings, engine rates, TF32, float32 vs float64, n = 1e7, baselines)
#   flights    benchmarks/compare.py --device cuda on flights: gpfalkon auto_fit, SGPR, SVGP (GPU_FLIGHTS_METHODS:
#              compare.py's --methods, e.g. "sgpr svgp falkon-auto-rel-12 falkon-auto-12 falkon-auto")
#   sums       benchmarks/gpu_flights_final_fit.py sums: CG over a stored float32 K_nM on session 52's saved flights
#              configuration, the row sums whole and flushed, against float64 data
#   suite      the whole test suite (pytest-xdist when installed)
#   dist       the README's distributed example under torchrun (2 processes, the default process group:
#              gloo for CPU tensors, NCCL for CUDA ones) and tests/test_distributed.py
# Each step runs under its own time limit (seconds, environment GPU_CHECK_<STEP>_S) and writes its log
# to OUT_DIR; a failed step does not stop the next. Data: GPFALKON_DATA (flights.npz).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_check.sh OUT_DIR STEP...}
shift
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
t0=$(date +%s)
echo "== $(date -u) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
$py -c "import torch, gpytorch, botorch, linear_operator as lo; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), '| gpytorch', gpytorch.__version__, '| botorch', botorch.__version__, '| linear_operator', lo.__version__)"
for step in "$@"; do
  s=$(date +%s)
  case $step in
    tests)
      GPFALKON_TRITON_AUTOTUNE=0 timeout "${GPU_CHECK_TESTS_S:-240}" $py -m pytest -q -p no:cacheprovider -rfEs \
        tests/test_devices.py tests/test_triton_fly.py 2>&1 | tee "$out/tests.log" | tail -25 ;;
    bench)
      timeout "${GPU_CHECK_BENCH_S:-330}" $py benchmarks/gpu.py --out "$out/gpu" ${GPU_BENCH_ARGS:-} \
        > "$out/bench.log" 2>&1; tail -5 "$out/bench.log" ;;
    flights)
      timeout "${GPU_CHECK_FLIGHTS_S:-300}" $py benchmarks/compare.py --device cuda --datasets flights \
        --methods ${GPU_FLIGHTS_METHODS:-falkon-auto sgpr svgp} --flights-budget "${GPU_FLIGHTS_BUDGET:-60}" --out "$out/compare-gpu-flights.md" \
        > "$out/flights.log" 2>&1; tail -8 "$out/flights.log" ;;
    sums)
      timeout "${GPU_CHECK_SUMS_S:-120}" $py benchmarks/gpu_flights_final_fit.py sums \
        --final benchmarks/results/gpu-h200-s52-final.pt --out "$out" --no-auto > "$out/sums.log" 2>&1
      tail -4 "$out/sums.log" ;;
    suite)
      xd=""; $py -c "import xdist" 2>/dev/null && xd="-n ${GPU_CHECK_WORKERS:-8}"
      timeout "${GPU_CHECK_SUITE_S:-300}" $py -m pytest -q -p no:cacheprovider -rfE $xd tests \
        2>&1 | tee "$out/suite.log" | tail -25 ;;
    dist)
      { timeout "${GPU_CHECK_DIST_S:-150}" $py -m torch.distributed.run --nproc-per-node 2 examples/distributed_fit.py \
          --check --tol 1e-12 --iterations 1000 && \
        timeout "${GPU_CHECK_DIST_S:-150}" $py -m pytest -q -p no:cacheprovider -rfE tests/test_distributed.py; } \
        2>&1 | tee "$out/dist.log" | tail -25 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "== step $step: $(( $(date +%s) - s )) s (total $(( $(date +%s) - t0 )) s)"
done
