"""Workers started by hand beside a `splitserve serve` cluster, as an operator would on other
machines: the frontend refuses one with another block size and one with another model (one log
line each, however many discovery polls pass; /health does not count them), and takes one that
binds every interface at the address it advertises."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from runtime.redis_embedded import EmbeddedRedis
from tests.integration.cluster import ROOT, start_cluster, until

pytestmark = pytest.mark.slow


def test_the_frontend_refuses_workers_that_disagree_and_reaches_advertised_ones(tmp_path):
    with EmbeddedRedis() as redis:
        c = start_cluster(tmp_path, "--mock", "--prefill-workers", "0", redis_url=redis.url)
        extra: list[subprocess.Popen] = []

        def worker(name: str, *args: str) -> None:
            with open(tmp_path / f"{name}.log", "wb") as log:
                extra.append(subprocess.Popen(
                    [sys.executable, "-m", "splitserve", "decode-worker", "--mock", "--role", "aggregated",
                     "--redis-url", redis.url, "--worker-id", name, *args],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))

        def health() -> dict:
            return httpx.get(f"{c.url}/health", timeout=5).json()
        try:
            worker("big-blocks", "--block-size", "32")
            worker("other-model", "--model", "tiny-qwen2")
            worker("advertised", "--host", "0.0.0.0", "--advertise-host", "127.0.0.1")
            # ready, not only registered: a worker is in Redis while it still loads (three at once
            # on a loaded CI machine took over 10 s), and the frontend admits or refuses only ready ones
            until(lambda: sum(w.ready for w in c.workers()) == 4, 90, 0.2, "four ready workers in Redis")
            until(lambda: health()["workers"] == 2, 10, 0.1, "the advertised worker in the pool")
            time.sleep(2.0)                          # four more discovery polls
            assert health()["workers"] == 2
            refusals = [line for line in c.log().splitlines() if "refusing worker" in line]
            assert len(refusals) == 2, refusals
            (big,) = [line for line in refusals if "big-blocks-" in line]
            assert "its KV block size is 32 tokens, this frontend's is 16 (from worker aggregated-0-" in big
            (other,) = [line for line in refusals if "other-model-" in line]
            assert "it serves another model" in other and "tiny-qwen2" in other

            (adv,) = [w for w in c.workers() if w.worker_id.startswith("advertised-")]
            assert adv.address.startswith("127.0.0.1:"), adv
            for _ in range(4):                       # both accepted workers serve (round robin or not)
                r = httpx.post(f"{c.url}/v1/completions", timeout=30,
                               json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
                assert r.status_code == 200, r.text
        finally:
            for p in extra:
                p.terminate()
            for p in extra:
                p.wait(30)
            assert c.stop() == 0, c.log()[-3000:]
