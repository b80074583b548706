#!/usr/bin/env bash
# One call on a fresh GPU machine (no network): install without dependencies, then the chosen
# stages, each with its own time limit; logs and JSON go to OUTDIR. Exits non-zero if any failed.
#   usage: scripts/gpu_check.sh OUTDIR [STAGE ...]
# PACK_TO=FILE.tar.gz (outside OUTDIR) also packs OUTDIR into one archive at the end (for callers that
# can fetch only a few files back). BUDGET_S=N: the whole call's seconds; each step's limit is cut to
# what is left of them (less PACK_RESERVE_S, 20 by default), and a step with nothing left is skipped
# and fails, so the pack still runs before a caller's own limit kills the call (a step past its limit
# gets SIGTERM, then SIGKILL 10 s later). An unknown stage, or a BUDGET_S or PACK_RESERVE_S that is
# not a whole number of seconds, is refused (exit 2) before anything runs.
# Stages (default: tests bench warmup sanitizer):
#   tests      pytest -m gpu, one process per file (PYTEST_FILES, PYTEST_K with -k, PYTEST_FILE_LIMIT_S); a
#              test that skips fails, unless it needs more GPUs (MOONCAKE_EP_REQUIRE_GPU);
#              with MOONCAKE_EP_TEST_MACROS=EP_X=1,... (tests/_experiment.py) an experiment's kernel variant
#              runs them, and the sanitizer's cases too
#   bench      the decode-shape benchmark (with the torch baseline), the same with combine reading the
#              expert outputs from the workspace (the protocol of ranks in other processes), one rank
#              alone, a tiny payload
#   sweep      the decode shape's sweep over tokens per rank (1..1024: the largest that fits 8 ranks on
#              one GPU; one input set, for memory) with the plot; the prefill shape's (T = 512..4096) on
#              2 ranks x 64 SMs, the most that fit (the low-latency workspace reserves T*E rows of H per rank:
#              30 GB at T = 4096, and the caller's expert outputs 15 GB more)
#   warmup     cold NVRTC compile of every variant, then Buffer construction with the cache warm
#   trace      per-block timestamps of every rank's kernels (scripts/trace_phases.py)
#   ncu        Nsight Compute on one rank's kernels (a rank alone: ncu serialises kernels)
#   hbm        the device memory bytes each decode phase moves, all 8 ranks together: Nsight Compute
#              profiling each graph replay as one workload (its kernels run together), beside an elementwise
#              pass and a fill of known bytes (scripts/trace_phases.py --profiler-range)
#   host       host time per call for torch, cupy and JAX, eager and graph / jit (scripts/profile_host.py)
#   fault      time a survivor loses when a rank stops, against timeout_us (scripts/fault_latency.py)
#   sanitizer  compute-sanitizer memcheck and racecheck in every rank's process, on the cases of 2 and 4
#              ranks of tests/test_gpu_ipc.py (sync, async and hook), and on the one-rank in-process cases
#   ab         kernel variants (AB_VARIANTS, extra NVRTC macros) benchmarked side by side on the decode shape
#   inner      the decode benchmark with and without the events inside a copy of each phase's graph
#              (--inner-events), alternated twice: the events around the other graphs should not move
#   scales     the decode benchmark with out= fp8 results, the scales in DeepEP's layout (the results')
#              and row-major, alternated twice
#   modes      the decode benchmark in the other modes: async and hook (graphs), sync eager (no graph),
#              without the graph's own nodes around the fork/join (--graph-ends none), and with 32
#              hardware queues instead of the driver's default 8
#   routing    the decode benchmark with skewed routing (zipf, k_hot), with the torch baseline
#   parities   the decode benchmark with every graph on one workspace half (the tables so far) and with
#              input set k on half k mod 2, as a model's consecutive calls, alternated twice
#   repeat     the async and hook test cases, 20 times over, traced, with every rank's flags dumped on a
#              failure (scripts/repeat_case.py), with 8 and with 32 hardware work queues
set -uo pipefail
out="${1:?usage: scripts/gpu_check.sh OUTDIR [STAGE ...]}"
shift
stages="${*:-tests bench warmup sanitizer}"
known_stages=" tests bench sweep warmup trace ncu hbm host fault sanitizer ab inner scales modes routing parities repeat "
for stage in $stages; do
  if [[ "$known_stages" != *" $stage "* ]]; then  # a typo ran nothing, and passed
    echo "gpu_check.sh: unknown stage '$stage' (stages:$known_stages)" >&2
    exit 2
  fi
