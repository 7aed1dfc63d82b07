"""prompt_cache_key end to end: an OpenAI request's key keeps a session on one mock worker.

Three mock decode workers, the real frontend and router, real Redis. Unrelated prompts sent one at
a time cost every idle worker the same, so without a hint the router spreads them; with one
prompt_cache_key they all land where the key's first request went (the workers' own counts say
where each prompt was admitted).
"""

from __future__ import annotations

import httpx
import numpy as np

from tests.integration.cluster import own_cluster


def test_prompt_cache_key_pins_a_session_to_one_worker(tmp_path):
    with own_cluster("--mock", "--model", "tiny", "--decode-workers", "3", "--prefill-workers", "0",
                     "--block-size", "16", tmp_dir=tmp_path) as c:
        rng = np.random.default_rng(0)
        with httpx.Client(base_url=c.url, timeout=30) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for i in range(8):
                r = client.post("/v1/completions", json={
                    "model": model, "prompt": rng.integers(0, 200, 96).tolist(), "max_tokens": 2,
                    "ignore_eos": True, "prompt_cache_key": "session-1"})
                assert r.status_code == 200, r.text
            bad = client.post("/v1/completions", json={"model": model, "prompt": [1, 2], "max_tokens": 1,
                                                        "prompt_cache_key": "k" * 1000})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_key"
        served = {s.worker_id: s.num_prompt_tokens for s in c.wait_idle()}
        assert sorted(served.values()) == [0, 0, 8 * 96], served
