"""The client side of `splitserve bench serve`: what one request is (`RequestSpec`), what came back
(`RequestResult`, every token's arrival time), and the two clients that send it — OpenAI
`/v1/completions` streaming over HTTP and `Generation.Generate` over gRPC — with the SSE parsing
they need. The definitions of TTFT, ITL and the rest are in serve.py and docs/benchmarking.md.
"""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestSpec:
    """One request to send. The prompt is built on send so that a sweep holds no token arrays."""

    prompt_len: int
    max_tokens: int
    make_prompt: Callable[[], np.ndarray | str]     # token ids, or text the server tokenizes
    arrival_s: float = 0.0  # trace replay: when to send, from the start of the level
    cache_key: str | None = None  # sent as OpenAI's prompt_cache_key (the router's affinity hint)


@dataclass(slots=True)
class RequestResult:
    """Timings of one request. Times are time.perf_counter() seconds."""

    prompt_len: int
    expected_tokens: int
    sent_at: float = 0.0
    ended_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None   # the server's count (text prompts: its tokenizer's)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server says
    error: str | None = None

    @property
    def num_output_tokens(self) -> int:
        if self.chunk_tokens:
            return sum(self.chunk_tokens)
        return self.usage_completion_tokens or 0

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.sent_at

    @property
    def e2e_s(self) -> float:
        return self.ended_at - self.sent_at

    def finish(self, stream_complete: bool) -> RequestResult:
        """Stamp the end and classify an unfinished or empty stream as an error."""
        self.ended_at = time.perf_counter()
        if self.error is None and not stream_complete:
            self.error = "incomplete_stream"
        if self.error is None and not self.chunk_times:
            self.error = "no_tokens"
        return self


# ---------------------------------------------------------------------------------------------
# Clients: how to send


class SseParser:
    """Incremental Server-Sent Events decoder: feed raw bytes, get each event's data payload.

    Reads may split lines (and events) anywhere, even inside a CRLF; incomplete lines wait in a
    buffer. Lines other than `data:` (comments, `event:`, `id:`) are ignored; several data lines of
    one event are joined with a newline, as the SSE spec says.
    """

    __slots__ = ("_tail", "_data")

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        events: list[bytes] = []
        for line in lines:
            self._line(line, events)
        return events

    def close(self) -> list[bytes]:
        """Flush what is left when the stream ends (a last event without its blank line)."""
        events: list[bytes] = []
        if self._tail:
            self._line(self._tail, events)
            self._tail = b""
        self._line(b"", events)
        return events

    def _line(self, line: bytes, events: list[bytes]) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            if self._data:
                events.append(b"\n".join(self._data))
                self._data = []
        elif line.startswith(b"data:"):
            data = line[5:]
            self._data.append(data[1:] if data.startswith(b" ") else data)


@dataclass(slots=True)
class EventTally:
    """What a batch of SSE events said; events are JSON-decoded exactly once here."""

    tokens: int = 0
    done: bool = False
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None
    error: str | None = None


def tally_events(events: Sequence[bytes]) -> EventTally:
    """Count new tokens in OpenAI completion-chunk events.

    Tokens are `choices[0].token_ids` when present; a chunk with text but no token ids counts as
    one token (a server that ignores return_token_ids).
    """
    tally = EventTally()
    for event in events:
        if event == b"[DONE]":
            tally.done = True
            continue
        obj = json.loads(event)
        if obj.get("error"):
            tally.error = "server_error"
            continue
        choices = obj.get("choices")
        if choices:
            ids = choices[0].get("token_ids")
            if ids is not None:
                tally.tokens += len(ids)
            elif choices[0].get("text"):
                tally.tokens += 1
        usage = obj.get("usage")
        if usage:
            tally.usage_completion_tokens = usage.get("completion_tokens")
            tally.usage_prompt_tokens = usage.get("prompt_tokens")
            tally.usage_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return tally


# An idle connection is dropped before the server's keep-alive timeout (uvicorn's: 5 s) can close it:
# with equal timeouts a request sent on a connection the server was closing failed with ReadError
# (1-2 of 1,500 requests in an open-loop replay).
KEEPALIVE_EXPIRY_S = 4.0


