"""`splitserve serve --mock --planner`: the SLA planner scales the decode pool up under a load that
rises and down once it falls, with no failed request (real Redis, frontend, router, controller and
local connector; mock workers timed by a slow profile that both the mock and the planner read).

The profile makes one worker hold 2 sequences (max_num_seqs 2) at ~25 ms a step, so that ~5
requests a second of 40 tokens keep ~3 workers busy at the 100 ms ITL target, small enough for
the 2-core CI machine. Then: an override from `pools scale` holds against the planner until
`pools release`; `pools status` shows the last decision; /metrics counts the decisions.
"""

from __future__ import annotations

import asyncio
import json
import time


import grpc
import httpx
import pytest

from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc
from runtime.admin_auth import read_token_file
from tests.integration.cluster import assert_clean_log, metric, own_cluster, until
from tests.integration.streams import prompts, stream_one

pytestmark = pytest.mark.slow

PROFILE = {"format": 2, "name": "slow-mock", "curve": {"base_s": 0.02, "per_token_s": 5e-5},
           "max_num_seqs": 2, "startup_s": 3.0}
MAX_TOKENS = 40
RATE_RPS = 5.0


def planner_cluster(tmp_path, *argv: str):
    """`serve --mock --planner` on the slow mock profile (workers and planner alike), one decode
    worker of at most 4 running 2 sequences each, 1 s decisions, short drains and leases; `argv`
    adds the prefill pool and the rest."""
    profile = tmp_path / "slow-mock.json"
    profile.write_text(json.dumps(PROFILE))
    return own_cluster("--mock", "--decode-workers", "1", "--max-decode-workers", "4", "--max-num-seqs", "2",
                       "--mock-profile", str(profile), "--planner", "--planner-profile", str(profile),
                       "--ttft-ms", "2000", "--itl-ms", "100", "--planner-interval-s", "1",
                       "--drain-timeout-s", "10", "--lease-ttl-s", "2", *argv, tmp_dir=tmp_path)


def pool(cluster, name: str) -> admin_pb2.PoolStatus:
    with grpc.insecure_channel(cluster.admin_url) as ch:
        md = [("authorization", f"Bearer {read_token_file(cluster.admin_port)}")]
        r = admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.GetStatusRequest(), metadata=md, timeout=10)
    return next(p for p in r.pools if p.pool == name)


async def load(url: str, rate_rps: float, duration_s: float, lengths: tuple[int, int] = (20, 60),
               seed: int = 3) -> list:
    """Open-loop arrivals at `rate_rps` for `duration_s`; every stream's outcome."""
    rng_prompts = prompts(int(rate_rps * duration_s) + 1, seed=seed, lengths=lengths)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as client:
        tasks = []
        t0 = time.monotonic()
        for i, p in enumerate(rng_prompts):
            await asyncio.sleep(max(t0 + i / rate_rps - time.monotonic(), 0))
            tasks.append(asyncio.create_task(stream_one(client, url, p, MAX_TOKENS)))
        return await asyncio.gather(*tasks)


def load_watching(cluster, pools: tuple[str, ...], watch, rate_rps: float, duration_s: float, **kw) -> list:
    """`load` on the cluster while `watch` gets the named pools' status (a dict by name) every 0.5 s."""
    async def run() -> list:
        stop = asyncio.Event()

        async def poll() -> None:
            while not stop.is_set():
                status = await asyncio.gather(*(asyncio.to_thread(pool, cluster, name) for name in pools))
                watch(dict(zip(pools, status)))
                await asyncio.sleep(0.5)

        poller = asyncio.create_task(poll())
        try:
            return await load(cluster.url, rate_rps, duration_s, **kw)
        finally:
            stop.set()
            await poller

    return asyncio.run(run())


def test_the_planner_scales_decode_up_and_down_with_no_failed_request(tmp_path):
    with planner_cluster(tmp_path, "--prefill-workers", "0") as c:
        peak = {"desired": 1, "ready": 1}

        def watch(status: dict) -> None:
            d = status["decode"]
            peak["desired"], peak["ready"] = max(peak["desired"], d.desired), max(peak["ready"], d.ready)

        streams = load_watching(c, ("decode",), watch, RATE_RPS, 15.0)
        bad = [s for s in streams if not s.ok or len(s.tokens) != MAX_TOKENS]
        assert not bad, f"{len(bad)} of {len(streams)} requests failed: {bad[:3]}"
        assert peak["desired"] >= 2 and peak["ready"] >= 2, (peak, c.log()[-3000:])
        # the load is gone: back to one worker (down delay = the profile's 3 s start-up)
        until(lambda: pool(c, "decode").desired == 1 and pool(c, "decode").ready == 1, 60, 0.5,
              "the decode pool back at 1 after the load")
        d = pool(c, "decode")
        assert "down" in d.last_decision or "hold" in d.last_decision, d.last_decision
        assert metric(c.url, "splitserve_planner_decisions_total", pool="decode", direction="up") >= 1
        assert metric(c.url, "splitserve_planner_decisions_total", pool="decode", direction="down") >= 1
        out = c.cli("pools", "status").stdout
        assert "LAST DECISION" in out and "need" in out, out

        # an operator's override wins over the planner until released
        c.cli("pools", "scale", "--decode", "2")
        until(lambda: pool(c, "decode").ready == 2, 30, 0.5, "the override's second worker")
        time.sleep(3.0)                                   # three planner decisions that want 1
        d = pool(c, "decode")
        assert d.desired == 2 and d.HasField("override") and "override 2 holds" in d.last_decision, d
        c.cli("pools", "release")
        until(lambda: pool(c, "decode").desired == 1, 20, 0.5, "the planner's size after the release")
    log = c.log()
    assert "planner: t=" in log, log[-3000:]
    assert_clean_log(log)


