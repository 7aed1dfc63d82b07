"""The live planner loop (planner/live.py) between real Redis records and a pools target: the load
it reads from the frontends' records, the decision it hands the controller, its metrics; and the
admin API's SetPoolTargets on a real PoolController's book."""

from __future__ import annotations

import asyncio
import time

import pytest

from planner.live import AdminTarget, LoadReader, PlannerLoop, PoolView, check_sla, direction, sla_planner_config
from runtime.config import SlaConfig
from runtime.config_planner import PoolLimitsConfig
from runtime.metrics import PlannerMetrics
from runtime.pool_record import LatencyRecord, read_latencies, write_latency
from perf.profile import CURVE_PROFILE_PATH
from runtime.redis_embedded import EmbeddedRedis


def rec(fid: str, arrivals: int, seqs: range, itl=(0.0, 0)) -> LatencyRecord:
    now = time.time()
    times = [1000.0 + i for i in range(max(arrivals - 50, 0), arrivals)]      # the last 50 arrivals' times
    return LatencyRecord(60.0, {}, {}, fid, arrivals, itl[0], itl[1],
                         [[s, now - 1, 100 + s, 50, 10] for s in seqs], times)


def test_the_load_reader_takes_each_interval_once():
    r = LoadReader()
    assert r.take([rec("a", 100, range(1, 11))]).arrivals == 0    # first sight: its past is not ours
    load = r.take([rec("a", 130, range(5, 21), (3.0, 100))])
    assert load.arrivals == 30 and [q.prompt_tokens for q in load.requests] == [100 + i for i in range(11, 21)]
    assert load.arrival_times == [1000.0 + i for i in range(100, 130)]        # arrivals 101..130
    assert load.requests[0].cached_tokens == 10 and load.requests[0].output_tokens == 50
    load = r.take([rec("a", 130, range(5, 21), (3.0, 100)), rec("b", 7, range(1, 3))])
    assert load.arrivals == 0 and load.requests == [] and load.arrival_times == []   # nothing new; b from now
    load = r.take([rec("a", 5, range(1, 3), (0.5, 20)), rec("b", 9, range(1, 4))])
    assert load.arrivals == 5 + 2 and len(load.requests) == 2 + 1             # a restarted: counted from zero
    assert (load.itl_sum_s, load.itl_count) == (0.5, 20) and len(load.arrival_times) == 7
    load = r.take([rec("a", 205, range(1, 3), (0.5, 20)), rec("b", 9, range(1, 4))])
    assert load.arrivals == 200 and len(load.arrival_times) == 50             # the record holds the last 50


class FakePools:
    """A pools target holding sizes the way the controller does (target; an override wins)."""

    def __init__(self, decode: int, override: int | None = None) -> None:
        self.decode, self.override, self.sent = decode, override, []

    async def pools(self) -> dict[str, PoolView]:
        return {"decode": PoolView(self.decode, 0, 0, 1, 6, self.override, 4 * self.decode),
                "prefill": PoolView(0, 0, 0, 0, 0)}

    async def set_targets(self, targets) -> None:
        self.sent.append(targets)


def test_a_step_sizes_decode_from_the_published_load_and_reports_why():
    sla = SlaConfig(ttft_ms=2000, itl_ms=50, interval_s=1.0, startup_s=2.0)
    profile = check_sla(sla)
    target = FakePools(decode=1, override=3)
    metrics = PlannerMetrics()

    async def go():
        with EmbeddedRedis() as redis:
            loop = PlannerLoop(sla, target, redis.url, "t", metrics, profile)
            import redis.asyncio as aioredis
            client = aioredis.Redis.from_url(redis.url)
            await write_latency(client, "t", "fe", rec("fe", 0, range(0)))
            await loop.prime()
            # 400 requests of 2,000 prompt / 1,000 output tokens in one second: far past one worker
            now = time.time()
            big = LatencyRecord(60.0, {}, {}, "fe", 400, 4.0, 400,
                                [[i + 1, now - 0.5, 2000, 1000, 0] for i in range(400)],
                                [now - 1 + i / 400 for i in range(400)])
            await write_latency(client, "t", "fe", big)
            assert len((await read_latencies(client, "t"))[0].requests) == 400
            d = await loop.step()
            await client.aclose()
            await loop.close()
            return d
    d = asyncio.run(go())
    assert d.decode.desired > 1 and direction(d.decode) == "up"
    assert d.decode.desired <= 6                                   # the controller's max, read back
    (sent,) = target.sent
    n, why = sent["decode"]
    assert n == d.decode.desired and "up" in why and "override 3 holds" in why
    assert sent["prefill"][0] == 0                                 # a pool fixed at 0 stays there
    assert metrics.decisions.labels("decode", "up")._value.get() == 1
    assert metrics.estimate.labels("decode_desired")._value.get() == d.decode.desired


def test_bad_settings_are_refused_before_anything_starts():
    with pytest.raises(ValueError):
        check_sla(SlaConfig(ttft_ms=0))
    with pytest.raises(ValueError, match="cannot read profile"):
        check_sla(SlaConfig(profile="/nonexistent/profile.json"))
    # a mode choice beside serve's prefill minimum above 0: refused at start-up, not at each decision
    auto = SlaConfig(mode="auto")
    check_sla(auto)
    check_sla(auto, limits=PoolLimitsConfig(min_prefill_workers=0))
    with pytest.raises(ValueError, match="prefill pool's minimum at 0"):
        check_sla(auto, limits=PoolLimitsConfig(min_prefill_workers=1))


