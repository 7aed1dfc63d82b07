"""Performance profiles: the shipped default, the format-2 fields, and the format-1 files the mock
engine already reads."""

from __future__ import annotations

import json

import pytest

from perf.profile import (CURVE_PROFILE_PATH, DEFAULT_KV_TOKENS, DEFAULT_PROFILE_PATH, DEFAULT_STARTUP_S,
                             CurveTiming, Profile, ProfileTiming, curve_profile_spec, load_profile, load_timing,
                             profile_json)


def test_the_default_is_the_measured_h100_profile_with_the_measured_startup():
    spec = json.loads(DEFAULT_PROFILE_PATH.read_text())
    assert spec["device"].startswith("NVIDIA H100") and "startup_s" not in spec
    p = load_profile()
    assert (p.name, p.startup_s) == ("h100-llama-3.1-8b", DEFAULT_STARTUP_S)
    assert p.kv_capacity_tokens == spec["kv_capacity_tokens"]


def test_the_shipped_curve_is_the_curve_sampled_and_has_not_drifted():
    assert json.loads(CURVE_PROFILE_PATH.read_text()) == curve_profile_spec()
    assert CURVE_PROFILE_PATH.read_text() == profile_json(curve_profile_spec())
    p = load_profile(CURVE_PROFILE_PATH)
    assert isinstance(p.timing, ProfileTiming)
    assert (p.kv_capacity_tokens, p.startup_s, p.max_num_seqs) == (DEFAULT_KV_TOKENS, DEFAULT_STARTUP_S, 256)
    curve = Profile(CurveTiming())
    for prompt, cached in [(100, 0), (1000, 0), (5000, 0), (32768, 0), (40000, 20000), (66000, 60000)]:
        assert p.prefill_s(prompt, cached) == pytest.approx(curve.prefill_s(prompt, cached), rel=0.02)
    for batch, ctx in [(1, 1000), (64, 16000), (256, 1400), (200, 700)]:
        assert p.decode_step_s(batch, ctx) == pytest.approx(curve.decode_step_s(batch, ctx), rel=1e-4)


def test_the_mock_keeps_its_default_and_its_file_api():
    assert load_timing(None) == CurveTiming()
    assert isinstance(load_timing(CURVE_PROFILE_PATH), ProfileTiming)


def test_decode_fast_paths_agree_with_the_step_model():
    curve = CurveTiming()
    assert curve.decode_step_s(8, 1001) == pytest.approx(curve.step_s([(1000, 1)] * 8))
    p = load_profile()
    fast = p.decode_step_fn(256)
    for batch, ctx in [(1, 500.0), (37, 2100.5), (256, 30000.0)]:
        assert fast(batch, ctx) == pytest.approx(p.decode_step_s(batch, ctx))
        assert p.timing.step_s([(int(ctx) - 1, 1)] * batch) == pytest.approx(p.decode_step_s(batch, int(ctx)), rel=1e-6)


def test_format_two_fields_and_the_cached_fraction_table(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({
        "format": 2, "name": "test", "kv_capacity_tokens": 1000, "startup_s": 12.5, "max_num_seqs": 8,
        "prefill": {"tokens": [1000, 2000], "cached_fraction": [0.0, 0.5],
                    "time_s": [[0.1, 0.04], [0.3, 0.1]]},
        "decode": {"batch_size": [4, 1], "context_len": [100, 1100],
                   "time_s": [[0.030, 0.050], [0.010, 0.020]]}}))
    p = load_profile(path)
    assert (p.name, p.kv_capacity_tokens, p.startup_s, p.max_num_seqs) == ("test", 1000, 12.5, 8)
    assert p.prefill_s(2000, 1000) == pytest.approx(0.1)                 # measured, not P(2000) - P(1000)
    assert p.prefill_s(1500, 0) == pytest.approx(0.2)
    assert p.prefill_s(2000, 500) == pytest.approx((0.3 + 0.1) / 2)       # halfway to 0.5 cached
    assert p.timing.step_s([(1000, 1000)]) == pytest.approx(0.1)          # the mock pays the same
    assert p.decode_step_s(1, 600) == pytest.approx(0.015)                # batch sizes given unsorted
    assert p.decode_tokens_per_s(4, 100) == pytest.approx(4 / 0.030)


