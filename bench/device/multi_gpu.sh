#!/usr/bin/env bash
# Many GPUs on one host (docs/multi_gpu.md), one command on a 2-GPU machine, from the repository root:
#   bench/device/multi_gpu.sh [jit] [placement] [tp] [tp70] [nvlink] [pytest] [tp70_serve] [compare]
# (no stage named: jit placement tp tp70 nvlink pytest; within 9 minutes the later ones get what time is
# left, so a fresh machine may want two calls: `jit placement tp nvlink`, then `jit tp70 pytest`).
# Like bench/device/run.sh: installs the wheels from $WHL_DIRS (default .whl .whl_web) into .site once,
# keeps FlashInfer's JIT cache in .fiws, writes JSON lines and logs to $OUT, every stage under its own timeout, the whole call before $TOTAL_S (540 s).
# Records are named <stage>-$TAG-<sha>.jsonl (TAG default h100x2), ready for bench/results/.
#   placement  serve --decode-workers 2 --prefill-workers 0 --device cuda (8B architecture, random
#              weights): one worker per GPU? nvidia-smi's view saved beside the record
#   jit        FlashInfer's JIT modules in the background (bench/device/jit_warm.py), the custom all-reduce's too
#   tp         the all-reduce alone per message size (NCCL, symmetric-memory one-shot and two-shot:
#              tp_allreduce.py); 8B: batch-1 decode at TP=1 and at TP=2 with each all-reduce in
#              $TP_ALL_REDUCES (nccl,symm_mem,flashinfer; engine_bench b1), the TP=2 / TP=1
#              speed-up; TP=2 parity against TP=1 (greedy tokens, logits relative error)
#   tp70       70B architecture, TP=$TP70_TP (2), weights $TP70_QUANT (fp8: quantized at load; auto: bf16;
#              TP70_TP=4 TP70_QUANT=auto on a 4-GPU host): batch-1 decode against its
#              roofline (per-GPU weight bytes / measured HBM copy bandwidth), load-to-ready
#   nvlink     prefill engine on GPU 0, decode engine on GPU 1 (each seeing only its own, as serve
#              places workers; then both seeing both), 8k-token prompt: the KV handoff's share of TTFT
#              and its GB/s against a torch peer copy GPU 0 -> GPU 1 measured in the same run; UCX's
#              protocol choice (UCX_PROTO_INFO) saved
#   pytest     tests/gpu, or $PYTEST_PATHS (the multi-GPU tests skip below 2 GPUs)
#   ipc        (not in the default list) a KV cache registered on GPU 1, pushed into from GPU 0, then its process
#              exits: GPU 1's memory at each step with UCX_CUDA_IPC_CACHE=y and n, and the pushes' times ($IPC_ARGS)
#   tp70_serve (not in the default list) 70B, TP=$TP70_TP, weights $TP70_QUANT, through HTTP: 1k/1k at concurrency 1,32,128
#              (TP70_SERVE_ARGS replaces that: "--concurrency 128 --num-requests 256")
#   compare    (not in the default list) one GPU: batch-1 and the 1k/1k engine loop of HEAD against .base, a
#              `git archive` of the commit before this work carried beside the tree (run.sh's compare stage)
# DEVICE=cpu runs the reduced forms (tiny model, gloo, DRAM) that the CPU test of this script runs.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/splitserve-out}
DEVICE=${DEVICE:-cuda}
TAG=${TAG:-$([ "$DEVICE" = cpu ] && echo cpu || echo h100x2)}
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${TOTAL_S:-540} ))   # every stage ends before this
left() { local l=$(( DEADLINE - $(date +%s) - ${1:-0} )); [ "$l" -lt "$2" ] && echo "$l" || echo "$2"; }
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
PY=${PY:-python3}
export PYTHONPATH=$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_WORKSPACE_BASE=$PWD/.fiws MAX_JOBS=${MAX_JOBS:-16}
export SPLITSERVE_CACHE=${SPLITSERVE_CACHE:-$PWD/.sscache}
[ -f GIT_SHA ] && export SPLITSERVE_GIT_SHA=${SPLITSERVE_GIT_SHA:-$(cat GIT_SHA)}
SHA=${SPLITSERVE_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
rec() { echo "$OUT/$1-$TAG-$SHA.jsonl"; }
mkdir -p .fiws
{ nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv 2>/dev/null; nvidia-smi topo -m 2>/dev/null
  $PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), 'GPUs')"; } \
  > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
