"""The mock engine: its timing model, its tokens, and the real Engine running around it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.engine import Engine
from engine.mock_runner import MockModelRunner
from perf.profile import CurveTiming, ProfileTiming, load_timing
from runtime.types import EngineRequest, FinishReason, GrammarKind, GrammarSpec, SamplingParams
from runtime.config import EngineConfig
from splitserve.models import resolve_model


@pytest.fixture(scope="module")
def model_dir() -> str:
    return resolve_model("tiny")


class FakeClock:
    """Time that moves only when the runner sleeps, so tests check modelled time exactly."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, s: float) -> None:
        self.now += s

    def __call__(self) -> float:
        return self.now


def mock_engine(model_dir: str, clock: FakeClock, **kw) -> Engine:
    cfg = EngineConfig(model=model_dir, mock=True, **kw)
    return Engine(cfg, runner=MockModelRunner(cfg, sleep=clock.sleep, clock=clock))


def run_all(engine: Engine, max_steps: int = 10_000, events: list | None = None) -> dict[str, list]:
    """Step until idle; the outputs per request (and, into `events`, every KV event the steps made)."""
    out: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return out
        result = engine.step()
        for o in result.outputs:
            out.setdefault(o.request_id, []).append(o)
        if events is not None:
            events += result.events
    raise AssertionError("engine did not finish")


# ---- timing model ---------------------------------------------------------------------------

def test_curve_prefill_grows_faster_than_linearly_and_decode_with_batch_and_context():
    t = CurveTiming()
    p1, p2, p4 = (t.step_s([(0, n)]) for n in (8192, 16384, 32768))
    assert p1 < p2 < p4 and (p4 - p2) > (p2 - p1) * 1.05     # the attention term
    assert 1.0 < p4 < 3.5                                      # an 8B 32k prefill on an H100: ~2 s
    d1 = t.step_s([(1000, 1)])
    assert 0.005 < d1 < 0.012                                  # batch-1 decode: weight-read bound
    assert t.step_s([(1000, 1)] * 64) > d1
    assert t.step_s([(16000, 1)] * 64) > t.step_s([(1000, 1)] * 64)


def test_chunked_prefill_costs_about_the_same_as_one_shot_plus_step_overheads():
    t = CurveTiming()
    whole = t.step_s([(0, 8192)])
    chunked = sum(t.step_s([(s, 2048)]) for s in range(0, 8192, 2048))
    assert whole < chunked < whole + 4 * t.base_s


def test_profile_tables_are_interpolated_and_extrapolated(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({
        "device": "test",
        "prefill": {"tokens": [1000, 2000], "time_s": [0.1, 0.3]},
        "decode": {"batch_size": [1, 9], "context_len": [100, 1100],
                   "time_s": [[0.010, 0.020], [0.030, 0.050]]}}))
    t = load_timing(path)
    assert isinstance(t, ProfileTiming)
    assert t.step_s([(0, 1500)]) == pytest.approx(0.2)
    assert t.step_s([(0, 3000)]) == pytest.approx(0.5)                   # last slope onwards
    assert t.step_s([(1000, 1000)]) == pytest.approx(0.2)                # P(2000) - P(1000)
    assert t.step_s([(599, 1)]) == pytest.approx(0.015)                  # batch 1, context 600
    assert t.step_s([(599, 1)] * 5) == pytest.approx((0.015 + 0.040) / 2)
    both = t.step_s([(0, 1000), (599, 1)])
    assert both == pytest.approx(0.1 + 0.015)


def test_curve_profile_and_bad_profiles(tmp_path):
    good = tmp_path / "c.json"
    good.write_text(json.dumps({"curve": {"base_s": 0.001}}))
    assert load_timing(good) == CurveTiming(base_s=0.001)
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"curve": {"speed": 2}}))
    with pytest.raises(ValueError):
        load_timing(bad)
    bad.write_text(json.dumps({"prefill": {"tokens": [1]}}))
    with pytest.raises(ValueError):
        load_timing(bad)
    with pytest.raises(ValueError):
        load_timing(tmp_path / "missing.json")


# ---- tokens and the real engine ----------------------------------------------------------------

def test_runner_interface_and_defaults(model_dir):
    r = MockModelRunner(EngineConfig(model=model_dir, mock=True))
    assert r.max_model_len == 131072 and r.num_blocks == 450_000 // 16
    assert r.model_config.vocab_size == 4096
    r = MockModelRunner(EngineConfig(model=model_dir, mock=True, num_blocks=100, max_model_len=4096))
    assert (r.num_blocks, r.max_model_len) == (100, 4096)


def test_the_mock_runner_and_the_engine_import_without_torch():
    """The simulators drive the real scheduler with the mock runner in processes without torch."""
    code = "import sys, engine.mock_runner, engine.engine; print(sorted(m for m in sys.modules if m == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_engine_reads_what_the_runner_declares(model_dir):
    """engine/runner.py: the mock models a device beside the host (async scheduling by default) and
    declares no grammar support, so a grammar request is refused at once rather than ignored."""
    eng = mock_engine(model_dir, FakeClock())
    assert eng.async_scheduling and eng.runner.steps_beside_host and not eng.runner.supports_grammar
    out = eng.add_request(EngineRequest("g", list(range(1, 20)), SamplingParams(
        max_tokens=4, grammar=GrammarSpec(GrammarKind.JSON_OBJECT))))
    assert out is not None and out.finish_reason is FinishReason.ERROR
    assert out.error == "structured output (grammar) is not supported by this engine yet"
    assert not eng.has_work


