#!/usr/bin/env bash
# Several device stages at once on disjoint GPUs of one host, so that one call of a few minutes
# measures what would take several:
#   bench/device/parallel.sh 'GPUS|COMMAND' 'GPUS|COMMAND' ...
# e.g. bench/device/parallel.sh '0|bench/device/run.sh compare' '1,2|bench/device/multi_gpu.sh tp'
# Each COMMAND runs with CUDA_VISIBLE_DEVICES=GPUS and OUT=$OUT/gN (N: its position), its output in
# $OUT/gN.log; the wheels from $WHL_DIRS are installed into .site once, first, so the groups do not
# race to install them (the groups then run with WHL_DIRS=none). Ends when every group has.
# Everything under $OUT is packed into $OUT/all.tgz at the end (the device tool returns few files).
# The groups share the host's CPUs, memory and FlashInfer's JIT cache: a timing taken beside another
# group is compared only with one taken in the same call (run.sh's compare alternates its sides).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/splitserve-out}
mkdir -p "$OUT" .site
source "$(dirname "$0")/wheels.sh"
install_wheels || exit 1
n=0
for group in "$@"; do
  gpus=${group%%|*}; cmd=${group#*|}; n=$((n + 1))
  mkdir -p "$OUT/g$n"
  echo "=== g$n on GPUs $gpus: $cmd"
  ( CUDA_VISIBLE_DEVICES=$gpus OUT=$OUT/g$n WHL_DIRS=none bash -c "$cmd" > "$OUT/g$n.log" 2>&1
    echo "=== g$n ended with $? at $(date -u +%T)" >> "$OUT/g$n.log" ) &
done
wait
for i in $(seq 1 $n); do echo "--- g$i"; tail -12 "$OUT/g$i.log"; done
# the device tool returns at most a few files from $OUT: everything goes back as one archive
( cd "$OUT" && tar czf ../splitserve-parallel.tgz . && rm -rf ./* && mv ../splitserve-parallel.tgz all.tgz )
ls -la "$OUT"
