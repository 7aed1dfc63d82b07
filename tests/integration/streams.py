"""Clients for the integration tests. Streams for the lifecycle tests: many concurrent
`/v1/completions` streams, each one's outcome told apart exactly — finished with all its tokens,
ended by an in-band error event, or cut (the connection closed without either). Plain token-id
completions for the parity tests."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field

import httpx


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict | None = None          # an in-band error event
    done: bool = False                 # saw `data: [DONE]`
    cut: str | None = None             # the connection failed (an exception's name), or an HTTP status

    @property
    def ok(self) -> bool:
        return self.done and self.error is None and self.cut is None and self.finish_reason == "length"

    @property
    def ended_cleanly(self) -> bool:
        """Finished, or told the client why not: never cut."""
        return self.cut is None and self.done and (self.finish_reason is not None or self.error is not None)


def prompts(n: int, seed: int = 0, lengths: tuple[int, int] = (20, 200)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> Stream:
    s = Stream()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
            if r.status_code != 200:
                s.cut = f"http_{r.status_code}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    s.done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    s.error = obj["error"]
                    continue
                choice = obj["choices"][0]
                s.tokens += choice.get("token_ids") or []
                s.finish_reason = choice["finish_reason"] or s.finish_reason
    except httpx.HTTPError as e:
        s.cut = type(e).__name__
    return s


async def stream_all(url: str, prompt_list: list[list[int]], max_tokens: int | list[int], during=None) -> list[Stream]:
    """Every prompt as a concurrent stream; `during()` (a coroutine function) runs meanwhile."""
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_list)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompt_list))) as client:
        tasks = [asyncio.create_task(stream_one(client, url, p, m)) for p, m in zip(prompt_list, counts)]
        if during is not None:
            await during()
        return await asyncio.gather(*tasks)


def failures(streams: list[Stream], max_tokens: int | list[int]) -> list[tuple[int, Stream]]:
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(streams)
    return [(i, s) for i, (s, m) in enumerate(zip(streams, counts)) if not s.ok or len(s.tokens) != m]


# Non-streaming token-id completions, greedy: the parity tests compare these exactly.
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
