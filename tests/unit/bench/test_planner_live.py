"""bench/device/planner_live.py's pure parts: the trace slice it replays (and writes for `bench
plan`), the configurations it names, the GPU-seconds it integrates from the admin API's samples,
and the flags `serve` gets for each configuration. (The live run needs GPUs; `--mock` runs the same
path on mock workers on the CPU.)"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "device"))
import planner_live as pl  # noqa: E402
from sim.workload import load_workload  # noqa: E402

ROWS = [("2023-11-16 18:15:40.0000000", 300, 40), ("2023-11-16 18:15:46.6805900", 374, 44),
        ("2023-11-16 18:15:50.9951690", 9000, 2000), ("2023-11-16 18:16:10.5000000", 5, 1),
        ("2023-11-16 18:17:00.0000000", 100, 10)]


@pytest.fixture
def trace(tmp_path) -> Path:
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{t},{p},{o}\n" for t, p, o in ROWS))
    return path


def test_the_slice_compresses_time_and_clips_lengths_and_bench_plan_reads_it_back(trace, tmp_path):
    w = pl.trace_slice(str(trace), 5.0, 60.0, 4.0, 8000, 1024)   # the rows at 6.68, 11.0 and 30.5 s
    assert np.allclose(w.arrival_s, [(6.68059 - 5) / 4, (10.995169 - 5) / 4, (30.5 - 5) / 4], atol=1e-6)
    assert w.prompt.tolist() == [374, 8000, 16] and w.output.tolist() == [44, 1024, 1]
    pl.write_azure_csv(w, tmp_path / "slice.csv")
    back = load_workload(str(tmp_path / "slice.csv"))
    # the simulator starts its clock at the first arrival
    assert np.allclose(back.arrival_s, w.arrival_s - w.arrival_s[0], atol=1e-5)
    assert back.prompt.tolist() == w.prompt.tolist() and back.output.tolist() == w.output.tolist()


def test_an_empty_slice_is_refused(trace):
    with pytest.raises(SystemExit, match="no request"):
        pl.trace_slice(str(trace), 500.0, 60.0, 1.0, 8000, 1024)


def test_configurations():
    assert pl.parse_config("planner") is None
    assert pl.parse_config("agg4") == (0, 4) and pl.parse_config("2P1D") == (2, 1)
    for bad in ("agg", "2p", "xpyd", "3d1p"):
        with pytest.raises(SystemExit, match="--config"):
            pl.parse_config(bad)


def test_gpu_seconds_hold_each_sample_until_the_next():
    samples = [{"t_s": 0.0, "gpus_held": 2}, {"t_s": 10.0, "gpus_held": 4}, {"t_s": 20.0, "gpus_held": 3}]
    assert pl.held_seconds(samples, 0.0, 30.0) == 2 * 10 + 4 * 10 + 3 * 10
    assert pl.held_seconds(samples, 5.0, 25.0) == 2 * 5 + 4 * 10 + 3 * 5     # only the replay's span
    assert pl.held_seconds([], 0.0, 10.0) == 0.0


def test_serve_flags_for_the_planner_and_a_static_split():
    args = SimpleNamespace(targets=(2000.0, 50.0), arch="llama-3.1-8b", mock=False, gpus=4, profile="P.json",
                           initial=(1, 1), interval_s=10.0, startup_s=20.0, planner_mode="disaggregated",
                           serve_args="--kv-cache-dtype fp8", config="planner")
    ports = {"http": 1, "grpc": 2, "admin": 3}
    argv = pl.serve_argv(args, "/m", ports, "secret")
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert "--planner" in argv and argv[-2:] == ["--kv-cache-dtype", "fp8"]
    assert argv[argv.index("--gpu-budget") + 1] == "4" and argv[argv.index("--gpus") + 1] == "0,1,2,3"
    assert argv[argv.index("--ttft-ms") + 1] == "2000.0" and flags.get("--model") == "/m"
    args.config = "2p2d"
    argv = pl.serve_argv(args, "/m", ports, "secret")
    assert "--planner" not in argv
    assert argv[argv.index("--prefill-workers") + 1] == "2" and argv[argv.index("--decode-workers") + 1] == "2"
    # the frontend gets what `serve --planner` would give it
    assert argv[argv.index("--itl-target-ms") + 1] == "50.0" and argv[argv.index("--decode-profile") + 1] == "P.json"
    assert pl.token_free("secret", "secret") == "<admin token>" and pl.token_free("--gpus", "secret") == "--gpus"


def test_attainment_counts_failed_and_truncated_requests_as_misses():
    from splitserve.bench.clients import RequestResult

    def done(ttft, gaps, expected):
        times = [ttft + sum(gaps[:i]) for i in range(len(gaps) + 1)]
        return RequestResult(16, expected, sent_at=0.0, chunk_times=times, chunk_tokens=[1] * len(times))
    results = [done(0.5, [0.01] * 9, 10),                 # meets both
               done(3.0, [0.01] * 9, 10),                 # late first token
               done(0.5, [0.08] * 9, 10),                 # slow decode
               done(0.5, [0.01] * 4, 10),                 # cut short: 5 of 10 tokens
               done(0.5, [], 1),                          # one token: no ITL, meets it
               RequestResult(16, 10, error="HTTP 500")]
    summary, ttft, itl = pl.attainment(results, (2.0, 0.05))
    assert summary["sla_attainment"] == round(2 / 6, 5)
    assert summary["errors"] == 1 and summary["truncated"] == 1
    assert summary["ttft_attainment"] == round(4 / 6, 5) and summary["itl_attainment"] == round(4 / 6, 5)
    assert np.isinf(ttft[5]) and np.isnan(itl[4]) and itl[0] == pytest.approx(0.01)