def test_set_pool_targets_through_the_admin_api():
    import grpc

    from pools.admin import start_admin_server
    from pools.book import PoolBook, PoolName, PoolSpec
    from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc

    class Ctl:                      # the admin API's view of a controller: its book and what it reports
        name = "serve"

        def __init__(self):
            self.book = PoolBook({PoolName.DECODE: PoolSpec(1, 1, 4), PoolName.PREFILL: PoolSpec(0, 0, 0)})

        def set_target(self, pool, n, why):
            self.book.set_target(pool, n, why)

        def pools(self):
            from pools.controller import PoolRow
            return [PoolRow(p, str(p), s) for p, s in self.book.pools.items()]

        async def latency(self):
            return {}

        def rows(self):
            return []

    async def go():
        ctl = Ctl()
        server, port = await start_admin_server(ctl, "127.0.0.1", 0, "tok")
        try:
            await checks(ctl, port)
        finally:
            await server.stop(None)

    async def checks(ctl, port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            req = admin_pb2.SetPoolTargetsRequest(targets=[admin_pb2.PoolTarget(pool="decode", desired=9,
                                                                                decision="9 wanted")])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.SetPoolTargets(req)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            md = [("authorization", "Bearer tok")]
            r = await stub.SetPoolTargets(req, metadata=md)
            decode = next(p for p in r.pools if p.pool == "decode")
            assert decode.desired == 4 and decode.last_decision == "9 wanted"      # within its max
            for bad, code in ((admin_pb2.PoolTarget(pool="gpu", desired=1), grpc.StatusCode.NOT_FOUND),
                              (admin_pb2.PoolTarget(pool="decode", desired=-1), grpc.StatusCode.INVALID_ARGUMENT),
                              (admin_pb2.PoolTarget(pool="decode", desired=1, decision="x" * 5000),
                               grpc.StatusCode.INVALID_ARGUMENT)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.SetPoolTargets(admin_pb2.SetPoolTargetsRequest(targets=[bad]), metadata=md)
                assert e.value.code() == code
            assert ctl.book.spec("decode").last_decision == "9 wanted"   # refusals change nothing
        # `splitserve planner`'s side of it
        target = AdminTarget(f"127.0.0.1:{port}", "tok")
        await target.set_targets({"decode": (2, "2 wanted")})
        views = await target.pools()
        assert views["decode"] == PoolView(0, 0, 0, 1, 4, None, 0) and ctl.book.spec("decode").desired == 2
        await target.close()
    asyncio.run(go())


def test_the_planner_sizes_prefill_for_the_queue_order_it_is_told():
    """`--prefill-order` reaches the core: on clumped arrivals, FIFO prefill queues need more workers
    than deadline-ordered ones (the deadline order sets a prompt past saving aside instead of
    letting it delay all behind it; tests/unit/planner/test_core.py has the model's side)."""
    from planner import Observation, Planner, PoolState, RequestSample
    from splitserve.cli import build_parser
    assert build_parser().parse_args(["planner", "--prefill-order", "fifo"]).command == "planner"
    wanted = {}
    for order in ("deadline", "fifo"):
        sla = SlaConfig(ttft_ms=2000, itl_ms=50, interval_s=30.0, prefill_order=order,
                        profile=str(CURVE_PROFILE_PATH))   # the curve whose steps the core test crosses
        profile = check_sla(sla)
        config = sla_planner_config(sla, profile)
        assert config.prefill_deadline is (order == "deadline")
        planner = Planner(config, profile)
        for i in range(1, 8):          # 600 arrivals of 2,000-token prompts per 30 s, in clumps of 20
            times = tuple(i * 30.0 - 30.0 + (k // 20) * 1.0 + (k % 20) * 0.01 for k in range(600))
            reqs = tuple(RequestSample(t, 2000, 100) for t in times)
            d = planner.decide(Observation(i * 30.0, 30.0, 600, PoolState(4), PoolState(2), reqs,
                                           arrival_times=times))
        wanted[order] = d.prefill.required
    assert wanted["fifo"] > wanted["deadline"] >= 1, wanted


def test_splitserve_planner_refuses_bad_settings(capsys):
    from splitserve.cli import main
    assert main(["planner", "--ttft-ms", "0", "--redis-url", "redis://127.0.0.1:1"]) == 2
    assert "positive" in capsys.readouterr().err


def test_requests_that_arrived_before_the_interval_do_not_break_a_decision():
    """Live, an interval's requests are those that finished in it: many arrived earlier."""
    from planner import Observation, Planner, PoolState, RequestSample
    sla = SlaConfig(ttft_ms=2000, itl_ms=50, interval_s=10.0)
    profile = check_sla(sla)
    planner = Planner(sla_planner_config(sla, profile), profile)
    reqs = tuple(RequestSample(95.0 + i * 0.1, 500, 100) for i in range(100))    # 95..105 s, interval 100..110
    d = planner.decide(Observation(110.0, 10.0, 60, PoolState(1), PoolState(1), reqs))
    assert d.decode.desired >= 1 and d.load.num_samples == 100
    # the burstiness comes from the arrival times when they are given (all 60 in one burst here)
    burst = tuple(100.5 + i * 0.001 for i in range(60))
    planner = Planner(sla_planner_config(sla, profile), profile)
    d = planner.decide(Observation(110.0, 10.0, 60, PoolState(1), PoolState(1), reqs, arrival_times=burst))
    assert d.load.burst_prefill > 5
