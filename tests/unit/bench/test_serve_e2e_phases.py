"""bench/device/serve_e2e.py records where a remote prompt's time goes: the handoff histograms of the
workers' own metrics (as the frontend's /metrics exposes them), as counts and means; and its per-GPU
figures divide by every GPU `serve` places."""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client import generate_latest

from runtime.metrics import WorkerMetrics

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "device"))
from serve_e2e import parse_counters  # noqa: E402


def test_phase_means_and_counters_from_worker_metrics():
    d, p = WorkerMetrics("decode-0"), WorkerMetrics("prefill-0")
    for s in (0.01, 0.03):
        d.reserve_wait_s.labels("decode-0").observe(s)
    for s in (0.5, 1.5, 1.0):
        p.prefill_compute_s.labels("prefill-0").observe(s)
    p.kv_transfer_s.labels("prefill-0").observe(0.004)
    d.handoff_s.labels("decode-0").observe(2.0)
    d.kv_handoffs.labels("decode-0").inc(3)
    p.prefill_refused.labels("prefill-0", "saturated").inc()
    text = (generate_latest(d.registry) + generate_latest(p.registry)).decode()
    found = parse_counters(text)
    assert found["splitserve_kv_reserve_wait_count"] == 2
    assert found["splitserve_kv_reserve_wait_mean_ms"] == 20.0
    assert found["splitserve_prefill_compute_count"] == 3
    assert found["splitserve_prefill_compute_mean_ms"] == 1000.0
    assert found["splitserve_kv_transfer_mean_ms"] == 4.0
    assert found["splitserve_kv_handoff_mean_ms"] == 2000.0
    assert found['splitserve_kv_handoffs_total{worker="decode-0"}'] == 3
    assert found['splitserve_prefill_refused_total{reason="saturated",worker="prefill-0"}'] == 1


def test_no_phases_without_observations():
    text = generate_latest(WorkerMetrics("decode-0").registry).decode()
    assert not any(k.endswith(("_mean_ms", "_count")) for k in parse_counters(text))


def test_per_gpu_figures_count_every_gpu_serve_places():
    from serve_e2e import gpus_serving
    assert gpus_serving("agg", 1, ["--tensor-parallel-size 4 --quantization auto"]) == 4
    assert gpus_serving("agg", 2, ["--tensor-parallel-size=2"]) == 4
    assert gpus_serving("disagg", 1, []) == 2          # a prefill worker beside the decode worker
    assert gpus_serving("agg", 1, []) == 1
