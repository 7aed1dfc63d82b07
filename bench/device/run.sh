#!/usr/bin/env bash
# One command on the GPU machine, from the repository root there:
#   bench/device/run.sh [jit] [pytest] [pytest_fp8] [bench] [bench_cc] [kernels] [correctness] [fp8acc] [serve] [goodput] [gemv] [compare] [startup] [profile] [tiers] [tiers_engine] [sampling] ...
# (jit: FlashInfer's JIT modules built in the background, all at once, for the stages after it;
#  bench: the engine's defaults; bench_cc: the same with the CUDA-core decode kernel, to compare)
# Installs the wheels from $WHL_DIRS (default: .whl .whl_web, carried beside the tree) into .site (bench/device/wheels.sh: again only when a directory's wheels change),
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
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
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
    pytest_fp8) timeout "$(left 0 "${T_PYTEST:-300}")" python3 -m pytest tests/gpu/test_fp8.py -q -p no:cacheprovider \
              -o asyncio_mode=strict --tb=short ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu_fp8.log" | tail -30 ;;
    fp8acc) # FP8 against bf16 weights: the trained subject's held-out loss and top-1 agreement, the 8B's logits
            timeout "$(left 0 "${T_FP8ACC:-330}")" python3 bench/device/fp8_accuracy.py --out "$OUT/fp8_accuracy.jsonl" \
              ${FP8ACC_ARGS:-} 2>&1 | tee "$OUT/fp8_accuracy.log" | grep -v Warning | tail -30 ;;
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
    goodput) # bench goodput per configuration (aggN, every xPyD), workload and target pair (docs/benchmarking.md)
             timeout "$(left 0 "${T_GOODPUT:-560}")" python3 bench/device/goodput_study.py --out "$OUT" \
               --budget-s "$(left 20 "${T_GOODPUT:-540}")" ${GOODPUT_ARGS:---gpus 2 --configs all --workloads 8k256 --targets tight} \
               2>&1 | tee "$OUT/goodput_study.log" | grep -v '"goodput_probe"' | tail -40 ;;
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
    profile) # the planner's profile of the 8B architecture (random weights), format 2 (docs/planner.md);
             # PROFILE_NAME names it (the card), PROFILE_ENGINE_ARGS adds engine flags (--kv-cache-dtype fp8)
             python3 -c "from engine.loader import write_arch_dir; write_arch_dir('llama-3.1-8b', '/tmp/splitserve-models/llama-3.1-8b')" \
             && timeout "$(left 0 "${T_PROFILE:-300}")" python3 -m splitserve profile --model /tmp/splitserve-models/llama-3.1-8b \
               --load-format dummy --device cuda --out "$OUT/${PROFILE_NAME:-h100-llama-3.1-8b}.json" \
               --name "${PROFILE_NAME:-h100-llama-3.1-8b}" ${PROFILE_ENGINE_ARGS:-} \
               ${PROFILE_ARGS:---prefill-tokens 128,512,1024,2048,4096,8192,16384,32768 --cached-fractions 0,0.5,0.9 --decode-batches 1,8,32,64,128,256 --decode-contexts 512,2048,8192,32768 --steps 16 --repeats 3} \
               2>&1 | tee "$OUT/profile.log" | grep -v Warning | tail -20 ;;
    sampling) timeout "$(left 0 "${T_SAMPLING:-180}")" python3 bench/device/sampling_bench.py --out "$OUT/sampling_bench.jsonl" \
                ${SAMPLING_ARGS:-} 2>&1 | tee "$OUT/sampling_bench.log" | grep -v Warning ;;
    gemv) timeout "$(left 0 120)" python3 bench/device/gemv_layouts.py --out "$OUT/gemv_layouts.jsonl" 2>&1 | grep -v Warning ;;
    tiers) # KV tiers: GPU tests of the G1<->G2 movers, then bench/kv_tiers_bench.py on the machine's disk
           # (needs only nixl and xxhash: WHL_DIRS=.whl_nixl with those wheels is enough)
           timeout "$(left 0 240)" python3 -m pytest tests/gpu/test_kv_tiers_gpu.py tests/gpu/test_kv_tiers_engine_gpu.py \
             -q -p no:cacheprovider --tb=short \
             2>&1 | tee "$OUT/pytest_kv_tiers.log" | tail -15
           timeout "$(left 0 "${T_TIERS:-300}")" python3 bench/kv_tiers_bench.py --device cuda --dir "${TIERS_DIR:-/tmp/kvtiers}" \
             ${TIERS_ARGS:---shape 8b --blocks 1,4,16,64,256 --disk-mib 1024} > "$OUT/kv_tiers.jsonl" 2> "$OUT/kv_tiers.log"
           cat "$OUT/kv_tiers.log" ;;
    tiers_engine) # KV tiers in the engine (8B, random weights): TTFT recompute/G2/G3/auto 1k..32k on bf16 and
           # fp8 KV, decode ITL tiers off/on, a multi-turn replay beyond G1 tiers off/on (docs/kv_tiers.md)
           timeout "$(left 0 "${T_TIERS_ENGINE:-480}")" python3 bench/device/kv_tiers_engine.py \
             --out "$OUT/kv_tiers_engine.jsonl" --dir "${TIERS_DIR:-/tmp/kvtiers}-engine" ${TIERS_ENGINE_ARGS:-} \
             2>&1 | grep -v "NIXL\|Warning" | tee "$OUT/kv_tiers_engine.log" | tail -30 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
wait
echo "=== done $(date -u +%T)"
