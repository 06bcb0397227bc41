#!/usr/bin/env bash
# One device call: the GPU suite, then the --quick GPU benchmarks, each under its own time cap so a
# hang in one still leaves the others' results. Logs and results JSON go to $OUT (docs/gpu.md).
#   tools/gpu_check.sh            # on the GPU machine (its python3 has torch and triton)
#   BENCHES="generative exact" QUICK= TESTS_S=120 BENCH_S=90 tools/gpu_check.sh   # full runs of two
#   BENCHES=recommend tools/gpu_check.sh   # the recommendation model (examples/byo) on the GPU vs the CPU
# EXT=0 skips building the operator library first (`make test-gpu` builds its own under build/gpu).
set -o pipefail
export PYTHONUNBUFFERED=1 SILVERREC_QUIET=1
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
TESTS_S=${TESTS_S:-240}; BENCH_S=${BENCH_S:-90}; QUICK=${QUICK---quick}  # QUICK= : the full benchmarks
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  uptime
} 2>&1 | tee "$OUT/machine.txt"
if [ "${EXT:-1}" = 1 ]; then  # the operator library for this machine's torch (every op's schema and CPU kernel)
  echo "== operator library (cap 180s)"
  MAX_JOBS=16 timeout 180 python3 setup.py -q build_ext --inplace > "$OUT/ext_build.log" 2>&1
  echo "ext build rc=$?"; python3 -c "import sys; sys.path.insert(0, 'tools'); import repo_import; repo_import.install(); from silverrec.kernels import library; print('operators:', library.load(), library.host().isa())"
fi
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
    recommend)  # examples/byo (plain PyTorch towers, no torchrec) trained, published and served here
      BYO="import sys; sys.path.insert(0, 'tools'); import repo_import; repo_import.install(); sys.path.insert(0, 'examples/byo'); import runpy"
      bench byo_train python3 -c "$BYO; sys.argv = ['train.py', '--seconds', '20']; runpy.run_path('examples/byo/train.py', run_name='__main__')"
      bench byo_publish python3 -c "$BYO; from silverrec.cli import main; sys.exit(main(['publish', '--config', 'examples/byo/publish.toml', '--out', '/tmp/byo_snap']))"
      [ -f /tmp/byo_snap/manifest.json ] || { sed '/^\[overarch\]/,$d' examples/byo/publish.toml > examples/byo/publish_no_arch.toml
        bench byo_publish_no_overarch python3 -c "$BYO; from silverrec.cli import main; sys.exit(main(['publish', '--config', 'examples/byo/publish_no_arch.toml', '--out', '/tmp/byo_snap']))"; }
      bench recommend python3 benchmarks/recommend_device.py --snapshot /tmp/byo_snap --logs examples/byo/out/logs/interactions.parquet --device cuda ;;
  esac
done
find benchmarks/results \( -name "*_cuda*.json" -o -name "recommend_cuda.json" \) -newer "$OUT/machine.txt" -exec cp {} "$OUT/" \;  # this run's only
ls -la "$OUT"
