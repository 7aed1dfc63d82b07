"""bench/device/multi_gpu.sh's plumbing, in its CPU form (DEVICE=cpu: the tiny model, gloo between
ranks, DRAM between workers): every stage writes its named record with what the GPU run reports —
the placement of a TP=2 cluster, TP=2 parity with TP=1 (bf16 and FP8), the KV handoff, a KV
cache's release after its process exits — so that the
one 2-GPU run the script is for does not fail on a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def records(out: Path, stage: str) -> list[dict]:
    (path,) = out.glob(f"{stage}-cpu-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_stage_writes_its_record_on_the_cpu(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path), "PY": sys.executable, "WHL_DIRS": "none",
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run(["bash", "bench/device/multi_gpu.sh", "placement", "tp", "tp70", "nvlink", "ipc"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [placement] = records(tmp_path, "placement")
    assert placement["completions_ok"] == 4 and placement["start_to_ready_s"] > 0
    assert [w["tensor_parallel_size"] for w in placement["workers"]] == [2, 2]
    assert all(len(w["pids"]) >= 2 for w in placement["workers"])          # the worker and its rank 1
    tp = {x["metric"]: x for x in records(tmp_path, "tp")}
    assert tp["tp_parity"]["tokens_equal"] and tp["tp_summary"]["parity_tokens_equal"]
    tp70 = {x["metric"]: x for x in records(tmp_path, "tp70")}
    assert tp70["tp_parity"]["quantization"] == "fp8" and tp70["tp_parity"]["tokens_equal"]
    [nvlink] = records(tmp_path, "nvlink")
    assert nvlink["tokens_match"] and nvlink["kv_bytes_match"] and nvlink["kv_share_of_ttft"] > 0
    [ipc] = records(tmp_path, "kv_ipc_release")
    assert ipc["ucx_cuda_ipc_cache"] == "y" and ipc["pushes"]["4"]["median_ms"] > 0
