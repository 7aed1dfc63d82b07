"""The frontend's edges without a cluster: the tokenizer pool keeps the event loop free and refuses
when its queue is full, and a stream that fails after its headers ends with an SSE error event.

The stream test drives the real FastAPI app (frontend/http_api.py) in-process; its generator is a
stand-in that fails after one delta, the one failure a real cluster cannot be made to produce on cue.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from frontend.auth import ApiKey
from frontend.generate import Delta
from frontend.http_api import create_app
from frontend.state import FrontendState
from frontend.tokenizer import ModelTokenizer, TokenizerPool
from runtime.errors import InvalidRequest, Overloaded
from runtime.metrics import FrontendMetrics
from splitserve.models import resolve_model


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer(resolve_model("tiny"))


async def test_a_full_tokenizer_queue_refuses_with_429():
    release = threading.Event()
    pool = TokenizerPool(None, threads=1, max_pending=2)
    jobs = [asyncio.ensure_future(pool.run(release.wait, 10)) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(Overloaded) as e:
        await pool.run(release.wait, 10)
    assert e.value.http_status == 429
    jobs[0].cancel()              # a client that left: its job still counts until its thread is done
    await asyncio.sleep(0.05)
    with pytest.raises(Overloaded):
        await pool.run(release.wait, 10)
    release.set()
    assert await jobs[1] is True
    await asyncio.sleep(0.05)
    assert pool.pending == 0 and await pool.run(lambda: 7) == 7
    pool.close()


async def test_tokenizing_a_huge_prompt_leaves_the_event_loop_free(tok):
    pool = TokenizerPool(tok, threads=1, max_pending=4)
    text = "hello world, some text 12345 ünïcode. " * 25_000        # ~1 MB
    job = asyncio.ensure_future(pool.encode(text, max_tokens=None))
    gaps, last = [], time.perf_counter()
    while not job.done():
        await asyncio.sleep(0.002)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    assert len(await job) > 100_000
    # many wake-ups while the Rust tokenizer works (on the loop it would be one long gap)
    assert len(gaps) > 20, gaps
    with pytest.raises(InvalidRequest, match="context length"):
        await pool.encode(text, max_tokens=2048)
    pool.close()


def test_a_prompt_far_beyond_the_context_is_refused_from_a_prefix(tok):
    text = "hello world, some text 12345. " * 135_000                   # ~4 MB, ~1.6 M tokens
    t = time.perf_counter()
    with pytest.raises(InvalidRequest, match="context length is 2048 tokens; the prompt has more than") as e:
        tok.encode(text, max_tokens=2048)
    assert time.perf_counter() - t < 0.5            # whole, it takes seconds
    assert e.value.param == "prompt"


@pytest.mark.parametrize("unit", ["        return self._value\n", " " * 64 + "x\n", "hello world, 12345. "],
                         ids=["code (5 chars a token)", "whitespace runs (16)", "prose (2.5)"])
def test_the_prefix_never_refuses_what_fits(tok, unit):
    limit = 512
    whole = unit * (limit * 20 // len(unit) + 1)
    ids = tok.encode(whole)
    for n in (limit - 1, limit, limit + 1, limit + 40):
        # the longest text of at most n tokens
        lo, hi = 0, len(whole)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if len(tok.encode(whole[:mid])) <= n else (lo, mid - 1)
        text = whole[:lo]
        if n < limit:
            assert tok.encode(text, max_tokens=limit) == tok.encode(text)
        else:
            with pytest.raises(InvalidRequest, match="context length"):
                tok.encode(text, max_tokens=limit)
    assert len(ids) > limit


class FailingGenerator:
    """Yields one delta, then fails with an error that is not a SplitserveError."""
    pool = None
    shutting_down = False

    def check_prompt(self, prompt, max_tokens, default_max):
        return max_tokens or 4

    def context_limit(self):
        return 2048

    async def generate(self, inp):
        yield Delta([5], "hi")
        raise RuntimeError("the worker connection broke")

    async def stream(self, inp, on_delta):      # the pushed path (frontend/sse.py)
        on_delta(Delta([5], "hi"))
        raise RuntimeError("the worker connection broke")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [1, 2, 3]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"prompt": [1, 2, 3], "n": 2}),          # the general path (several choices)
])
async def test_a_stream_failing_after_its_headers_ends_with_an_error_event(tok, path, body):
    state = FrontendState(generator=FailingGenerator(), tokenizer=tok, metrics=FrontendMetrics(),
                          model_name="tiny", api_key=ApiKey(None), max_body_bytes=1 << 20,
                          tokenize=TokenizerPool(tok, 1, 4))
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.post(path, json={"model": "tiny", "stream": True, "max_tokens": 4, **body})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and error["type"] == "internal_error" and "RuntimeError" in error["message"]
    state.tokenize.close()