class HttpClient:
    """OpenAI `/v1/completions` streaming over httpx, one keep-alive connection per in-flight request.

    Each connection is its own single-connection `httpx.AsyncClient`, handed out from a free list:
    httpcore's shared pool rescans every connection on each request (O(connections) per request,
    O(n^2) per wave), which at 256 streams cost the client more CPU than all the token parsing.
    """

    def __init__(self, url: str, model: str, pool_size: int, timeout_s: float, api_key: str | None):
        import httpx

        self._httpx = httpx
        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        self.headers = {"content-type": "application/json", "accept-encoding": "identity"}
        self.extra_body: dict | None = None       # merged into every body (--extra-body)
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self._all: list = []
        self._idle: list = []
        # one TLS context for all connections (httpx would load the CA file per client: ~20 ms each)
        self._verify = ssl.create_default_context() if url.startswith("https://") else False

    def _acquire(self):
        if self._idle:
            return self._idle.pop()
        httpx = self._httpx
        client = httpx.AsyncClient(
            base_url=self.url, verify=self._verify,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
            timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 30.0)))
        self._all.append(client)
        return client

    async def list_models(self) -> list[dict]:
        client = self._acquire()
        try:
            resp = await client.get("/v1/models", headers=self.headers)
        finally:
            self._idle.append(client)
        resp.raise_for_status()
        return [{"id": m["id"], "max_model_len": m.get("max_model_len")} for m in resp.json()["data"]]

    def _body(self, spec: RequestSpec) -> bytes:
        prompt = spec.make_prompt()
        body = {
            "model": self.model, "prompt": prompt if isinstance(prompt, str) else prompt.tolist(),
            "max_tokens": spec.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True,
        }
        if spec.cache_key is not None:
            body["prompt_cache_key"] = spec.cache_key
        if self.extra_body:
            body.update(self.extra_body)
        return json.dumps(body).encode()

    async def send(self, spec: RequestSpec) -> RequestResult:
        res = RequestResult(spec.prompt_len, spec.max_tokens)
        body = self._body(spec)  # built before the clock starts: not the server's time
        done = False
        client = self._acquire()
        res.sent_at = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                done = await self._stream(client, body, res)
        except (TimeoutError, self._httpx.TimeoutException):
            res.error = "timeout"
        except self._httpx.HTTPError as e:
            res.error = type(e).__name__
        except (OSError, ValueError) as e:  # ValueError: a chunk that is not JSON
            res.error = type(e).__name__
        finally:
            self._idle.append(client)
        return res.finish(done)

    async def _stream(self, client, body: bytes, res: RequestResult) -> bool:
        times, counts = res.chunk_times, res.chunk_tokens
        parser = SseParser()
        done = False
        async with client.stream("POST", "/v1/completions", content=body,
                                      headers=self.headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"http_{resp.status_code}"
                return False
            async for chunk in resp.aiter_raw():
                now = time.perf_counter()
                events = parser.feed(chunk)
                if not events:
                    continue
                tally = tally_events(events)
                if tally.tokens:
                    times.append(now)
                    counts.append(tally.tokens)
                done = done or tally.done
                res.usage_completion_tokens = tally.usage_completion_tokens or res.usage_completion_tokens
                res.usage_prompt_tokens = tally.usage_prompt_tokens or res.usage_prompt_tokens
                res.cached_tokens = _first_set(tally.usage_cached_tokens, res.cached_tokens)
                res.error = res.error or tally.error
        tally = tally_events(parser.close())
        res.usage_completion_tokens = tally.usage_completion_tokens or res.usage_completion_tokens
        res.usage_prompt_tokens = tally.usage_prompt_tokens or res.usage_prompt_tokens
        res.cached_tokens = _first_set(tally.usage_cached_tokens, res.cached_tokens)
        return done or tally.done

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._all))


def _first_set(a, b):
    return a if a is not None else b


class GrpcClient:
    """`splitserve.v1.Generation.Generate` over grpc.aio, streams spread over a few channels."""

    STREAMS_PER_CHANNEL = 64

    def __init__(self, target: str, model: str, pool_size: int, timeout_s: float, api_key: str | None):
        import grpc

        from proto.splitserve.v1 import generation_pb2, generation_pb2_grpc

        self._grpc, self._pb = grpc, generation_pb2
        self.model = model
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        num_channels = max(1, math.ceil(pool_size / self.STREAMS_PER_CHANNEL))
        options = [("grpc.use_local_subchannel_pool", 1),  # a separate connection per channel
                   ("grpc.max_receive_message_length", 64 << 20)]
        self.channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(num_channels)]
        self.stubs = [generation_pb2_grpc.GenerationStub(c) for c in self.channels]
        self._next = 0

    async def list_models(self) -> list[dict]:
        resp = await self.stubs[0].ListModels(self._pb.ListModelsRequest(), metadata=self.metadata,
                                              timeout=min(self.timeout_s, 30.0))
        return [{"id": m.id, "max_model_len": m.max_model_len or None} for m in resp.models]

    async def send(self, spec: RequestSpec) -> RequestResult:
        pb = self._pb
        res = RequestResult(spec.prompt_len, spec.max_tokens)
        prompt = spec.make_prompt()
        prompt_field = {"text": prompt} if isinstance(prompt, str) else \
            {"token_ids": pb.TokenIds(ids=prompt.tolist())}
        request = pb.GenerateRequest(
            model=self.model, sampling=pb.SamplingParams(temperature=0.0, max_tokens=spec.max_tokens,
                                                         ignore_eos=True), **prompt_field)
        stub = self.stubs[self._next % len(self.stubs)]
        self._next += 1
        times, counts = res.chunk_times, res.chunk_tokens
        done = False
        res.sent_at = time.perf_counter()
        try:
            call = stub.Generate(request, metadata=self.metadata, timeout=self.timeout_s)
            async for msg in call:
                now = time.perf_counter()
                n = len(msg.token_ids)
                if n:
                    times.append(now)
                    counts.append(n)
                if msg.HasField("usage"):
                    res.usage_completion_tokens = msg.usage.completion_tokens
                    res.usage_prompt_tokens = msg.usage.prompt_tokens
                if msg.finish_reason == pb.FINISH_REASON_ERROR:
                    res.error = "server_error"
                elif msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    done = True
        except self._grpc.aio.AioRpcError as e:
            res.error = "timeout" if e.code() == self._grpc.StatusCode.DEADLINE_EXCEEDED else \
                f"grpc_{e.code().name}"
        return res.finish(done)

    async def aclose(self) -> None:
        for channel in self.channels:
            await channel.close()


def make_client(url: str, model: str, pool_size: int, timeout_s: float, api_key: str | None):
    if url.startswith("grpc://"):
        return GrpcClient(url.removeprefix("grpc://"), model, pool_size, timeout_s, api_key)
    return HttpClient(url, model, pool_size, timeout_s, api_key)
