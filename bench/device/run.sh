#!/usr/bin/env bash
# One command on the GPU machine, from the repository root there:
#   bench/device/run.sh [correctness] [pytest] [savecache] [bench] ...
# Installs the FlashInfer wheels from $WHL (default ../.whl), restores the JIT cache from
# $FI_CACHE (default ../.fi_cache/fi_cache.tgz) if present, and writes JSON lines and logs to $OUT.
# Each stage has its own timeout so a slow one never loses the others' results.
set -o pipefail
export PYTHONUNBUFFERED=1
WHL=${WHL:-../.whl}
FI_CACHE=${FI_CACHE:-../.fi_cache/fi_cache.tgz}
OUT=${OUT:-/tmp/splitserve-out}
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${TOTAL_S:-570} ))   # every stage ends before this
left() { local l=$(( DEADLINE - $(date +%s) - ${1:-0} )); [ "$l" -lt "$2" ] && echo "$l" || echo "$2"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl || exit 1
# Sources older than any cached object, so ninja finds a restored JIT cache up to date.
find /tmp/site/flashinfer -exec touch -h -d '2020-01-01' {} +
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=${MAX_JOBS:-16}
mkdir -p /tmp/fiws
[ -f "$FI_CACHE" ] && tar xzf "$FI_CACHE" -C /tmp/fiws && echo "restored JIT cache $(du -sh /tmp/fiws | cut -f1)"
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv; python3 -c \
  "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"; } \
  > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for stage in "$@"; do
  echo "=== $stage $(date -u +%T)"
  case "$stage" in
    correctness)  # the models in parallel: their JIT compiles overlap (FlashInfer locks a shared build),
      # and trained-hd128 trains (train_small.py, --max-seconds 90) while the others compile
      t=$(left 150 "${T_CORR:-360}")
      for m in trained-hd128:${TRAINED_DTYPES:-bfloat16,float16} small-hd128:${HD128_DTYPES:-bfloat16,float16} \
               llama-3.2-1b:${B1_DTYPES:-bfloat16}; do
        timeout "$t" python3 bench/device/correctness.py --models "${m%%:*}" --dtypes "${m#*:}" \
          --out "$OUT/correctness.jsonl" > "$OUT/correctness-${m%%:*}.log" 2>&1 &
      done
      wait; grep -h -v Warning "$OUT"/correctness-*.log | tail -40 ;;
    pytest) timeout "$(left 0 "${T_PYTEST:-150}")" python3 -m pytest tests/gpu -q -x -p no:cacheprovider -o asyncio_mode=strict \
              2>&1 | tail -30 | tee "$OUT/pytest_gpu.log" ;;
    savecache)  # whole objects: a partial rebuild links against them
      tar czf "$OUT/fi_cache.tgz" -C /tmp/fiws .cache && ls -la "$OUT/fi_cache.tgz" ;;
    bench) timeout "$(left 0 "${T_BENCH:-330}")" python3 bench/device/engine_bench.py --out "$OUT/engine_bench.jsonl" ${BENCH_ARGS:-} \
             2>&1 | tee "$OUT/engine_bench.log" | grep -v Warning ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "=== done $(date -u +%T)"
