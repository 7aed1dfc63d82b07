#!/usr/bin/env bash
# One command on the GPU machine, from the repository root there:
#   bench/device/run.sh [jit] [pytest] [bench] [bench_cc] [kernels] [correctness] [serve] [gemv] [compare] [startup] ...
# (jit: FlashInfer's JIT modules built in the background, all at once, for the stages after it;
#  bench: the engine's defaults; bench_cc: the same with the CUDA-core decode kernel, to compare)
# Installs the wheels from $WHL_DIRS (default: .whl .whl_web, carried beside the tree) into .site once,
# keeps FlashInfer's JIT cache in .fiws (both survive between calls while the machine stays warm), and
# writes JSON lines and logs to $OUT. Each stage has its own timeout so a slow one never loses the
# others' results; the whole call ends before $TOTAL_S (default 570 s).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/splitserve-out}
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${TOTAL_S:-570} ))   # every stage ends before this
left() { local l=$(( DEADLINE - $(date +%s) - ${1:-0} )); [ "$l" -lt "$2" ] && echo "$l" || echo "$2"; }
# each wheel directory installs once (a later call may carry another while the machine is warm)
for d in ${WHL_DIRS:-.whl .whl_web}; do
  [ -d "$d" ] && [ ! -f ".site/.done-${d#.}" ] || continue     # absent or installed: skipped
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site "$d"/*.whl \
    && touch ".site/.done-${d#.}" || exit 1
done
ROOT_SITE=$PWD/.site
export PYTHONPATH=$PWD/.site:$PWD FLASHINFER_WORKSPACE_BASE=$PWD/.fiws MAX_JOBS=${MAX_JOBS:-16}
export SPLITSERVE_CACHE=$PWD/.sscache
# every record names the commit measured: GIT_SHA is carried beside the tree (the copy has no usable .git)
[ -f GIT_SHA ] && export SPLITSERVE_GIT_SHA=${SPLITSERVE_GIT_SHA:-$(cat GIT_SHA)}
mkdir -p .fiws
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv; python3 -c \
  "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"; } \
  > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for stage in "$@"; do
  echo "=== $stage $(date -u +%T)"
  case "$stage" in
    jit) timeout "$(left 0 "${T_JIT:-420}")" python3 bench/device/jit_warm.py ${JIT_ARGS:-} > "$OUT/jit_warm.log" 2>&1 &   # builds while the next stage loads or trains
         ;;
    pytest) timeout "$(left 0 "${T_PYTEST:-420}")" python3 -m pytest tests/gpu -q -p no:cacheprovider -o asyncio_mode=strict \
              --tb=short ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -30 ;;
    bench) timeout "$(left 0 "${T_BENCH:-330}")" python3 bench/device/engine_bench.py --out "$OUT/engine_bench.jsonl" ${BENCH_ARGS:-} \
             2>&1 | tee "$OUT/engine_bench.log" | grep -v Warning ;;
    bench_cc) timeout "$(left 0 "${T_BENCH:-330}")" python3 bench/device/engine_bench.py --out "$OUT/engine_bench.jsonl" \
               --decode-tensor-cores off ${BENCHTC_ARGS:---models llama-3.1-8b --only b1,batches --skip-hf} \
               2>&1 | tee "$OUT/engine_bench_cuda_core.log" | grep -v Warning ;;
    correctness) timeout "$(left 0 "${T_CORR:-480}")" python3 bench/device/correctness.py --out "$OUT/correctness.jsonl" \
                   ${CORR_ARGS:-} 2>&1 | tee "$OUT/correctness.log" | grep -v Warning | tail -40 ;;
    serve) timeout "$(left 0 "${T_SERVE:-560}")" python3 bench/device/serve_e2e.py --out "$OUT" \
             ${SERVE_ARGS:---arch llama-3.1-8b --scenario 1k1k --concurrency 4,16,64,128} 2>&1 | tail -40 | tee "$OUT/serve.log" ;;
    kernels) timeout "$(left 0 "${T_KERNELS:-300}")" python3 bench/device/decode_kernels.py --out "$OUT/decode_kernels.jsonl" \
               ${KERNELS_ARGS:-} 2>&1 | tee "$OUT/decode_kernels.log" | grep -v Warning ;;
    compare) # HEAD against the baseline tree carried in .base (git archive of the commit before a change),
             # one after the other in this call, same machine: the "within 2%" check of a refactor
             for side in ${CMP_SIDES:-.base . .base .}; do
               [ -d "$side/engine" ] || { echo "no $side tree"; continue; }
               ( cd "$side" && PYTHONPATH=$ROOT_SITE:$PWD SPLITSERVE_GIT_SHA=$(cat GIT_SHA 2>/dev/null || echo head) \
                 timeout "$(left 0 "${T_CMP:-200}")" python3 bench/device/engine_bench.py --out "$OUT/compare.jsonl" \
                 ${CMP_ARGS:---models llama-3.1-8b --only b1,offline --skip-hf} 2>&1 | grep -v Warning | tail -8 )
             done ;;
    startup) timeout "$(left 0 "${T_STARTUP:-300}")" python3 bench/device/startup.py --out "$OUT/startup.jsonl" \
               ${STARTUP_ARGS:-} 2>&1 | tee "$OUT/startup.log" | tail -20 ;;
    gemv) timeout "$(left 0 120)" python3 bench/device/gemv_layouts.py --out "$OUT/gemv_layouts.jsonl" 2>&1 | grep -v Warning ;;
    *) echo "unknown stage $stage" ;;
  esac
done
wait
echo "=== done $(date -u +%T)"