def test_format_one_still_loads_with_the_defaults(tmp_path):
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"prefill": {"tokens": [1000, 2000], "time_s": [0.1, 0.3]},
                                "decode": {"batch_size": [1, 9], "context_len": [100, 1100],
                                           "time_s": [[0.010, 0.020], [0.030, 0.050]]}}))
    p = load_profile(path)
    assert p.startup_s == DEFAULT_STARTUP_S and p.kv_capacity_tokens == DEFAULT_KV_TOKENS
    assert p.prefill_s(2000, 1000) == pytest.approx(0.2)                 # P(2000) - P(1000)
    assert p.prefill_tokens_per_s(2000, 0) == pytest.approx(2000 / 0.3)


def test_bad_cached_fractions_are_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"prefill": {"tokens": [1000], "cached_fraction": [0.5], "time_s": [[0.1]]},
                                "decode": {"batch_size": [1], "context_len": [100], "time_s": [[0.01]]}}))
    with pytest.raises(ValueError):
        load_profile(path)


def test_profiles_are_per_weight_quantization(tmp_path):
    """A profile records the weights it was measured with; the planner's default is the one for its
    workers' weights, none is shipped for FP8 yet (a clear error), and another's is refused."""
    assert load_profile(quantization="none").quantization == "none" == load_profile().quantization
    with pytest.raises(ValueError, match="no performance profile is shipped for fp8.*splitserve profile"):
        load_profile(quantization="fp8")
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps({**json.loads(DEFAULT_PROFILE_PATH.read_text()), "quantization": "fp8"}))
    assert load_profile(path, "fp8").quantization == "fp8" == load_profile(path).quantization
    with pytest.raises(ValueError, match="measured with fp8 weights; the workers run none"):
        load_profile(path, "none")


MEASURED = sorted(p for p in DEFAULT_PROFILE_PATH.parent.glob("*.json") if p != CURVE_PROFILE_PATH)


@pytest.mark.parametrize("path", MEASURED, ids=lambda p: p.stem)
def test_every_shipped_profile_loads_and_prices_work_monotonically(path):
    """The measured profiles (H100, H200 with the bf16 and the fp8 KV cache): format 2, named as
    their file, and longer prompts, larger batches and longer contexts never cost less."""
    spec = json.loads(path.read_text())
    p = load_profile(path)
    assert spec["format"] == 2 and p.name == path.stem and spec["device"].startswith("NVIDIA")
    assert 0 < p.prefill_s(128) < p.prefill_s(2048) < p.prefill_s(8192) < p.prefill_s(32768)
    assert p.prefill_s(8192, 4096) < p.prefill_s(8192)
    for ctx in (512, 8192):
        steps = [p.decode_step_s(b, ctx) for b in (1, 8, 32, 128)]
        assert steps == sorted(steps) and steps[0] > 0
    assert p.decode_step_s(32, 8192) >= p.decode_step_s(32, 512)


def test_the_fp8_kv_cache_profile_reads_less_per_decode_step_than_the_bf16_one():
    """On the same card, the fp8 KV cache halves the bytes a decode step reads from the cache: its
    steps at long contexts are the cheaper ones, and it holds twice the tokens."""
    bf16 = load_profile(DEFAULT_PROFILE_PATH.parent / "h200-llama-3.1-8b.json")
    fp8 = load_profile(DEFAULT_PROFILE_PATH.parent / "h200-llama-3.1-8b-fp8kv.json")
    assert fp8.decode_step_s(128, 8192) < bf16.decode_step_s(128, 8192)
    assert fp8.kv_capacity_tokens == pytest.approx(2 * bf16.kv_capacity_tokens, rel=0.01)
