#!/usr/bin/env bash
# One call on a fresh GPU machine (no network): install without dependencies, run the GPU tests,
# the decode-shape benchmark, and compute-sanitizer on a small case (last: it is the slowest and
# least likely to change). Logs and JSON go to OUTDIR.
#   usage: scripts/gpu_check.sh OUTDIR [pytest -k expression]
set -uo pipefail
out="${1:?usage: scripts/gpu_check.sh OUTDIR [pytest -k expression]}"
select="${2:-}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export MOONCAKE_EP_CACHE_DIR="${MOONCAKE_EP_CACHE_DIR:-/tmp/mooncake_ep_cache}"
status=0

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1

echo "== pytest -m gpu"
args=(-m gpu -q -p no:cacheprovider --timeout 300 --tb=short -rf --durations=10)
[ -n "$select" ] && args+=(-k "$select")
python3 -m pytest "${args[@]}" tests 2>&1 | tee "$out/pytest_gpu.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ -z "$select" ]; then
  echo "== bench: decode shape (8 ranks x 16 SMs, T=128, H=7168, top-8 of 256, fp8 dispatch, bf16 combine)"
  python3 -m mooncake_ep bench --ranks 8 --num-sms 16 --tokens 128 --hidden 7168 --topk 8 --experts 256 \
    --json "$out/bench_decode.json" 2>&1 | tee "$out/bench_decode.log" || status=1
  echo "== bench: one rank with the whole GPU, and a tiny payload (fixed costs)"
  python3 -m mooncake_ep bench --ranks 1 --tokens 128 --hidden 7168 --topk 8 --experts 32 --iters 100 \
    --json "$out/bench_one_rank.json" 2>&1 | tail -6 || status=1
  python3 -m mooncake_ep bench --ranks 8 --num-sms 16 --tokens 8 --hidden 7168 --topk 8 --experts 256 \
    --iters 100 --json "$out/bench_tiny.json" 2>&1 | tail -6 || status=1
fi
if [ -z "$select" ] && [ -z "${SKIP_SANITIZER:-}" ]; then
  echo "== compute-sanitizer (memcheck, racecheck) on a small case"
  for tool in memcheck racecheck; do
    # racecheck looks at shared memory; memcheck at every global access.
    timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_low_latency.py \
      -k "R2-E8-H1152 or R4-E32-H1024-K4-T32-fp8-async" >"$out/sanitizer_$tool.log" 2>&1
    rc=$?
    echo "$tool rc=$rc: $(grep -E 'ERROR SUMMARY|passed|failed' "$out/sanitizer_$tool.log" | tr '\n' ' ')"
    [ "$rc" -eq 0 ] || status=1
  done
fi
exit $status
