#!/usr/bin/env bash
# One device call: the GPU suite, then the --quick GPU benchmarks, each under its own time cap so a
# hang in one still leaves the others' results. Logs and results JSON go to $OUT (README, section GPU).
#   tools/gpu_check.sh            # on the GPU machine (its python3 has torch and triton)
#   BENCHES="generative exact" QUICK= TESTS_S=120 BENCH_S=90 tools/gpu_check.sh   # full runs of two
set -o pipefail
export PYTHONUNBUFFERED=1 SILVERREC_QUIET=1
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
TESTS_S=${TESTS_S:-240}; BENCH_S=${BENCH_S:-90}; QUICK=${QUICK---quick}  # QUICK= : the full benchmarks
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  uptime
} 2>&1 | tee "$OUT/machine.txt"
echo "== make test-gpu (cap ${TESTS_S}s)"
timeout -s INT "$TESTS_S" make test-gpu PY=python3 2>&1 | tee "$OUT/test_gpu.log"
echo "test-gpu rc=$?" | tee -a "$OUT/test_gpu.log"
bench() {  # name, command...
  local name=$1; shift
  echo "== $name (cap ${BENCH_S}s): $*"
  timeout -s INT "$BENCH_S" "$@" 2>&1 | tee -a "$OUT/bench.log"
  echo "$name rc=$?" | tee -a "$OUT/bench.log"
}
for b in ${BENCHES:-exact ann filter generative}; do
  case $b in
    exact) bench exact_topk python3 benchmarks/exact_topk.py --device cuda $QUICK ;;
    ann) bench ann python3 benchmarks/ann.py --device cuda $QUICK ;;
    filter) bench filter python3 benchmarks/filter.py --device cuda $QUICK ;;
    generative) bench generative python3 benchmarks/generative.py --device cuda $QUICK ;;
    profile) bench profile python3 benchmarks/profile_cuda.py $QUICK ;;
  esac
done
find benchmarks/results -name "*_cuda*.json" -newer "$OUT/machine.txt" -exec cp {} "$OUT/" \;  # this run's only
ls -la "$OUT"
