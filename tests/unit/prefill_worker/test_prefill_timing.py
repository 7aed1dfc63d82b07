"""Each prompt's prefill queue wait and compute time, from the engine that computed it to the SLA
planner: the scheduler's accounting (the real Engine around the mock runner, real sleeps), the
prefill worker's Redis record (a real embedded Redis), the live planner's reader, and a planner
step whose prefill correction learns from them."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from engine.engine import Engine
from planner.live import PlannerLoop, PoolView, PrefillReader, check_sla
from prefill_worker.timing import PrefillTimings
from runtime.config import EngineConfig, SlaConfig
from runtime.metrics import PlannerMetrics
from runtime.pool_record import PrefillTimingRecord, prefill_timing_key, read_prefill_timings, write_prefill_timing
from runtime.redis_embedded import EmbeddedRedis
from runtime.types import EngineRequest, RequestId, SamplingParams
from splitserve.models import resolve_model


@pytest.fixture(scope="module")
def model_dir() -> str:
    return resolve_model("tiny")


def prompts_through(engine: Engine, n: int, length: int) -> tuple[dict, float]:
    """Submit n prompts at once (one output token each), step until done: the first outputs by
    request, and the wall time the steps took."""
    for i in range(n):
        engine.add_request(EngineRequest(RequestId(f"r{i}"), [10 + (i * 7 + j) % 3000 for j in range(length)],
                                         SamplingParams(max_tokens=1)))
    first, busy = {}, 0.0
    while engine.has_work:
        t0 = time.perf_counter()
        result = engine.step()
        busy += time.perf_counter() - t0
        for o in result.outputs:
            first.setdefault(o.request_id, o)
    return first, busy


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_times_each_prompt_s_wait_and_its_share_of_the_steps(model_dir, async_scheduling):
    # 3 prompts of 200 tokens, 128 tokens a step: 5 steps, two of them shared by two prompts
    cfg = EngineConfig(model=model_dir, mock=True, max_num_batched_tokens=128, num_blocks=256,
                       async_scheduling=async_scheduling)
    engine = Engine(cfg)
    engine.scheduler.track_prefill_time = True
    first, busy = prompts_through(engine, 3, 200)
    outs = [first[f"r{i}"] for i in range(3)]
    for o in outs:
        assert o.prefill_compute_s > 0 and o.prefill_wait_s >= 0
    # first come, first computed: each later prompt waited longer for its first step
    assert outs[0].prefill_wait_s < outs[1].prefill_wait_s < outs[2].prefill_wait_s
    # the steps' time is shared out, not counted once per prompt in them
    total = sum(o.prefill_compute_s for o in outs)
    assert 0.5 * busy <= total <= busy * 1.01


def test_no_timing_where_the_engine_is_not_asked_for_it(model_dir):
    engine = Engine(EngineConfig(model=model_dir, mock=True, num_blocks=64))
    first, _ = prompts_through(engine, 2, 40)
    assert all(o.prefill_wait_s is None and o.prefill_compute_s is None for o in first.values())


def test_the_planner_takes_each_prompt_once():
    r = PrefillReader()
    rec = lambda w, seqs: PrefillTimingRecord(w, [[s, 100 * s, 0, 0.01, 0.02] for s in seqs])  # noqa: E731
    assert r.take([rec("a", range(1, 6))]) == []                  # first sight: its past is not ours
    got = r.take([rec("a", range(3, 9)), rec("b", range(1, 3))])
    assert [p.prompt_tokens for p in got] == [600, 700, 800]      # a's 6..8; b counts from now
    assert r.take([rec("a", range(3, 9)), rec("b", range(1, 3))]) == []
    got = r.take([rec("a", range(1, 3)), rec("b", range(1, 4))])  # a restarted: from zero
    assert sorted(p.prompt_tokens for p in got) == [100, 200, 300]
    assert got[0].wait_s == 0.01 and got[0].compute_s == 0.02


def test_records_go_through_redis_and_a_planner_step_corrects_prefill_from_them():
    sla = SlaConfig(ttft_ms=2000, itl_ms=50, interval_s=1.0, startup_s=2.0)
    profile = check_sla(sla)

    class Pools:
        async def pools(self):
            return {"prefill": PoolView(2, 0, 0, 1, 4), "decode": PoolView(1, 0, 0, 1, 4)}

        async def set_targets(self, targets):
            pass

    async def go():
        with EmbeddedRedis() as redis:
            client = aioredis.Redis.from_url(redis.url)
            old = PrefillTimings("prefill-old")        # a worker that computed before the planner started
            old.record(1000, 0, 0.0, 1.0)
            await write_prefill_timing(client, "t", old.snapshot())
            await client.set(prefill_timing_key("t", "broken"), b"{not json")     # skipped, not fatal
            loop = PlannerLoop(sla, Pools(), redis.url, "t", PlannerMetrics(), profile)
            await loop.prime()                                       # what is there now is the past
            # a worker started after the planner: its publisher writes an empty record first
            timings = PrefillTimings("prefill-a")
            publisher = asyncio.create_task(timings.publish(client, "t", interval_s=0.05))
            await asyncio.sleep(0.2)
            await loop.collect()                                     # the planner sees it, empty
            # 40 prompts of 1,000 tokens, each computed in twice the profile's time
            modelled = profile.prefill_s(1000, 0)
            for _ in range(40):
                timings.record(1000, 0, 0.05, 2 * modelled)
            await asyncio.sleep(0.2)                                 # published
            publisher.cancel()
            assert sorted(len(r.prompts) for r in await read_prefill_timings(client, "t")) == [1, 40]
            before = loop.planner.service_correction.value
            d = await loop.step()
            await client.aclose()
            await loop.close()
            return before, loop.planner.service_correction.value, d
    before, after, d = asyncio.run(go())
    # one update moves it part of the way from 1 towards the observed 2 (an exponentially weighted ratio)
    assert before == 1.0 and 1.1 < after < 2.0
    assert d.now_s > 0          # the step decided (holding the pools: no frontend load was published)