[ $# -eq 0 ] && set -- jit placement tp tp70 nvlink pytest
for stage in "$@"; do
  echo "=== $stage $(date -u +%T)"
  case "$stage" in
    jit) # FlashInfer's JIT modules, built in the background for the stages after it (bench/device/jit_warm.py)
      [ "$DEVICE" = cpu ] || { timeout "$(left 0 "${T_JIT:-420}")" $PY bench/device/jit_warm.py --dtypes bfloat16 \
        ${JIT_ARGS---with comm} > "$OUT/jit_warm.log" 2>&1 & } ;;
    placement)
      if [ "$DEVICE" = cpu ]; then args=(--model tiny --port 18561 -- --device cpu --decode-workers 2 --prefill-workers 0
                                         --tensor-parallel-size 2)
      else args=(--arch llama-3.1-8b -- --decode-workers 2 --prefill-workers 0 --device cuda); fi
      timeout "$(left 0 "${T_PLACEMENT:-300}")" $PY bench/device/placement_check.py --out "$OUT" "${args[@]}" \
        2>&1 | tee "$OUT/placement.log" | grep '"bench"' >> "$(rec placement)"
      tail -1 "$(rec placement)" ;;
    tp)
      if [ "$DEVICE" = cpu ]; then
        timeout "$(left 0 120)" $PY bench/device/tp_parity.py --model tiny --device cpu --tp 2 --prompts 16,200 \
          --new-tokens 16 --out "$(rec tp)" 2>&1 | grep -v Warning | tail -2 >> "$OUT/tp.log"
      else
        timeout "$(left 0 "${T_TP_ALLREDUCE:-120}")" $PY bench/device/tp_allreduce.py --gpus 2 --out "$(rec tp)" 2>&1 \
          | grep -v Warning | tee -a "$OUT/tp.log" | tail -3
        for case in 1:nccl $(echo "${TP_ALL_REDUCES:-nccl,symm_mem,flashinfer}" | sed 's/\([^,]*\)/2:\1/g; s/,/ /g'); do
          timeout "$(left 0 "${T_TP_BENCH:-150}")" $PY bench/device/engine_bench.py --models llama-3.1-8b --only b1 \
            --skip-hf --tensor-parallel-size "${case%%:*}" --tp-all-reduce "${case#*:}" --out "$(rec tp)" 2>&1 \
            | grep -v Warning \
            | tee -a "$OUT/tp.log" | tail -3
        done
        timeout "$(left 0 "${T_TP_PARITY:-200}")" $PY bench/device/tp_parity.py --arch llama-3.1-8b --tp 2 \
          --tp-all-reduce "${TP_PARITY_ALL_REDUCE:-nccl}" --out "$(rec tp)" 2>&1 | grep -v Warning | tee -a "$OUT/tp.log" | tail -1
      fi
      $PY bench/device/multi_gpu_summary.py tp "$(rec tp)" | tee -a "$(rec tp)" ;;
    tp70)
      if [ "$DEVICE" = cpu ]; then
        timeout "$(left 0 120)" $PY bench/device/tp_parity.py --model tiny --device cpu --tp 2 --quantization fp8 \
          --prompts 16,200 --new-tokens 16 --out "$(rec tp70)" 2>&1 | grep -v Warning | tail -1 >> "$OUT/tp70.log"
      else
        timeout "$(left 0 "${T_TP70:-300}")" $PY bench/device/engine_bench.py --models llama-3.1-70b --only b1 \
          --skip-hf --tensor-parallel-size "${TP70_TP:-2}" --quantizations "${TP70_QUANT:-fp8}" --num-blocks 4000 \
          --out "$(rec tp70)" 2>&1 \
          | grep -v Warning | tee "$OUT/tp70.log" | tail -4
      fi
      $PY bench/device/multi_gpu_summary.py tp70 "$(rec tp70)" | tee -a "$(rec tp70)" ;;
    nvlink)
      if [ "$DEVICE" = cpu ]; then
        timeout "$(left 0 150)" $PY bench/device/disagg_bench.py --model tiny --device cpu --lengths 512 --reps 1 \
          --budget 512 > "$OUT/nvlink-cpu.out" 2>>"$OUT/nvlink.log"
        grep '"bench"' "$OUT/nvlink-cpu.out" | tee -a "$(rec nvlink)"
      else
        for vis in own all; do
          UCX_PROTO_INFO=y timeout "$(left 0 "${T_NVLINK:-170}")" $PY bench/device/disagg_bench.py --arch llama-3.1-8b \
            --lengths 8192,2048 --reps 3 --prefill-gpu 0 --decode-gpu 1 --visibility $vis > "$OUT/nvlink-$vis.out" \
            2>> "$OUT/nvlink.log"
          grep '"bench"' "$OUT/nvlink-$vis.out" | tee -a "$(rec nvlink)"
          grep -v '"bench"' "$OUT/nvlink-$vis.out" | grep -i -E "cuda_ipc|cuda_copy|rndv|tcp|sysv|cma" | sort | uniq -c \
            | sort -rn | head -20 > "$OUT/nvlink-ucx-proto-$vis.txt"
          head -5 "$OUT/nvlink-ucx-proto-$vis.txt"
        done
      fi ;;
    pytest)
      timeout "$(left 0 "${T_PYTEST:-300}")" $PY -m pytest ${PYTEST_PATHS:-tests/gpu} -q -p no:cacheprovider -o asyncio_mode=strict \
        --tb=short ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15 ;;
    compare) # one GPU, HEAD against the tree before this work (.base: `git archive 675199c`): batch-1 and the
             # 1k/1k engine loop within 2%, one after the other in this call (bench/device/run.sh's compare stage)
             OUT="$OUT" TOTAL_S="$(left 0 "${T_COMPARE:-420}")" WHL_DIRS=none bench/device/run.sh compare 2>&1 \
               | tee "$OUT/compare.log" | grep '"decode_batch1"\|"offline"' | tail -8
             [ -f "$OUT/compare.jsonl" ] && cp "$OUT/compare.jsonl" "$(rec compare)" ;;
    tp70_serve)
      timeout "$(left 0 "${T_TP70_SERVE:-500}")" $PY bench/device/serve_e2e.py --arch llama-3.1-70b --scenario 1k1k \
        ${TP70_SERVE_ARGS:---concurrency 1,32,128} --modes agg --out "$OUT" --label "${TAG}" --tag "tp${TP70_TP:-2}${TP70_QUANT:-fp8}" \
        --serve-args="--tensor-parallel-size ${TP70_TP:-2} --quantization ${TP70_QUANT:-fp8}" 2>&1 | tail -20 \
        | tee "$OUT/tp70_serve.log" ;;
    ipc) # does a departed decode worker's KV memory come back, with UCX's cuda_ipc cache on and off, and
         # what a push costs each way (bench/device/kv_ipc_release.py; docs/multi_gpu.md)
      if [ "$DEVICE" = cpu ]; then ipc_args=(--device cpu --kv-gib 0.05 --caches y --sizes 4 --reps 2 --settle-s 0.2)
      else ipc_args=(${IPC_ARGS:-}); fi
      timeout "$(left 0 "${T_IPC:-150}")" $PY bench/device/kv_ipc_release.py --out "$(rec kv_ipc_release)" "${ipc_args[@]}" \
        2>> "$OUT/kv_ipc_release.log" | tail -4 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
wait
echo "=== done $(date -u +%T)"
