"""`splitserve profile`: measuring the mock reproduces the timing it runs on (a round trip through
the real engine loop: scheduler, chunked prefill, prefix cache), and a small sweep of the tiny model
on the CPU (FP8 weights) writes a format-2 profile, with the weights' quantization, that the planner
and the mock engine both read."""

from __future__ import annotations

import json

import pytest

from perf.profile import load_profile, load_timing
from splitserve.cli import main

SLOW = {"format": 2, "name": "slow", "curve": {"base_s": 0.02, "per_token_s": 0.0002, "per_kv_token_s": 2e-06}}


def test_profiling_the_mock_measures_the_timing_it_runs_on(tmp_path):
    src, out = tmp_path / "slow.json", tmp_path / "measured.json"
    src.write_text(json.dumps(SLOW))
    assert main(["profile", "--out", str(out), "--mock", "--mock-profile", str(src), "--prefill-tokens", "64,512",
                 "--cached-fractions", "0.5", "--decode-batches", "1,8", "--decode-contexts", "64,512",
                 "--steps", "8", "--repeats", "3", "--num-blocks", "200"]) == 0
    truth, got = load_profile(src), load_profile(out)
    for prompt, cached in [(64, 0), (64, 32), (512, 0), (512, 256)]:
        assert got.prefill_s(prompt, cached) == pytest.approx(truth.prefill_s(prompt, cached), rel=0.25, abs=0.004)
    for batch, context in [(1, 64), (8, 64), (1, 512)]:
        assert got.decode_step_s(batch, context) == pytest.approx(truth.decode_step_s(batch, context), rel=0.25)
    spec = json.loads(out.read_text())
    # 8 x 512 tokens (+ their outputs) do not fit 200 blocks of 16: extrapolated, and said so
    assert spec["extrapolated"] == [[8, 512]] and spec["kv_capacity_tokens"] == 3200
    assert got.kv_capacity_tokens == 3200 and got.max_num_seqs == 256 and spec["quantization"] == "none"


def test_a_cpu_profile_of_the_tiny_model_feeds_the_planner_and_the_mock(tmp_path):
    out = tmp_path / "tiny-cpu.json"
    assert main(["profile", "--out", str(out), "--device", "cpu", "--prefill-tokens", "16,48",
                 "--cached-fractions", "0.5", "--decode-batches", "1,2", "--decode-contexts", "16,32",
                 "--steps", "2", "--repeats", "1", "--startup-s", "4.5", "--quantization", "fp8"]) == 0
    p = load_profile(out, "fp8")                    # recorded: the planner of FP8 workers takes it
    assert p.startup_s == 4.5 and p.kv_capacity_tokens > 0 and p.quantization == "fp8"
    spec = json.loads(out.read_text())
    assert spec["prefill"]["cached_fraction"] == [0.0, 0.5] and spec["device"].startswith("cpu")
    assert all(t > 0 for row in spec["prefill"]["time_s"] + spec["decode"]["time_s"] for t in row)
    assert load_timing(out).decode_step_s(2, 24) > 0            # what the mock engine runs on


def test_bad_sweeps_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--out", str(tmp_path / "x.json"), "--mock", "--cached-fractions", "1.5"])
    assert main(["profile", "--out", str(tmp_path / "x.json"), "--mock", "--steps", "0"]) == 2
    assert main(["profile", "--out", str(tmp_path / "x.json"), "--mock", "--num-blocks", "64",
                 "--decode-contexts", "999999999"]) == 2
    assert "do not fit" in capsys.readouterr().err
