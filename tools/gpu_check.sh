#!/usr/bin/env bash
# One device call: the GPU suite, then the GPU benchmarks, each under its own time cap and all under one
# budget (TOTAL_S), so that a hang in one still leaves the others' results and the whole call ends well
# inside the device's 10-minute command limit. Logs and results JSON go to $OUT (docs/gpu.md).
#   tools/gpu_check.sh                 # on the GPU machine (its python3 has torch and triton)
#   tools/gpu_check.sh --dry-run       # anywhere: the plan, each step's command checked (--help), the CPU-safe step run
#   BENCHES="exact ann" QUICK= tools/gpu_check.sh   # full runs of two
#   BENCHES=recommend tools/gpu_check.sh   # the recommendation model (examples/byo) on the GPU vs the CPU
# Steps (BENCHES, default "filter replay recommend ann", in that order: what the budget leaves out is last):
#   filter     filtered search 1M x 96 (--quick: 200k), selectivity 0.01%-50%, k 100 / 4096 vs masked topk(q @ x.T)
#   ann        the IVF index 1M x 128 vs topk(q @ x.T) and Faiss GPU, k 100 / 4096, nprobe 8-128
#   replay     a varied request stream (batch 1-64, histories 1-200, random filters) through the shape buckets:
#              replay rate, p50 / p99 (benchmarks/cuda_launches.py --replay --device cuda)
#   recommend  examples/byo trained 15 s, published, recommend on CUDA vs the CPU at batch 1 / 16 / 64
#   exact, generative, profile: as before
# EXT=0 skips building the operator library in place (`make test-gpu` builds its own under build/gpu; the
# benchmarks import the in-place one).
set -o pipefail
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
export PYTHONUNBUFFERED=1 SILVERREC_QUIET=1
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-510}; TESTS_S=${TESTS_S:-150}; BENCH_S=${BENCH_S:-75}; QUICK=${QUICK---quick}  # QUICK= : full runs
PY=${PY:-python3}
START=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }
cap() {  # min(step cap, budget left); 0 when under 20 s are left
  local c=$1 l; l=$(left); [ "$l" -lt 20 ] && { echo 0; return; }; [ "$c" -lt "$l" ] && echo "$c" || echo "$l"
}
step() {  # name, cap seconds, log file, command...
  local name=$1 want=$2 log=$3 c; shift 3; c=$(cap "$want")
  if [ "$DRY" = 1 ]; then
    echo "== $name (cap ${want}s): $*" | tee -a "$OUT/plan.txt"; return 0
  fi
  if [ "$c" = 0 ]; then echo "== $name skipped: the budget (${TOTAL_S}s) is spent" | tee -a "$OUT/$log"; return 0; fi
  echo "== $name (cap ${c}s, $(left)s of the budget left): $*" | tee -a "$OUT/$log"
  timeout -s INT "$c" "$@" 2>&1 | tee -a "$OUT/$log"
  echo "$name rc=$?" | tee -a "$OUT/$log"
}
{
  if [ "$DRY" = 1 ]; then echo "dry run on $(hostname): no GPU needed"; else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  date -u +%Y-%m-%dT%H:%M:%SZ; uptime
} 2>&1 | tee "$OUT/machine.txt"
: > "$OUT/plan.txt"
REPO="import sys; sys.path.insert(0, 'tools'); import repo_import; repo_import.install()"
EXT_PID=
if [ "${EXT:-1}" = 1 ]; then  # the operator library for this machine's torch (every op's schema and CPU kernel),
  # built in the background on the CPU cores while the GPU suite runs; waited for before the first benchmark
  if [ "$DRY" = 1 ]; then echo "== ext_build (background, cap 240s): $PY setup.py -q build_ext --inplace" | tee -a "$OUT/plan.txt"
  else (MAX_JOBS=12 timeout 240 $PY setup.py -q build_ext --inplace > "$OUT/ext_build.log" 2>&1; echo "ext build rc=$?" >> "$OUT/ext_build.log") &
    EXT_PID=$!; fi
fi
step test_gpu "$TESTS_S" test_gpu.log make test-gpu PY=$PY
if [ -n "$EXT_PID" ]; then
  wait "$EXT_PID"; tail -1 "$OUT/ext_build.log"
  $PY -c "$REPO; from silverrec.kernels import library; print('operators:', library.load(), library.host().isa())" | tee -a "$OUT/ext_build.log"
fi
BYO="$REPO; sys.path.insert(0, 'examples/byo'); import runpy"
for b in ${BENCHES:-filter replay recommend ann}; do
  case $b in
    exact) step exact_topk "$BENCH_S" bench.log $PY benchmarks/exact_topk.py --device cuda $QUICK ;;
    ann) step ann "$BENCH_S" bench.log $PY benchmarks/ann.py --device cuda $QUICK ;;
    filter) step filter "$BENCH_S" bench.log $PY benchmarks/filter.py --device cuda $QUICK ;;
    generative) step generative "$BENCH_S" bench.log $PY benchmarks/generative.py --device cuda $QUICK ;;
    profile) step profile "$BENCH_S" bench.log $PY benchmarks/profile_cuda.py $QUICK ;;
    replay) step replay 45 bench.log $PY benchmarks/cuda_launches.py --replay --device cuda --calls 200 --json ;;
    recommend)  # examples/byo (plain PyTorch towers, no torchrec) trained, published and served here
      step byo_train 45 bench.log $PY -c "$BYO; sys.argv = ['train.py', '--seconds', '15']; runpy.run_path('examples/byo/train.py', run_name='__main__')"
      step byo_publish 45 bench.log $PY -c "$BYO; from silverrec.cli import main; sys.exit(main(['publish', '--config', 'examples/byo/publish.toml', '--out', '/tmp/byo_snap']))"
      step recommend "$BENCH_S" bench.log $PY benchmarks/recommend_device.py --snapshot /tmp/byo_snap --logs examples/byo/out/logs/interactions.parquet --device cuda
      step replay_byo 45 bench.log $PY benchmarks/cuda_launches.py --replay --device cuda --calls 200 --snapshot /tmp/byo_snap --json ;;
    *) echo "unknown bench $b"; exit 2 ;;
  esac
done
if [ "$DRY" = 1 ]; then  # each benchmark's arguments parse; the replay stream runs on the CPU (the device path forced)
  total=$(grep -v background "$OUT/plan.txt" | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^[(]cap/) {gsub(/[^0-9]/, "", $(i + 1)); s += $(i + 1)}} END {print s}')
  echo "steps' caps sum to ${total}s; the budget TOTAL_S=${TOTAL_S}s stops starting steps under 20 s left" | tee -a "$OUT/plan.txt"
  bash -n "$0" && echo "syntax ok"
  for f in benchmarks/exact_topk.py benchmarks/ann.py benchmarks/filter.py benchmarks/generative.py benchmarks/recommend_device.py benchmarks/cuda_launches.py; do
    $PY "$f" --help > /dev/null 2>&1 && echo "$f --help ok" || { echo "$f --help FAILED"; exit 1; }
  done
  timeout 900 $PY benchmarks/cuda_launches.py --replay --calls "${DRY_CALLS:-40}" --no-save --json 2>&1 | tail -4 | tee "$OUT/replay_dry.log"
  exit 0
fi
find benchmarks/results \( -name "*_cuda*.json" -o -name "recommend_cuda.json" \) -newer "$OUT/machine.txt" -exec cp {} "$OUT/" \;  # this run's only
ls -la "$OUT"
