#!/usr/bin/env bash
# One device call: the GPU suite, then the --quick GPU benchmarks, each under its own time cap so a
# hang in one still leaves the others' results. Logs and results JSON go to $OUT (README, section GPU).
#   tools/gpu_check.sh            # on the GPU machine (its python3 has torch and triton)
set -o pipefail
export PYTHONUNBUFFERED=1 SILVERREC_QUIET=1
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
TESTS_S=${TESTS_S:-240}; BENCH_S=${BENCH_S:-90}
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
    exact) bench exact_topk python3 benchmarks/exact_topk.py --device cuda --quick ;;
    ann) bench ann python3 benchmarks/ann.py --device cuda --quick ;;
    filter) bench filter python3 benchmarks/filter.py --device cuda --quick ;;
    generative) bench generative python3 benchmarks/generative.py --device cuda --quick ;;
  esac
done
cp benchmarks/results/*_cuda*.json "$OUT/" 2>/dev/null
ls -la "$OUT"
