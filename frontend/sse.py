"""The OpenAI SSE stream of one generation, written from the worker stream's turn to the socket.

`ChunkEncoder` makes a token's SSE event from a template filled with the JSON of its text (and
token ids): the same bytes as `json.dumps(chunk, separators=(",", ":"))` of the chunk object
(tests/unit/frontend/test_sse.py checks them), without building that object per token.

`PushedStream` is the ASGI response of a streamed completion or chat completion with one choice,
no tools to parse and no logprobs (the others take frontend/openai_api.py's general `_sse`). It
sends its headers, then runs the generation pushed (`Generator.stream`): each delta's event is
written to the connection's transport at once, on the worker stream's turn. That needs uvicorn's
httptools connection, which the outermost middleware hands over in the scope (`RAW_SEND`); chunked
framing is done here as uvicorn would. When the client reads slowly (the transport paused writing)
or the server is another one, events wait in a buffer that a flusher task sends through ASGI, in
order. A client that hangs up cancels the generation (its worker frees the blocks). A failure after
the headers ends the stream with an in-band error event, as `_sse` does; the final usage event and
`[DONE]` follow.

It knows nothing of routing or workers: it gets a function that runs the generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable

from starlette.responses import Response

from frontend.generation import Delta

log = logging.getLogger(__name__)

RAW_SEND = "splitserve.raw_send"        # the server's own `send`, put in the scope by the outermost app
HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
_dumps = json.dumps
_string = json.encoder.encode_basestring_ascii     # what json.dumps(a_str) returns, without its wrapping


def event(obj: dict) -> bytes:
    return b"data: " + _dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class ChunkEncoder:
    """One choice's token events: completion (`text`) or chat (`delta.content`) chunks."""

    __slots__ = ("_head", "_chat", "_ids")

    def __init__(self, rid: str, created: int, model: str, chat: bool, return_token_ids: bool) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{_dumps(rid)},"object":"{obj}","created":{created},"model":{_dumps(model)},'
                      f'"choices":[{{"index":0,')
        self._chat, self._ids = chat, return_token_ids

    def encode(self, d: Delta, reason: str | None) -> bytes:
        if self._chat:
            body = f'"delta":{{"content":{_string(d.text)}}}' if d.text else '"delta":{}'
        else:
            body = f'"text":{_string(d.text)}'
        tail = f',"finish_reason":"{reason}","logprobs":null' if reason else ',"finish_reason":null,"logprobs":null'
        if self._ids:
            tail += f',"token_ids":[{",".join(map(str, d.token_ids))}]'
        return (self._head + body + tail + "}]}\n\n").encode()


class _Body:
    """Body bytes to the client: straight onto uvicorn's transport, or through ASGI when it can't."""

    __slots__ = ("_send", "_cycle", "_pending", "_flusher", "gone")

    def __init__(self, send) -> None:
        self._send = send
        cycle = getattr(send, "__self__", None)
        ok = type(cycle).__module__ == "uvicorn.protocols.http.httptools_impl" and \
            getattr(cycle, "chunked_encoding", None) is True
        self._cycle = cycle if ok else None
        self._pending: list[bytes] = []
        self._flusher: asyncio.Task | None = None
        self.gone = False            # the client hung up

    def write(self, data: bytes) -> None:
        c = self._cycle
        if c is not None and not self._pending and not c.flow.write_paused:
            if c.disconnected:
                self.gone = True
                return
            c.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            return
        self._pending.append(data)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        while self._pending:
            data, self._pending = b"".join(self._pending), []
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def close(self, last: bytes) -> None:
        if self._flusher is not None:
            await self._flusher
        await self._send({"type": "http.response.body", "body": b"".join(self._pending) + last,
                          "more_body": False})


class PushedStream(Response):
    """ASGI response (a Starlette Response, so that FastAPI sends it as it is): `run(on_delta)`
    generates; `head` goes first, `tail(last delta)` last; `on_error(e)` is a failure's event."""

    def __init__(self, run: Callable[[Callable[[Delta], None]], Awaitable[None]], encoder: ChunkEncoder,
                 head: bytes, tail: Callable[[Delta | None], bytes], on_error: Callable[[Exception], bytes],
                 reasons: dict) -> None:
        self.status_code, self.background = 200, None
        self.run, self.encoder, self.head, self.tail, self.on_error = run, encoder, head, tail, on_error
        self.reasons = reasons

    async def __call__(self, scope, receive, send) -> None:
        send = scope.get(RAW_SEND, send)
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        body = _Body(send)
        if self.head:
            body.write(self.head)
        last: list[Delta] = []
        encode, reasons = self.encoder.encode, self.reasons

        def on_delta(d: Delta) -> None:
            if d.finish_reason is not None:
                last.append(d)
            body.write(encode(d, reasons.get(d.finish_reason)))
        gen = asyncio.ensure_future(self.run(on_delta))
        hangup = asyncio.ensure_future(_until_disconnect(receive))
        end = b""
        try:
            await asyncio.wait({gen, hangup}, return_when=asyncio.FIRST_COMPLETED)
            if not gen.done():          # the client went away: stop generating (frees the worker's blocks)
                gen.cancel()
                await asyncio.gather(gen, return_exceptions=True)
                return
            try:
                gen.result()
                end = self.tail(last[0] if last else None)
            except Exception as e:      # mid-stream failure: tell the client in-band, then end
                end = self.on_error(e)
        finally:
            hangup.cancel()
            await body.close(end + b"data: [DONE]\n\n" if end is not None else b"")


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
