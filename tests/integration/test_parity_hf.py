"""Correctness: greedy tokens from a running cluster equal HF transformers' `generate`, token for token.

20 token-id prompts of 1-300 tokens go over HTTP concurrently (so they share engine steps), with a
step budget of 64 tokens (so long prompts are prefilled in chunks); a second wave reuses long
prefixes of the first (so prefix-cache hits happen). HF runs the same model directory in float32
with EOS disabled. The llama cluster runs with async scheduling, the qwen2 one without.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from splitserve.models import cache_dir
from splitserve.tiny_model import PAD_ID

from .conftest import start_cluster

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
LENGTHS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 160, 200, 240, 280, 300)
VOCAB = 4096


def make_prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    first = [[rng.randrange(5, VOCAB) for _ in range(n)] for n in LENGTHS]
    by_len = {len(p): p for p in first}
    extra = lambda n: [rng.randrange(5, VOCAB) for _ in range(n)]  # noqa: E731
    second = [by_len[300][:200] + extra(50),      # a long shared prefix, new tail
              by_len[280][:250] + extra(30),
              by_len[240] + extra(10),            # the whole earlier prompt + more
              list(by_len[160])]                  # the same prompt again (last block recomputed)
    return first, second


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2"])
def parity_cluster(request, tmp_path_factory):
    if request.param == "tiny":
        yield request.getfixturevalue("_session_cluster"), cache_dir() / "models" / "tiny-llama-seed0"
        return
    redis = request.getfixturevalue("redis_server")
    c = start_cluster(tmp_path_factory.mktemp("qwen2"), "--model", "tiny-qwen2", "--max-num-batched-tokens", "64",
                      "--namespace", "parity-qwen2", redis_url=redis.url)
    c.namespace = "parity-qwen2"
    yield c, cache_dir() / "models" / "tiny-qwen2-seed0"
    assert c.stop() == 0


def complete(client: httpx.Client, model: str, prompt) -> dict:
    r = client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True,
        "return_token_ids": True}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


class StatusWatcher:
    """Polls the workers' status while a wave runs: the most requests seen running at once."""

    def __init__(self, cluster) -> None:
        self.cluster, self.max_running, self._stop = cluster, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.max_running = max([self.max_running] + [s.num_running for s in self.cluster.worker_status()])
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def hf_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    """HF greedy continuations, all prompts in one left-padded batch (64 forward passes instead of
    64 per prompt). Padding must not change a token: checked here against unpadded single-prompt
    runs of the shortest and the longest prompt (and, when written, for every prompt of both models)."""
    transformers = pytest.importorskip("transformers")
    import torch
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None      # generate exactly NEW_TOKENS, like ignore_eos

    def generate(ids, mask):
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=PAD_ID)[:, ids.shape[1]:].tolist()

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD_ID)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    batched = generate(ids, mask)
    for row in (min(range(len(prompts)), key=lambda r: len(prompts[r])),
                max(range(len(prompts)), key=lambda r: len(prompts[r]))):
        alone = torch.tensor([prompts[row]])
        assert generate(alone, torch.ones_like(alone))[0] == batched[row], "left padding changed HF's tokens"
    return batched


def test_greedy_tokens_equal_hf_generate(parity_cluster):
    cluster, model_dir = parity_cluster
    first, second = make_prompts(seed=11)
    with httpx.Client(base_url=cluster.url) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        before = cluster.worker_status()[0]
        with StatusWatcher(cluster) as watch, ThreadPoolExecutor(len(first)) as ex:
            wave1 = list(ex.map(lambda p: complete(client, model, p), first))
        mid = cluster.worker_status()[0]
        # the second wave: several prompts in one request, sharing prefixes with the first wave
        wave2 = complete(client, model, second)
        after = cluster.worker_status()[0]

    choices = [r["choices"][0] for r in wave1] + sorted(wave2["choices"], key=lambda c: c["index"])
    prompts = first + second
    expected = hf_greedy(model_dir, prompts)
    mismatches = []
    for i, (p, c, e) in enumerate(zip(prompts, choices, expected)):
        assert c["prompt_token_ids"] == p
        assert c["finish_reason"] == "length"
        if c["token_ids"] != e:
            at = next(j for j, (a, b) in enumerate(zip(c["token_ids"], e)) if a != b)
            mismatches.append(f"prompt {i} ({len(p)} tokens): first difference at output token {at}")
    assert not mismatches, mismatches

    for r, p in zip(wave1, first):
        assert r["usage"]["prompt_tokens"] == len(p) and r["usage"]["completion_tokens"] == NEW_TOKENS
    # prefix caching really happened: every second-wave prompt reused whole blocks of the first
    assert wave2["usage"]["prompt_tokens"] == sum(map(len, second))
    assert wave2["usage"]["prompt_tokens_details"]["cached_tokens"] == 192 + 240 + 240 + 144
    assert after.num_prefix_hit_tokens - mid.num_prefix_hit_tokens == 192 + 240 + 240 + 144
    assert mid.num_prompt_tokens - before.num_prompt_tokens == sum(map(len, first))
    # continuous batching really happened: requests shared engine steps
    assert watch.max_running >= 2, watch.max_running
    # chunked prefill really happened: 300-token prompts cannot pass a 64-token step budget whole
    assert "--max-num-batched-tokens" in cluster.argv and max(LENGTHS) > 64
    cluster.wait_idle()
