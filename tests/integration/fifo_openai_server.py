"""A plain OpenAI-compatible completions server whose goodput is known in closed form (not Splitserve).

It has `queues` servers, each serving one request at a time, first come first served, and sends
each request to one of them at random. A request waits for its server, then its first token comes
`prefill_ms` after it got the server and each further token `token_ms` after the one before (times
kept against absolute deadlines, so sleeps do not drift). The server is free again when the last
token is out: every request holds it D = prefill + (max_tokens - 1) * token seconds. Random
routing splits Poisson arrivals at rate c L into c Poisson streams of rate L, so each server is an
M/D/1 queue, whose waiting time W has Erlang's distribution (for L * D < 1):

    P(W <= t) = (1 - L D) * sum over k = 0 .. floor(t / D) of (L (k D - t))^k / k! * e^(-L (k D - t))

A request's TTFT is W + prefill and its mean ITL is token_ms, so with an ITL target above token_ms
the share meeting TTFT <= X is P(W <= X - prefill), and the goodput at attainment A is the L where
that equals A (`closed_form_goodput`), times c. `GET /stats` tells how long requests really held
their server (sleeps run late on a loaded machine).

Run: python -m tests.integration.fifo_openai_server --port 8100 --queues 4 --prefill-ms 40 --token-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def md1_wait_cdf(rate: float, service_s: float, t_s: float) -> float:
    """P(W <= t) in a FIFO M/D/1 queue (0 when the queue is unstable)."""
    rho = rate * service_s
    if rho >= 1 or t_s < 0:
        return 0.0
    total = 0.0
    for k in range(int(math.floor(t_s / service_s)) + 1):
        x = rate * (k * service_s - t_s)
        total += x ** k / math.factorial(k) * math.exp(-x)
    return (1 - rho) * total


def closed_form_goodput(service_s: float, wait_budget_s: float, attainment: float) -> float:
    """The rate at which exactly `attainment` of the requests wait at most `wait_budget_s`."""
    lo, hi = 0.0, 1.0 / service_s
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if md1_wait_cdf(mid, service_s, wait_budget_s) >= attainment else (lo, mid)
    return lo


def create_app(queues: int, prefill_s: float, token_s: float, seed: int = 0):
    app = FastAPI()
    servers = [asyncio.Lock() for _ in range(queues)]     # FIFO: waiters are woken in the order they came
    pick = random.Random(seed)       # independent of the arrivals: each server sees a Poisson stream
    held_s: list[float] = []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fifo-model", "max_model_len": 1 << 20}]}

    @app.get("/stats")
    async def stats():
        return {"requests": len(held_s), "mean_held_s": sum(held_s) / len(held_s) if held_s else None}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        prompt_tokens = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())

        server = pick.choice(servers)

        async def stream():
            loop = asyncio.get_running_loop()
            async with server:
                start = loop.time()
                for i in range(n):
                    await asyncio.sleep(max(0.0, start + prefill_s + i * token_s - loop.time()))
                    chunk = {"id": "fifo", "object": "text_completion",
                             "choices": [{"index": 0, "text": " t", "token_ids": [i % 100],
                                          "finish_reason": "length" if i == n - 1 else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                held_s.append(loop.time() - start)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield f"data: {json.dumps({'id': 'fifo', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--queues", type=int, default=1)
    p.add_argument("--prefill-ms", type=float, required=True)
    p.add_argument("--token-ms", type=float, required=True)
    a = p.parse_args()
    uvicorn.run(create_app(a.queues, a.prefill_ms / 1000, a.token_ms / 1000), host="127.0.0.1", port=a.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
