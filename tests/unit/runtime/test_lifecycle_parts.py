"""Small pure parts of the lifecycle work: the last-minute latency histograms that merge across
frontends, the prefill worker's admission by measured pace, throttled warnings, the admin token check."""

from __future__ import annotations

import logging
import random

import pytest

from prefill_worker.admission import PrefillQueue
from runtime.admin_auth import token_matches
from runtime.latency import RollingHistogram, bucket_of, merge, quantile_s
from runtime.logging import Throttled


def test_percentiles_of_merged_histograms_are_within_five_percent_of_the_exact_ones():
    rng = random.Random(0)
    a, b = RollingHistogram(), RollingHistogram()
    values = [rng.lognormvariate(-3, 1) for _ in range(4000)]
    for i, v in enumerate(values):
        (a if i % 3 else b).add(v, now=10.0)
    counts = merge([a.counts(10.0), b.counts(10.0)])
    exact = sorted(values)
    for q in (0.5, 0.9, 0.99):
        got, want = quantile_s(counts, q), exact[int(q * len(exact)) - 1]
        assert abs(got - want) / want < 0.05, (q, got, want)
    assert quantile_s({}, 0.5) is None
    assert bucket_of(0.0) == 0 and bucket_of(1e9) == 159


def test_samples_leave_the_window_after_a_minute():
    h = RollingHistogram(window_s=60, num_slots=12)
    h.add(0.010, now=0.0)
    h.add(0.020, now=30.0)
    assert sum(h.counts(59.0).values()) == 2
    assert sum(h.counts(61.0).values()) == 1        # the first slot (0-5 s) has left
    assert sum(h.counts(200.0).values()) == 0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_pace_is_measured_on_busy_time_so_a_quiet_minute_does_not_refuse_a_long_prompt():
    clock = Clock()
    q = PrefillQueue(clock=clock)
    assert q.expected_finish_s(100_000) == 0.0       # no pace yet: accept
    for i in range(4):                               # 1000 tokens per second while busy
        q.accept(f"r{i}", 1000)
    for i in range(4):
        clock.t += 1.0
        q.finished(f"r{i}")
    assert q.tokens_per_s == pytest.approx(1000)
    clock.t += 60.0                                  # idle
    q.accept("late", 2000)
    clock.t += 2.0
    q.finished("late")
    assert q.tokens_per_s == pytest.approx(1000)
    for i in range(10):
        q.accept(f"b{i}", 1000)
    assert q.expected_finish_s(500) == pytest.approx(10.5)
    q.dropped("b0")
    assert q.num_queued_tokens == 9000


def test_prompts_finishing_in_one_step_share_its_time():
    clock = Clock()
    q = PrefillQueue(clock=clock)
    for i in range(4):
        q.accept(f"r{i}", 500)
    clock.t = 1.0
    for i in range(4):                               # one step computed all four
        q.finished(f"r{i}")
    assert q.tokens_per_s == pytest.approx(2000)


def test_a_repeated_warning_is_one_line_per_interval_with_a_count(caplog):
    log = logging.getLogger("test.throttled")
    t = Throttled(log, interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        for i in range(50):
            t.warning("redis", "lease renewal failed: %s", i)
        t.warning("other", "another kind")
        t.clear("redis")
        t.warning("redis", "after recovery")
    assert [r.getMessage() for r in caplog.records] == ["lease renewal failed: 0", "another kind", "after recovery"]


def test_the_admin_token_must_come_as_a_bearer_and_match_exactly():
    assert token_matches("Bearer s3cret", "s3cret") and token_matches("bearer s3cret", "s3cret")
    for header in (None, "", "s3cret", "Bearer", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret"):
        assert not token_matches(header, "s3cret"), header


async def test_a_signal_after_worker_drain_continues_the_drain_and_a_second_signal_stops_at_once():
    from runtime.config import EngineConfig, RedisConfig, WorkerConfig
    from runtime.worker_host import WorkerHost
    cfg = WorkerConfig(engine=EngineConfig(model="tiny"), redis=RedisConfig(url="redis://127.0.0.1:1/0"))  # never dialled
    host = WorkerHost(cfg, "w")            # the Kubernetes path: the planner's RPC, then the preStop SIGTERM
    host.request_drain("Worker.Drain")
    host.request_drain("signal SIGTERM")
    assert host._drain.is_set() and not host._stop_now.is_set()
    host.request_drain("signal SIGTERM")    # an operator's second signal: now
    assert host._stop_now.is_set()
    await host.redis.aclose()
    host = WorkerHost(cfg, "w")            # Ctrl-C twice
    host.request_drain("signal SIGINT")
    assert not host._stop_now.is_set()
    host.request_drain("signal SIGINT")
    assert host._stop_now.is_set()
    await host.redis.aclose()