def test_the_kv_cache_caps_the_context_and_a_lowered_setting_is_said_once(model_dir, caplog):
    cfg = EngineConfig(model=model_dir, mock=True, num_blocks=2, max_model_len=999999)
    with caplog.at_level("WARNING", logger="engine.engine"):
        engine = Engine(cfg, runner=MockModelRunner(cfg))
    assert engine.max_model_len == 2 * cfg.block_size
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert line == "--max-model-len 999999 lowered to 32: the KV cache holds 32 tokens (2 blocks of 16)"
    caplog.clear()
    Engine(EngineConfig(model=model_dir, mock=True, num_blocks=2), runner=MockModelRunner(cfg))   # not configured
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_tokens_are_deterministic_below_vocab_and_never_eos(model_dir):
    r = MockModelRunner(EngineConfig(model=model_dir, mock=True))
    eos = set(r.model_config.eos_token_ids)
    toks = [r.token(f"req-{i}", p) for i in range(50) for p in range(200)]
    assert all(0 <= t < 4096 and t not in eos for t in toks)
    assert len(set(toks)) > 1000
    assert [r.token("a", p) for p in range(20)] == [r.token("a", p) for p in range(20)]
    assert [r.token("a", p) for p in range(20)] != [r.token("b", p) for p in range(20)]
    assert r.token("x", 3, frozenset([r.token("x", 3)])) != r.token("x", 3)


def test_engine_generates_exactly_max_tokens_and_sleeps_the_modelled_time(model_dir):
    clock = FakeClock()
    eng = mock_engine(model_dir, clock)
    for i in range(4):   # not ignore_eos: the mock never emits EOS, so lengths are max_tokens
        eng.add_request(EngineRequest(f"r{i}", list(range(100 + i, 1100 + i)), SamplingParams(max_tokens=20)))
    out = run_all(eng)
    assert all(sum(len(o.new_token_ids) for o in outs) == 20 for outs in out.values())
    assert all(outs[-1].finish_reason is FinishReason.LENGTH for outs in out.values())
    assert clock.now == pytest.approx(eng.runner.busy_s)
    # 4 prompts of 1000 tokens in one 2048-token step + another, then 19 decode steps of 4
    assert 0.15 < clock.now < 0.5


@pytest.mark.parametrize("overlap", [False, True])
def test_async_scheduling_hides_host_work_behind_the_modelled_step(model_dir, overlap):
    """4 ms of host work between steps (the loop's output handling, modelled on the fake clock):
    the synchronous engine adds it to every step, the async one (the mock's default) hides it
    behind the next 8B decode step (~7 ms at batch 4), and both emit the same tokens."""
    clock = FakeClock()
    eng = mock_engine(model_dir, clock, async_scheduling=None if overlap else False)
    assert eng.async_scheduling == overlap
    for i in range(4):
        eng.add_request(EngineRequest(f"r{i}", list(range(100 + i, 164 + i)), SamplingParams(max_tokens=40)))
    out: dict[str, list[int]] = {}
    while eng.has_work:
        for o in eng.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        clock.sleep(0.004)
    r = eng.runner
    assert out == {f"r{i}": [r.token(f"r{i}", 64 + n) for n in range(40)] for i in range(4)}
    host = 0.004 * r.num_steps
    if overlap:
        assert clock.now < r.busy_s + 0.1 * host         # only the first and last steps' host work shows
    else:
        assert clock.now == pytest.approx(r.busy_s + host)


def test_prefix_hits_and_kv_events_under_the_real_engine(model_dir):
    clock = FakeClock()
    eng = mock_engine(model_dir, clock)
    prompt = list(range(2000))
    eng.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=4)))
    events: list = []
    run_all(eng, events=events)
    first = clock.now
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    assert sum(len(e.block_hashes) for e in stored) >= 2000 // 16
    eng.add_request(EngineRequest("b", prompt + [7, 8, 9], SamplingParams(max_tokens=4)))
    out = run_all(eng)
    assert out["b"][0].num_cached_tokens == 2000 // 16 * 16
    assert clock.now - first < first / 3          # the hit skipped almost all of the prefill


def test_preemption_when_blocks_run_out(model_dir):
    clock = FakeClock()
    eng = mock_engine(model_dir, clock, num_blocks=40, block_size=16)   # 640 tokens of KV
    for i in range(4):
        eng.add_request(EngineRequest(f"p{i}", [i + 5] * 100 + list(range(50)), SamplingParams(max_tokens=100)))
    out = run_all(eng)
    assert eng.scheduler.num_preemptions > 0
    assert all(sum(len(o.new_token_ids) for o in outs) == 100 for outs in out.values())
    eng.pool.check_invariants()
    assert eng.pool.num_free == 40
