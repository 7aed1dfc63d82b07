"""A client that goes away stops its generation: the worker frees the request's KV blocks at once
instead of generating the remaining tokens for nobody.

Each test asks for far more tokens than it waits for; the frontend's generated-token counter shows
the generation really stopped early, and the worker's own status (found in Redis, read over gRPC)
shows nothing running and every block free.
"""

from __future__ import annotations

import re

import grpc
import httpx
import pytest

from proto.splitserve.v1 import generation_pb2 as pb
from proto.splitserve.v1 import generation_pb2_grpc as pb_grpc

from .conftest import until

pytestmark = pytest.mark.slow

MANY = 2000


def generated_tokens(cluster) -> float:
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return float(re.search(r"^splitserve_generation_tokens_total (\S+)$", text, re.M).group(1))


def running(cluster) -> int:
    return sum(s.num_running for s in cluster.worker_status())


def assert_ended_early(cluster, tokens_before: float) -> None:
    """The abandoned request ended (every block free again, its tokens in the metrics) long before
    its MANY tokens."""
    cluster.wait_idle(timeout_s=15)
    until(lambda: generated_tokens(cluster) > tokens_before, 10, what="the request to end in the metrics")
    assert generated_tokens(cluster) - tokens_before < MANY / 2


def body(model: str, stream: bool) -> dict:
    return {"model": model, "prompt": "def main():", "max_tokens": MANY, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def test_streaming_client_that_disconnects_frees_its_blocks(cluster, model_name):
    cluster.wait_idle()
    before = generated_tokens(cluster)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{cluster.url}/v1/completions", json=body(model_name, True)) as r:
            assert r.status_code == 200
            # one iterator kept alive: abandoning an httpx line iterator closes the connection itself
            lines = r.iter_lines()
            events = 0
            while events < 5:
                events += next(lines).startswith("data: ")
            assert running(cluster) == 1
            status = cluster.worker_status()[0]
            assert status.num_free_blocks < status.num_total_blocks
    # the connection is closed here, mid-stream
    assert_ended_early(cluster, before)


def test_non_streaming_client_that_times_out_frees_its_blocks(cluster, model_name):
    cluster.wait_idle()
    before = generated_tokens(cluster)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.url}/v1/completions", json=body(model_name, False), timeout=1.5)
    assert_ended_early(cluster, before)


def test_grpc_client_that_cancels_frees_its_blocks(cluster, model_name):
    cluster.wait_idle()
    before = generated_tokens(cluster)
    with grpc.insecure_channel(cluster.grpc_target) as ch:
        call = pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            model=model_name, text="def main():", sampling=pb.SamplingParams(
                temperature=0, max_tokens=MANY, ignore_eos=True)), timeout=60)
        for i, _ in enumerate(call):
            if i == 4:
                break
        assert running(cluster) == 1
        call.cancel()
    assert_ended_early(cluster, before)


def test_many_clients_disconnecting_at_once(cluster, model_name):
    cluster.wait_idle()
    with httpx.Client(timeout=30) as client:
        streams = [client.stream("POST", f"{cluster.url}/v1/completions", json=body(model_name, True))
                   for _ in range(6)]
        responses = [s.__enter__() for s in streams]
        lines = [r.iter_lines() for r in responses]
        for it in lines:
            next(it)
        until(lambda: running(cluster) == 6, 10, what="six requests running")
        for s in streams:
            s.__exit__(None, None, None)
    cluster.wait_idle(timeout_s=20)
    # and the cluster serves normally afterwards
    r = httpx.post(f"{cluster.url}/v1/completions", json={**body(model_name, False), "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
