"""`splitserve bench plan`: the command's JSON last line on a small trace, its backtest mode and its
plot, through the real argument parser."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from perf.profile import DEFAULT_STARTUP_S
from runtime.config import FrontendConfig
from runtime.config_planner import HARD_MAX_WORKERS, PoolLimits
from splitserve.bench.plan import SIMULATED_POOLS, _configs, plan_settings
from splitserve.cli import build_parser, main


def small_trace(path) -> None:
    """10 minutes of Azure-format requests: 1 req/s, then 3 req/s, then 1 req/s."""
    rng = np.random.default_rng(0)
    rates = [1.0] * 3 + [3.0] * 4 + [1.0] * 3
    t = np.concatenate([np.sort(rng.uniform(60 * k, 60 * (k + 1), rng.poisson(r * 60))) for k, r in enumerate(rates)])
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for x in t:
        whole = int(x)
        stamp = f"2023-11-16 18:{whole // 60:02d}:{whole % 60:02d}.{int((x - whole) * 1e7):07d}"
        lines.append(f"{stamp},{rng.integers(100, 3000)},{rng.integers(2, 400)}")
    path.write_text("\n".join(lines) + "\n")


def test_the_json_last_line(tmp_path, capsys):
    trace = tmp_path / "azure.csv"
    small_trace(trace)
    png = tmp_path / "plan.png"
    rc = main(["bench", "plan", "--trace", str(trace), "--ttft-ms", "2000", "--itl-ms", "50", "--load-scale", "2",
               "--startup-s", "30", "--warm-start-s", "60", "--plot", str(png), "--no-progress",
               "--decisions", str(tmp_path / "d.jsonl")])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("sla_attainment", "gpu_hours", "static_gpu_hours", "static_config", "scaling_actions",
                "ttft_attainment", "itl_attainment", "ttft_p90_s", "itl_mean_s", "predictor", "git_sha"):
        assert key in out, key
    assert 0.9 <= out["sla_attainment"] <= 1 and out["static_sla_attainment"] >= out["sla_attainment"]
    assert set(out["static_config"]) == {"prefill", "decode"} and out["static_gpu_hours"] > 0
    # the best static configuration of each mode: the split above, and aggregated workers
    dis, agg = out["static_disaggregated"], out["static_aggregated"]
    assert dis["config"] == out["static_config"] and dis["gpu_hours"] == out["static_gpu_hours"]
    assert set(agg["config"]) == {"workers"} and agg["config"]["workers"] >= 1
    assert agg["sla_attainment"] >= out["sla_attainment"] and agg["gpu_hours"] > 0
    assert out["gpu_hours"] > 0 and out["startup_s"] == 30 and out["requests"] > 1000
    assert 0 <= out["local_prefill_share"] <= 1 and out["max_prefill_queue_tokens"] == 32768
    assert png.stat().st_size > 10_000
    decisions = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert decisions[0]["prefill"]["bound"] in ("model", "min") and "plan_rate_rps" in decisions[0]["load"]


def test_backtest_mode_and_bad_input(tmp_path, capsys):
    trace = tmp_path / "azure.csv"
    small_trace(trace)
    assert main(["bench", "plan", "--trace", str(trace), "--ttft-ms", "2000", "--itl-ms", "50", "--backtest",
                 "--interval-s", "30"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    horizon = math.ceil((DEFAULT_STARTUP_S + 30) / 30)        # start-up plus one interval, in intervals
    assert {r["predictor"] for r in rows} >= {"constant", "holt(0.5,0.2,0.9)"} and rows[0]["horizon"] == horizon
    assert main(["bench", "plan", "--trace", str(tmp_path / "missing.csv"), "--ttft-ms", "1", "--itl-ms", "1"]) == 2
    assert main(["bench", "plan", "--trace", str(trace), "--ttft-ms", "0", "--itl-ms", "1"]) == 2
    err = capsys.readouterr().err
    assert "--ttft-ms, --itl-ms and --planner-interval-s must be > 0" in err and "Traceback" not in err
    assert main(["bench", "plan", "--trace", str(trace), "--ttft-ms", "1", "--itl-ms", "1",
                 "--predictor", "arima"]) == 2
    assert "unknown predictor 'arima'; use one of constant, ewma, holt" in capsys.readouterr().err
    assert main(["bench", "plan", "--trace", str(trace), "--ttft-ms", "1", "--itl-ms", "1", "--min-prefill", "3",
                 "--max-prefill", "2"]) == 2
    assert "prefill pool limits must satisfy 0 <= min <= max <= 256" in capsys.readouterr().err
    with pytest.raises(SystemExit):                   # the targets are the one thing a run must state
        build_parser().parse_args(["bench", "plan", "--trace", str(trace), "--itl-ms", "1"])
    assert "the following arguments are required: --ttft-ms" in capsys.readouterr().err
    assert main(["bench", "plan", "--trace", str(trace), "--ttft-ms", "1", "--itl-ms", "1", "--handoff-ms", "-1"]) == 2
    assert "handoff_s and max_prefill_queue_tokens must be >= 0" in capsys.readouterr().err


def test_the_flags_bench_plan_spelled_its_own_way_still_work():
    """`--interval-s`, `--startup-s`, `--profile` and `--min/max-prefill/decode` are old spellings of
    the generated `--planner-interval-s`, `--planner-startup-s`, `--planner-profile` and
    `--min/max-prefill/decode-workers`; unset, the pools are the simulated ones (1 to the hard max)."""
    base = ["bench", "plan", "--trace", "x", "--ttft-ms", "1", "--itl-ms", "1"]
    s = plan_settings(build_parser().parse_args(base))
    assert s.sla.startup_s is None and s.sla.interval_s == 20.0 and s.pools == SIMULATED_POOLS
    assert (s.pools.min_prefill_workers, s.pools.max_decode_workers) == (1, HARD_MAX_WORKERS)
    old = ["--interval-s", "30", "--startup-s", "8", "--profile", "p.json", "--min-prefill", "2", "--max-prefill", "5",
           "--min-decode", "3", "--max-decode", "6"]
    new = ["--planner-interval-s", "30", "--planner-startup-s", "8", "--planner-profile", "p.json",
           "--min-prefill-workers", "2", "--max-prefill-workers", "5", "--min-decode-workers", "3",
           "--max-decode-workers", "6"]
    a, b = (plan_settings(build_parser().parse_args(base + argv)) for argv in (old, new))
    assert a == b and (a.sla.interval_s, a.sla.startup_s, a.sla.profile) == (30.0, 8.0, "p.json")
    assert (a.pools.prefill, a.pools.decode) == (PoolLimits(2, 5), PoolLimits(3, 6))


def test_the_simulated_frontend_takes_the_frontends_flags_and_defaults():
    """--remote-prefill-min-tokens, --max-prefill-queue-tokens and --itl-guard-mode are the frontend's
    declared flags (runtime/config.py), with its defaults; --handoff-ms is this command's own."""
    base = ["bench", "plan", "--trace", "x", "--ttft-ms", "1000", "--itl-ms", "50"]
    args = build_parser().parse_args(base)
    _, sim = _configs(args, plan_settings(args), 16.5)
    declared = FrontendConfig(model="tiny")
    assert (sim.remote_prefill_min_tokens, sim.max_prefill_queue_tokens) == (
        declared.remote_prefill_min_tokens, declared.max_prefill_queue_tokens)
    args = build_parser().parse_args(base + ["--remote-prefill-min-tokens", "256", "--max-prefill-queue-tokens",
                                             "4096", "--handoff-ms", "20"])
    _, sim = _configs(args, plan_settings(args), 16.5)
    assert (sim.remote_prefill_min_tokens, sim.max_prefill_queue_tokens, sim.handoff_s) == (256, 4096, 0.02)
    assert sim.itl_guard_mode == declared.itl_guard_mode == "step"
    args = build_parser().parse_args(base + ["--itl-guard-mode", "budget"])
    assert _configs(args, plan_settings(args), 16.5)[1].itl_guard_mode == "budget"