done
for name in BUDGET_S PACK_RESERVE_S; do
  if [ -n "${!name:-}" ] && ! [[ "${!name}" =~ ^[0-9]+$ ]]; then  # 1800.0 or 10m: every stage was skipped, exit 0
    echo "gpu_check.sh: $name must be a whole number of seconds, got '${!name}'" >&2
    exit 2
  fi
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# On this machine a GPU test that skips (no CUDA torch, JAX or cupy) hides a broken install: it fails
# instead, except one that needs more GPUs than there are (tests/conftest.py). Every stage's pytest:
# the sanitizer's in-process cases passed with every test skipped when the tests stage did not run.
export MOONCAKE_EP_REQUIRE_GPU=1
export MOONCAKE_EP_CACHE_DIR="${MOONCAKE_EP_CACHE_DIR:-/tmp/mooncake_ep_cache}"
status=0
has() { [[ " $stages " == *" $1 "* ]]; }
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to OUTDIR/NAME.log, echo its tail;
  # exit codes in OK_RCS (default 0) pass
  local name=$1 limit=$2
  shift 2
  if [ -n "${BUDGET_S:-}" ]; then
    local left=$((10#$BUDGET_S - SECONDS - 10#${PACK_RESERVE_S:-20}))  # 10#: 0900 is not octal
    if [ "$left" -le 0 ]; then
      echo "== $name skipped: BUDGET_S=$BUDGET_S spent"
      status=1
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name: $*"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  # sed: a log cut mid-line by the limit still ends in a newline, so the rc line starts one of its own
  tail -n "${TAIL:-12}" "$out/$name.log" | sed -e '$a\'
  echo "== $name rc=$rc"
  [[ " ${OK_RCS:-0} " == *" $rc "* ]] || status=1
  last_rc=$rc
}
pack() {
  if [ -n "${PACK_TO:-}" ]; then
    tar czf "$PACK_TO" -C "$out" . || status=1
  fi
}

TAIL=20 step install 300 python3 -m pip install -q --no-deps --no-build-isolation -e .
if [ "$status" -ne 0 ]; then  # nothing else can run; the caller still gets install.log in the pack
  pack
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
bench=(python3 -m mooncake_ep bench)
decode=(--ranks 8 --num-sms 16 --tokens 128 --hidden 7168 --topk 8 --experts 256)

if has warmup; then
  # Cold: a fresh cache; the compile count and times are in the JSON. Warm: construction reads it.
  step warmup_cold 300 python3 -m mooncake_ep warmup --hidden 7168 --topk 8 \
    --experts 256 --ranks 8 --json "$out/warmup_cold.json"
  step buffer_construction 120 python3 scripts/time_construction.py --json "$out/construction.json"
fi
if has bench; then
  step bench_decode 300 "${bench[@]}" "${decode[@]}" --json "$out/bench_decode.json"
  step bench_workspace_reads 200 "${bench[@]}" "${decode[@]}" --peer-reads workspace --iters 100 --no-baseline \
    --json "$out/bench_workspace_reads.json"
  step bench_one_rank 120 "${bench[@]}" --ranks 1 --tokens 128 --hidden 7168 --topk 8 --experts 32 --iters 100 \
    --no-baseline --json "$out/bench_one_rank.json"
  step bench_tiny 120 "${bench[@]}" --ranks 8 --num-sms 16 --tokens 8 --hidden 7168 --topk 8 --experts 256 \
    --iters 100 --no-baseline --json "$out/bench_tiny.json"
fi
if has ab; then
  # Kernel variants side by side (scripts/ab_kernels.py): AB_VARIANTS is a space-separated list of
  # NAME:MACRO=VALUE,... (repeat the first at the end to see the drift), on the decode shape.
  read -ra ab_variants <<<"${AB_VARIANTS:-base:}"
  ab_flags=()
  for variant in "${ab_variants[@]}"; do ab_flags+=(--variant "$variant"); done
  TAIL=$((${#ab_variants[@]} + 2)) step ab 540 python3 scripts/ab_kernels.py "${ab_flags[@]}" --json "$out/ab.json" -- \
    "${decode[@]}" --iters "${AB_ITERS:-100}" --no-baseline
fi
if has inner; then
  for round in 1 2; do
    for flag in inner-events no-inner-events; do
      step "bench_${flag//-/_}_$round" 150 "${bench[@]}" "${decode[@]}" "--$flag" --iters 200 --no-baseline \
        --json "$out/bench_${flag//-/_}_$round.json"
    done
  done
fi
if has scales; then
  for round in 1 2; do
    for layout in swapped row-major; do
      step "bench_scales_${layout//-/_}_$round" 150 "${bench[@]}" "${decode[@]}" --fp8-scales "$layout" --iters 200 \
        --no-baseline --json "$out/bench_scales_${layout//-/_}_$round.json"
    done
  done
fi
if has modes; then
  for mode in async hook; do
    step "bench_$mode" 200 "${bench[@]}" "${decode[@]}" --mode "$mode" --iters 100 --no-baseline \
      --json "$out/bench_$mode.json"
  done
  step bench_eager 200 "${bench[@]}" "${decode[@]}" --no-graph --iters 100 --no-baseline --json "$out/bench_eager.json"
  # Every rank's launch a root and a leaf of the graph (the benchmark's graphs before --graph-ends).
  step bench_graph_ends_none 200 "${bench[@]}" "${decode[@]}" --graph-ends none --iters 100 --no-baseline \
    --json "$out/bench_graph_ends_none.json"
  # 32 hardware queues against the driver's default 8 (bench_decode): 32 cost 8-9 us more a phase on call 7.
  CUDA_DEVICE_MAX_CONNECTIONS=32 step bench_32_queues 200 "${bench[@]}" "${decode[@]}" --iters 100 --no-baseline \
    --json "$out/bench_32_queues.json"
fi
if has routing; then
  # Skewed routing at the decode shape, with the torch baseline: zipf over the experts (exponent
  # 1.2), and k_hot (half the tokens to the first 8 experts, which rank 0 owns). The floor counts
  # the same bytes; the busiest rank's share is the report's load.
  step bench_zipf 300 "${bench[@]}" "${decode[@]}" --routing zipf --iters 100 --json "$out/bench_zipf.json"
  step bench_k_hot 300 "${bench[@]}" "${decode[@]}" --routing k_hot --iters 100 --json "$out/bench_k_hot.json"
fi
if has parities; then
  # A dispatch restaging into the rows its last replay left in L2 (one half) against alternating halves.
  for round in 1 2; do
    for parities in one alternate; do
      step "bench_parities_${parities}_$round" 200 "${bench[@]}" "${decode[@]}" --parities "$parities" --iters 100 \
        --no-baseline --json "$out/bench_parities_${parities}_$round.json"
    done
  done
fi
if has repeat; then
  # With the driver's default 8 hardware work queues, then with 32 (CUDA_DEVICE_MAX_CONNECTIONS):
  # streams beyond the count share a queue, where one rank's waiting kernel can hold back another
  # rank's work (see LocalGroup._make_streams). REPEAT_QUEUES picks the counts.
  for queues in ${REPEAT_QUEUES:-8 32}; do
    CUDA_DEVICE_MAX_CONNECTIONS=$queues TAIL=30 step "repeat_${queues}_queues" 300 python3 scripts/repeat_case.py \
      --cases async,hook --repeat "${REPEAT:-20}" --trace --json "$out/repeat_$queues.json" \
      --stall-log "$out/stalls_$queues.log"
  done
fi
if has sweep; then
  step bench_sweep 240 "${bench[@]}" "${decode[@]}" --iters 50 --warmup 5 --input-sets 1 --plot "$out/sweep.png" \
    --sweep-tokens 1,2,4,8,16,32,64,128,256,512,1024 --json "$out/bench_sweep.json"
  step bench_prefill 300 "${bench[@]}" --ranks 2 --num-sms 64 --tokens 4096 --hidden 7168 --topk 8 --experts 256 \
    --iters 20 --warmup 3 --input-sets 1 --sweep-tokens 512,1024,2048,4096 --plot "$out/sweep_prefill.png" \
    --json "$out/bench_prefill.json"
fi
if has trace; then
  step trace_decode 120 python3 scripts/trace_phases.py --ranks 8 --num-sms 16 --tokens 128 --json "$out/trace_decode.json"
  step trace_tiny 120 python3 scripts/trace_phases.py --ranks 8 --num-sms 16 --tokens 8 --json "$out/trace_tiny.json"
  step trace_zero_copy 120 python3 scripts/trace_phases.py --ranks 8 --num-sms 16 --tokens 128 --zero-copy \
    --json "$out/trace_zero_copy.json"
  # A rank per GPU has no launch stagger: one rank with every SM shows the fixed cost of its phases.
  step trace_one_rank 120 python3 scripts/trace_phases.py --ranks 1 --tokens 128 --experts 32 \
    --json "$out/trace_one_rank.json"
fi
if has tests; then
  # One pytest per file, each with its own limit, so a hang costs one file and not the rest; a test
  # past --timeout gets its threads' stacks dumped (thread method: works while C code holds the GIL).
  # Failures are appended to pytest_failures.log as they happen (tests/conftest.py).
  export MOONCAKE_EP_FAILURE_LOG="$out/pytest_failures.log"
  default_files="test_gpu_low_latency test_gpu_faults test_gpu_ipc test_gpu_frameworks test_examples test_bench test_cli"
  files="${PYTEST_FILES:-$default_files}"
  num_files_run=0  # files where some test ran and all passed
  for file in $files; do
    args=(-m gpu -q -p no:cacheprovider -p no:warnings --timeout "${PYTEST_TIMEOUT_S:-90}" --timeout-method thread
          --tb=short -rf --durations=5 --junitxml "$out/$file.xml")
    ok_rcs=0
    if [ -n "${PYTEST_K:-}" ]; then
      args+=(-k "$PYTEST_K")
      ok_rcs="0 5"  # 5: the -k selected nothing in this file, which is no failure of it
    fi
    last_rc=
    OK_RCS=$ok_rcs TAIL=8 step "$file" "${PYTEST_FILE_LIMIT_S:-240}" python3 -m pytest "${args[@]}" "tests/$file.py"
    [ "$last_rc" = 0 ] && num_files_run=$((num_files_run + 1))
  done
  if [ -n "${PYTEST_K:-}" ] && [ "$num_files_run" -eq 0 ]; then  # a typo in -k ran nothing, and passed
    echo "== PYTEST_K='$PYTEST_K' selected no test in any file"
    status=1
  fi
fi
if has ncu; then
  # One rank, 16 SMs, the per-rank work of the decode shape (1024 copies in, 1024 rows combined).
  step ncu 300 ncu --clock-control none -k regex:ll_ --launch-skip 8 --launch-count 4 --set detailed \
    -o "$out/ncu_one_rank" -f python3 scripts/trace_phases.py --ranks 1 --num-sms 16 --tokens 128 --experts 32 --replays 4
  ncu -i "$out/ncu_one_rank.ncu-rep" --page details >"$out/ncu_one_rank.txt" 2>&1
fi
if has hbm; then
  # No cache flush between workloads (--cache-control none): a replay pays the write-back of what
  # the replays before it left dirty in L2, as back-to-back replays do. Both phases in turn, then
  # dispatch alone (what a dispatch writes back when no combine runs between).
  for phases in both dispatch; do
    step "ncu_hbm_$phases" 240 ncu --clock-control none --cache-control none --profile-from-start off \
      --graph-profiling graph --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
      -o "$out/ncu_hbm_$phases" -f python3 scripts/trace_phases.py --no-trace --ranks 8 --num-sms 16 --tokens 128 \
      --replays 5 --profiler-range 6 --profiler-phases "$phases"
    ncu -i "$out/ncu_hbm_$phases.ncu-rep" --csv --page raw --print-units base >"$out/ncu_hbm_$phases.csv" 2>&1
  done
fi
if has fault; then
  TAIL=20 step fault_latency 240 python3 scripts/fault_latency.py --json "$out/fault.json"
fi
if has host; then
  TAIL=40 step host_profile 240 python3 scripts/profile_host.py --frameworks torch cupy jax --profile \
    --json "$out/host.json"
  TAIL=3 step host_jax_no_command_buffers 120 python3 scripts/profile_host.py --frameworks jax --calls 300 --steps 300 \
    --no-command-buffers --json "$out/host_jax_plain.json"
fi
if has sanitizer; then
  # Each rank is a process of its own, under a tool of its own: the launcher puts compute-sanitizer
  # before each rank's python (tests/test_gpu_ipc.py's cases of 2 and 4 ranks: bf16 and fp8 sync, fp8
  # async and hook, the peers' workspaces through CUDA IPC). Ranks in one process under one tool (the
  # in-process tests) masked healthy peers after the 120 s timeout in each of the last three runs: the
  # tool seems to hold one rank's launch behind another's waiting kernel. A log per rank (%p: its pid);
  # racecheck looks at shared memory, memcheck at every global access. API errors are not reported:
  # cuda.bindings resolves driver entry points with cuGetProcAddress, which answers "not found" for
  # the ones this driver lacks by design; our code checks every result itself.
  for tool in memcheck racecheck; do
    sanitizer=(compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99)
    rm -f "$out"/sanitizer_"$tool"_rank_*.log  # an earlier run's, in a reused OUTDIR
    MOONCAKE_EP_TEST_RANK_PREFIX="${sanitizer[*]} --log-file $(printf %q "$out/sanitizer_${tool}_rank_%p.log")" \
      MOONCAKE_EP_TEST_TIMEOUT_US=120000000 \
      step "sanitizer_$tool" 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_ipc.py -k equal_reference
    # A rank with errors exits 99 and fails its test. Every rank's log must end in the tool's summary
    # (a rank killed mid-run leaves none); no logs at all would mean no rank ran under the tool.
    shopt -s nullglob
    logs=("$out"/sanitizer_"$tool"_rank_*.log)
    shopt -u nullglob
    num_summaries=$(grep -l "SUMMARY" "${logs[@]}" /dev/null | wc -l)  # /dev/null: never stdin
    echo "$tool: ${#logs[@]} rank logs, $num_summaries with a summary"
    if [ "${#logs[@]}" -eq 0 ] || [ "$num_summaries" -ne "${#logs[@]}" ]; then status=1; fi
    grep -h "SUMMARY" "${logs[@]}" /dev/null | sort | uniq -c
    # The variants of ranks in one process on one GPU (memory ordered at GPU scope), on one rank alone:
    # nothing then waits on a peer in the same process.
    MOONCAKE_EP_TEST_TIMEOUT_US=120000000 step "sanitizer_${tool}_in_process" 300 "${sanitizer[@]}" \
      python3 -m pytest -q -p no:cacheprovider tests/test_gpu_low_latency.py -k "R1-"
  done
fi
pack
exit $status
