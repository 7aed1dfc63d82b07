"""Shared fixtures for the multi-process tests (the cluster helper itself is tests/integration/cluster.py).

The session-wide `cluster` owns its Redis server (an EmbeddedRedis passed as --redis-url), so tests
can find the workers in Redis and ask them for their status over gRPC, as an operator would.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster import ROOT, Cluster, start_cluster, until  # noqa: F401 (re-exported)
from runtime.redis_embedded import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis() as r:
        yield r


@pytest.fixture(scope="session")
def _session_cluster(tmp_path_factory, redis_server) -> Cluster:
    # async scheduling as on a GPU (the CPU default is off; the qwen2 parity and disaggregation
    # clusters keep that default), so the API tests run the overlapped engine loop
    c = start_cluster(tmp_path_factory.mktemp("cluster"), "--model", "tiny", "--max-num-batched-tokens", "64",
                      "--async-scheduling", "on", redis_url=redis_server.url)
    yield c
    assert c.stop() == 0, c.log()[-3000:]


@pytest.fixture
def cluster(_session_cluster) -> Cluster:
    """The shared cluster of the API tests: tiny llama on the CPU, small step budget (so that
    prompts of a few hundred tokens are prefilled in chunks), Redis owned by the test. Checked
    alive before each test, so that a cluster that died shows its log instead of 'connection refused'."""
    c = _session_cluster
    assert c.proc.poll() is None, f"the shared cluster exited with {c.proc.returncode}:\n{c.log()[-3000:]}"
    return c


@pytest.fixture(scope="session")
def model_name(_session_cluster) -> str:
    return httpx.get(f"{_session_cluster.url}/v1/models").json()["data"][0]["id"]