def test_the_planners_serving_modes_are_reported(tmp_path, capsys):
    """With --planner-mode auto the simulated prefill pool may go to 0 (unless its minimum is given)
    and the record says which mode the planner chose, how often, and how often it switched; the
    default keeps the simulated pools and reports every decision disaggregated."""
    trace = tmp_path / "azure.csv"
    small_trace(trace)
    base = ["bench", "plan", "--trace", str(trace), "--ttft-ms", "2000", "--itl-ms", "50", "--startup-s", "30",
            "--warm-start-s", "60", "--no-progress", "--no-static", "--decisions", str(tmp_path / "d.jsonl")]
    assert plan_settings(build_parser().parse_args(base + ["--planner-mode", "auto"])).pools.min_prefill_workers == 0
    given = build_parser().parse_args(base + ["--planner-mode", "auto", "--min-prefill", "0", "--max-prefill", "2"])
    assert plan_settings(given).pools.max_prefill_workers == 2
    assert main(base + ["--planner-mode", "auto", "--min-prefill", "1"]) == 2          # aggregated needs 0
    assert "prefill pool's minimum at 0" in capsys.readouterr().err
    for mode in ("disaggregated", "auto"):
        assert main(base + ["--planner-mode", mode]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["planner_mode"] == mode and sum(out["mode_share"].values()) == pytest.approx(1.0)
        decisions = [json.loads(x)["mode"] for x in (tmp_path / "d.jsonl").read_text().splitlines()]
        aggregated = sum(d["mode"] == "aggregated" for d in decisions) / len(decisions)
        assert out["mode_share"]["aggregated"] == pytest.approx(aggregated, abs=1e-4)
        if mode == "disaggregated":
            assert aggregated == 0 and out["mode_switches"] == 0 and out["mean_prefill_workers"] >= 1
        else:
            assert all(d["aggregated_gpus"] >= 1 and d["disaggregated_gpus"] >= 2 for d in decisions)
