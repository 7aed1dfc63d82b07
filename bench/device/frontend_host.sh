#!/usr/bin/env bash
# The frontend tier on a big host's CPU, and two GPUs against one, from the repository root:
#   bench/device/frontend_host.sh [mock] [gpus]
# mock: `serve --mock` with 8 mock workers (a short step: bench/mock-short-step.json, or $MOCK_PROFILE),
#   128 tokens in, 512 out, 512 streams, one frontend then
#   --frontends 4 (bench/frontend_bench.py; the load from `bench serve --processes $PROCS`): output
#   tokens/s (targets: >= 40k with one frontend, >= 120k with four), ITL p50 over the mock step
#   (target <= 2 ms) and frontend CPU-seconds per 1,000 tokens.
# gpus: the model in $MODEL_DIR (default: the 8B architecture, random weights), fp8 KV, 1k in / 1k out
#   over HTTP: one decode worker at
#   concurrency 128, then two at 256 (target >= 1.9x the tokens/s, ITL p50 within 10%).
# JSON lines go to $OUT; every stage has its own timeout and the call ends before $TOTAL_S (540 s).
# SCALE=small runs the smallest configuration (one mock worker, a few streams), which runs on any
# CPU (tests/integration/test_frontend_host.py runs it).
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/splitserve-out}
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${TOTAL_S:-540} ))
left() { local l=$(( DEADLINE - $(date +%s) - ${1:-0} )); [ "$l" -lt "$2" ] && echo "$l" || echo "$2"; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
[ -f GIT_SHA ] && export SPLITSERVE_GIT_SHA=${SPLITSERVE_GIT_SHA:-$(cat GIT_SHA)}
PY=${PYTHON:-python3}
if [ "${SCALE:-full}" = small ]; then
  MOCK_ARGS="--workers 1 --concurrency 8 --isl 32 --osl 16 --num-requests 16 --frontends 1,2 --processes 2"
else
  MOCK_ARGS="--workers 8 --concurrency 512 --isl 128 --osl 512 --num-requests 2048 --frontends 1,4 --processes ${PROCS:-8}"
fi
MOCK_ARGS="$MOCK_ARGS --mock-profile ${MOCK_PROFILE:-bench/mock-short-step.json}"
# SERVER_CPUS / CLIENT_CPUS (taskset lists) keep the load generator off the cluster's cores: four
# frontends, eight mock workers and eight client processes sharing 20 cores left the clients 74 ms
# late at p99, and their ITL then measured the clients
[ -n "${SERVER_CPUS:-}" ] && MOCK_ARGS="$MOCK_ARGS --server-cpus $SERVER_CPUS"
[ -n "${CLIENT_CPUS:-}" ] && MOCK_ARGS="$MOCK_ARGS --client-cpus $CLIENT_CPUS"
for stage in "${@:-mock}"; do
  echo "=== $stage $(date -u +%T)"
  case "$stage" in
    mock) timeout "$(left 0 "${T_MOCK:-360}")" $PY bench/frontend_bench.py $MOCK_ARGS --api http --repeats 1 \
            --label "${LABEL:-frontend host}" --output "$OUT/frontend_host.jsonl" --level-timeout-s 240 \
            > "$OUT/frontend_host.log" 2>&1; echo "mock: exit $?"; grep summary "$OUT/frontend_host.jsonl" ;;
    gpus) LOAD=""
          if [ -z "${MODEL_DIR:-}" ]; then     # the 8B architecture, random weights, the tiny model's tokenizer
            MODEL_DIR=/tmp/splitserve-models/llama-3.1-8b-tok LOAD="--load-format dummy"
            $PY -c "import shutil, sys; from pathlib import Path; from engine.loader import write_arch_dir
from splitserve.models import resolve_model
d = write_arch_dir('llama-3.1-8b', sys.argv[1]); t = Path(resolve_model('tiny'))
[shutil.copy(t / f, d / f) for f in ('tokenizer.json', 'tokenizer_config.json')]" "$MODEL_DIR" || continue
          fi
          for pair in "1 128" "2 256"; do
            set -- $pair
            port=$(( 18600 + $1 ))
            $PY -m splitserve serve --model "$MODEL_DIR" --prefill-workers 0 --decode-workers "$1" \
              --kv-cache-dtype fp8 $LOAD --http-port "$port" --grpc-port $(( port + 100 )) --admin-port 0 \
              > "$OUT/serve_gpus$1.log" 2>&1 &
            sp=$!
            ready_by=$(( $(date +%s) + $(left 90 300) ))      # leave the bench 90 s at least
            until curl -sf "http://127.0.0.1:$port/health" > /dev/null || [ "$(date +%s)" -ge "$ready_by" ]; do sleep 1; done
            timeout "$(left 20 200)" $PY -m splitserve bench serve --url "http://127.0.0.1:$port" --isl 1024 \
              --osl 1024 --concurrency "$2" --processes "${PROCS:-8}" --gpus "$1" --no-progress \
              --label "gpus=$1" --output "$OUT/frontend_gpus.jsonl" > /dev/null
            kill -TERM "$sp"; wait "$sp"
          done
          grep '"bench": "serve"' "$OUT/frontend_gpus.jsonl" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