def test_splitserve_planner_drives_a_serve_through_its_admin_api(tmp_path):
    """`splitserve planner` as its own process: it reads the frontends' load from Redis, decides,
    and sets the pools through serve's admin API (token from the file serve wrote); its decisions
    show in `pools status` and on its own /metrics; SIGTERM stops it cleanly."""
    import signal
    import subprocess
    import sys

    from runtime.redis_embedded import free_port
    from tests.integration.cluster import ROOT

    with own_cluster("--mock", "--prefill-workers", "0", "--decode-workers", "1", tmp_dir=tmp_path) as c:
        mport = free_port()
        log = open(tmp_path / "planner.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "splitserve", "planner", "--redis-url", c.redis_url,
                                 "--admin-address", c.admin_url, "--ttft-ms", "2000", "--itl-ms", "50",
                                 "--planner-interval-s", "1", "--metrics-port", str(mport)],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        def planner_log() -> str:
            return (tmp_path / "planner.log").read_text(errors="replace")[-3000:]
        try:
            try:
                until(lambda: "need" in pool(c, "decode").last_decision, 60, 0.5, "the planner's first decision")
            except AssertionError as e:
                raise AssertionError(f"{e}\nplanner log:\n{planner_log()}") from None
            assert pool(c, "decode").desired == 1, planner_log()   # no load: it holds what there is
            assert metric(f"http://127.0.0.1:{mport}", "splitserve_planner_decisions_total", pool="decode") >= 1
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
            log.close()
        text = planner_log()
        assert code == 0 and "planner: t=" in text and "Traceback" not in text, text[-3000:]


def test_mock_workers_serve_disaggregated_through_nixl(tmp_path):
    """`serve --mock --prefill-workers 1`: the mock runner's small KV cache goes through the real
    path (the prefill worker computes the prompt on the timing model and pushes its blocks over
    NIXL into the blocks the decode worker reserved), as the planner's simulator models it; every
    prompt long enough goes remote and every handoff completes."""
    from kvstore.movers.transfer import nixl_available

    if not nixl_available():
        pytest.skip("NIXL is not installed")
    with own_cluster("--mock", "--prefill-workers", "1", "--decode-workers", "1", tmp_dir=tmp_path) as c:
        async def run() -> list:
            async with httpx.AsyncClient() as client:
                return [await stream_one(client, c.url, p, 8) for p in prompts(6, seed=5, lengths=(200, 400))]

        streams = asyncio.run(run())
        bad = [s for s in streams if not s.ok or len(s.tokens) != 8]
        assert not bad, f"{len(bad)} of {len(streams)} requests failed: {bad[:3]}"
        assert metric(c.url, "splitserve_prefill_remote_total") == 6
        assert metric(c.url, "splitserve_kv_handoffs_total") == 6
        assert metric(c.url, "splitserve_prefill_fallback_total") == 0
    assert_clean_log(c.log())


def test_the_planner_switches_to_aggregated_serving_without_cutting_a_request(tmp_path):
    """`serve --mock --planner --planner-mode auto`, started disaggregated (one prefill and one
    decode worker): on prompts of a few hundred tokens with 40 out, aggregated serving needs fewer
    GPUs on this profile, so the planner switches to it and drains the prefill pool to 0 once the
    decode pool can take the prompts. The prompts long enough to go remote before the switch
    (over NIXL) and every request after it complete with all their tokens."""
    from kvstore.movers.transfer import nixl_available

    if not nixl_available():
        pytest.skip("NIXL is not installed")
    with planner_cluster(tmp_path, "--prefill-workers", "1", "--planner-mode", "auto") as c:
        seen = {"prefill_ready": [], "decode_ready": []}

        def watch(status: dict) -> None:
            seen["prefill_ready"].append(status["prefill"].ready)
            seen["decode_ready"].append(status["decode"].ready)

        streams = load_watching(c, ("prefill", "decode"), watch, 3.0, 15.0, lengths=(150, 400), seed=4)
        bad = [s for s in streams if not s.ok or len(s.tokens) != MAX_TOKENS]
        assert not bad, f"{len(bad)} of {len(streams)} requests failed or came back short: {bad[:3]}"
        until(lambda: pool(c, "prefill").ready == 0 and pool(c, "prefill").desired == 0, 30, 0.5,
              "the prefill pool drained to 0")
        assert 1 in seen["prefill_ready"] and 0 in seen["prefill_ready"], seen    # drained under load
        assert max(seen["decode_ready"]) >= 2, seen
        assert metric(c.url, "splitserve_prefill_remote_total") >= 1               # went remote before
        assert metric(c.url, "splitserve_prefill_local_total", reason="no_prefill_pool") >= 1   # ... and after
    log = c.log()
    assert "mode aggregated (first" in log or "mode aggregated (switch" in log, log[-3000:]
    assert_clean_log(log)
