"""Disaggregated serving: token-identical to aggregated, and surviving kill -9 of any worker.

Real processes (`splitserve serve`), real Redis, real gRPC, real NIXL transfers (UCX over host
memory). Prompts go in as token ids with greedy decoding, so every mode must produce exactly the
same tokens.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time

import httpx
import pytest

pytest.importorskip("nixl")

from tests.integration.cluster import own_cluster, until  # noqa: E402

pytestmark = pytest.mark.slow


def parity_prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    """1–300 tokens; half share a 150-token prefix so prefix-cache hits happen."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 4000) for _ in range(150)]
    lengths = [1, 5, 17, 33, 64, 100, 150, 160, 200, 250, 300, 290, 48, 16, 3, 280]
    out = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        if i % 2 and length > 150:
            out.append(shared + [rng.randrange(10, 4000) for _ in range(length - 150)])
        else:
            out.append([rng.randrange(10, 4000) for _ in range(length)])
    return out


async def _complete(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[int]:
    r = await client.post(f"{url}/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


async def complete_all(url: str, prompts: list[list[int]], max_tokens: int,
                       during=None) -> list[list[int]]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts))) as client:
        tasks = [asyncio.create_task(_complete(client, url, p, max_tokens)) for p in prompts]
        if during is not None:
            await during()
        return await asyncio.gather(*tasks)


async def complete_each(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """One request at a time: every step's batch has the same shape on both sides of a comparison."""
    async with httpx.AsyncClient() as client:
        return [await _complete(client, url, p, max_tokens) for p in prompts]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with own_cluster("--prefill-workers", "0", "--max-num-batched-tokens", "64") as c:
        return asyncio.run(complete_all(c.url, parity_prompts(), 32))


@pytest.mark.parametrize("prefill,decode,scheduling", [(1, 1, "off"), (2, 2, "on")])
def test_disaggregated_matches_aggregated(reference, prefill, decode, scheduling):
    """Also with async scheduling on both sides (the GPU default; the reference runs without)."""
    with own_cluster("--prefill-workers", str(prefill), "--decode-workers", str(decode),
                     "--remote-prefill-min-tokens", "1", "--max-num-batched-tokens", "64",
                     "--async-scheduling", scheduling) as c:
        got = asyncio.run(complete_all(c.url, parity_prompts(), 32))
        assert got == reference
        assert metric(c.url, "splitserve_prefill_remote_total") >= 8
        assert metric(c.url, "splitserve_kv_transfer_bytes_total") > 0
        assert metric(c.url, "splitserve_kv_handoffs_total") >= 8
        c.wait_idle()


def test_fp8_kv_cache_disaggregated_matches_aggregated(reference):
    """fp8 KV blocks (a quarter of the CPU's float32 bytes) cross from prefill to decode workers
    intact: the same tokens as one aggregated fp8 worker (which differ from float32's somewhere:
    the flag reached the workers). One request at a time: the CPU's matmuls round a row differently
    with the batch's shape, and an fp8 rounding step turns a last-bit difference into a different
    token now and then (about 1 run in 12 when the requests were concurrent)."""
    fp8 = ("--kv-cache-dtype", "fp8", "--max-num-batched-tokens", "64")
    with own_cluster("--prefill-workers", "0", *fp8) as c:
        want = asyncio.run(complete_each(c.url, parity_prompts(), 32))
    assert want != reference
    with own_cluster("--prefill-workers", "1", "--decode-workers", "1", "--remote-prefill-min-tokens", "1",
                     *fp8) as c:
        assert asyncio.run(complete_each(c.url, parity_prompts(), 32)) == want
        assert metric(c.url, "splitserve_kv_handoffs_total") >= 8
        c.wait_idle()


def fault_prompts(n: int = 50, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(40, 200))] for _ in range(n)]


@pytest.fixture(scope="module")
def fault_reference() -> list[list[int]]:
    with own_cluster("--prefill-workers", "0") as c:
        return asyncio.run(complete_all(c.url, fault_prompts(), 24))


@pytest.mark.parametrize("victim", ["prefill-worker", "decode-worker"])
def test_kill_worker_under_load(fault_reference, victim):
    with own_cluster("--prefill-workers", "2", "--decode-workers", "2", "--remote-prefill-min-tokens", "1",
                     "--max-num-batched-tokens", "256", "--lease-ttl-s", "2") as c:
        name = "prefill-0" if victim == "prefill-worker" else "decode-0"
        (pid,) = c.child_pids(f"/{name}.json")      # serve runs it with --config DIR/NAME.json
        (info,) = [w for w in c.workers() if w.worker_id.startswith(name + "-")]

        def busy() -> bool:
            return any(s.worker_id == info.worker_id and s.num_running > 0 for s in c.worker_status())

        async def kill_soon():
            # kill it while it is working on requests, not before or after
            deadline = time.monotonic() + 30
            while not await asyncio.to_thread(busy):
                assert time.monotonic() < deadline, "the victim never got work"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            os.kill(pid, signal.SIGKILL)

        got = asyncio.run(complete_all(c.url, fault_prompts(), 24, during=kill_soon))
        assert got == fault_reference
        # the dead worker leaves the pool when its lease expires, serve starts a replacement under its
        # name, and every worker returns to idle
        deadline = time.monotonic() + 15
        while info.worker_id in {w.worker_id for w in c.workers()} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert info.worker_id not in {w.worker_id for w in c.workers()}
        until(lambda: sorted(w.name for w in c.workers() if w.ready) == ["decode-0", "decode-1", "prefill-0",
                                                                         "prefill-1"], 60, 0.2, "a replacement")
        statuses = c.wait_idle()
        assert all(s.num_free_blocks == s.num_total_blocks for s in statuses)
        if victim == "decode-worker":
            assert metric(c.url, "splitserve_request_migrations_total") >= 1
        else:   # the decode side's handoffs to the dead worker fell back to local prefill
            assert metric(c.url, "splitserve_prefill_fallback_total") >= 1
