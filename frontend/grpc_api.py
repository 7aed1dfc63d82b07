"""The public gRPC API: splitserve.v1.Generation (+ health and reflection v1 and v1alpha on the
same port).

Errors map to status codes via runtime.errors (INVALID_ARGUMENT for bad input, NOT_FOUND for an
unknown model, UNAUTHENTICATED without the API key, RESOURCE_EXHAUSTED when the tokenizer queue is
full). A request whose bytes do not parse as its message (bad wire format, invalid UTF-8 in a
string) is INVALID_ARGUMENT too, not grpc's default INTERNAL: the servicer is registered with
deserializers that hand it the parse error. With an API key configured, calls must carry metadata
`authorization: Bearer <key>`. Prompts are tokenized on the tokenizer pool's threads. A request
with one sample is generated pushed (`pushed`): its tokens are taken from the worker stream's turn,
and those that pile up while a message is written go out together in the next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import AsyncIterator

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from frontend.grpc_reflection_v1 import V1_SERVICE_NAME, add_v1_reflection
from frontend.schemas import MAX_N, check_json_value, sampling_fields

from runtime.types import GrammarKind, GrammarSpec
from frontend.generate import Delta, GenerateInput, generate_samples
from frontend.state import FrontendState
from frontend.tokenizer import ChatTurn
from proto.splitserve.v1 import generation_pb2, generation_pb2_grpc
from runtime.convert import FINISH_TO_PB
from runtime.errors import InvalidRequest, NotFound, SplitserveError
from runtime.grpc_links import server_options

MAX_STOP_STRINGS = 16


class Malformed:
    """What the safe deserializer hands the servicer for bytes that are not the request message."""

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(parse):
    def deserialize(data: bytes):
        try:
            return parse(data)
        except (DecodeError, ValueError, RuntimeError) as e:   # upb raises DecodeError; be broad
            return Malformed(f"the request is not a valid message: {e}")
    return deserialize


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    def _authorize(self, context) -> None:
        md = dict(context.invocation_metadata())
        self.state.api_key.check(md.get("authorization"), "metadata authorization")

    async def _to_input(self, req: generation_pb2.GenerateRequest) -> tuple[list[GenerateInput], str]:
        st = self.state
        if isinstance(req, Malformed):
            raise InvalidRequest(req.error)
        if req.model and req.model != st.model_name:
            raise NotFound(f"The model `{req.model}` does not exist; this server serves `{st.model_name}`")
        if len(req.request_id) > 256:
            raise InvalidRequest("request_id is longer than 256 characters")
        kind = req.WhichOneof("prompt")
        limit = st.generator.context_limit()
        if kind == "text":
            prompt = await st.tokenize.encode(req.text, limit)
        elif kind == "token_ids":
            prompt = list(req.token_ids.ids)
        elif kind == "chat":
            if not req.chat.messages:
                raise InvalidRequest("chat.messages must not be empty")
            for m in req.chat.messages:
                if m.role not in ("system", "user", "assistant"):
                    raise InvalidRequest(f"unknown chat role {m.role!r}")
            prompt = await st.tokenize.encode_chat([ChatTurn(m.role, m.content, name=m.name or None)
                                                    for m in req.chat.messages], limit)
        else:
            raise InvalidRequest("one of text, token_ids or chat is required")
        s = req.sampling
        max_tokens = st.generator.check_prompt(prompt, s.max_tokens if s.HasField("max_tokens") else None, None)
        if len(s.stop) > MAX_STOP_STRINGS or any(len(x) > 256 for x in s.stop):
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings of at most 256 characters")
        if s.HasField("top_k") and s.top_k < 0:
            raise InvalidRequest("top_k must be >= 0")
        n = s.n if s.HasField("n") else 1
        if not 1 <= n <= MAX_N:
            raise InvalidRequest(f"n must be in [1, {MAX_N}]")
        rf = s.response_format
        grammar = None
        if rf.type == generation_pb2.ResponseFormat.TYPE_JSON_OBJECT:
            grammar = GrammarSpec(GrammarKind.JSON_OBJECT)
        elif rf.type == generation_pb2.ResponseFormat.TYPE_JSON_SCHEMA:
            try:
                schema = json.loads(rf.json_schema or "{}")
            except ValueError:
                raise InvalidRequest("response_format.json_schema must be JSON text") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("response_format.json_schema must be a JSON schema (an object)")
            try:
                check_json_value(schema, "response_format.json_schema")
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
            grammar = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
        elif rf.type != generation_pb2.ResponseFormat.TYPE_TEXT:
            raise InvalidRequest("unknown response_format.type")
        opt = lambda name: getattr(s, name) if s.HasField(name) else None   # noqa: E731
        sampling = sampling_fields(
            max_tokens, st.tokenizer.vocab_size, temperature=opt("temperature"), top_p=opt("top_p"),
            top_k=opt("top_k"), seed=opt("seed"), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
            presence_penalty=opt("presence_penalty"), frequency_penalty=opt("frequency_penalty"),
            repetition_penalty=opt("repetition_penalty"), min_p=opt("min_p"), min_tokens=opt("min_tokens"),
            logit_bias=dict(s.logit_bias), logprobs=opt("logprobs"), grammar=grammar,
            prompt_logprobs=opt("prompt_logprobs"))
        rid = req.request_id or uuid.uuid4().hex
        stop = [x for x in s.stop if x]
        where = "sampling.response_format.json_schema" if grammar and grammar.kind == GrammarKind.JSON_SCHEMA \
            else "sampling.response_format"
        return [GenerateInput(prompt, sampling if not i else dataclasses.replace(
                    sampling, seed=None if sampling.seed is None else (sampling.seed + i) % 2 ** 63, prompt_logprobs=None),
                              stop, rid if n == 1 else f"{rid}-{i}", grammar_param=where) for i in range(n)], rid

    async def Generate(self, request, context):
        try:
            self._authorize(context)
            inputs, rid = await self._to_input(request)
            if len(inputs) == 1:
                async for d in pushed(self.state.generator, inputs[0]):
                    yield _response(rid, 0, d)
                return
            async for i, d in generate_samples(self.state.generator, inputs, len(inputs)):
                yield _response(rid, i, d)
        except SplitserveError as e:
            self.state.metrics.errors.labels("grpc", e.grpc_code.name).inc()
            await context.abort(e.grpc_code, e.message)

    async def ListModels(self, request, context):
        try:
            self._authorize(context)
            if isinstance(request, Malformed):
                raise InvalidRequest(request.error)
        except SplitserveError as e:
            await context.abort(e.grpc_code, e.message)
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(
            id=self.state.model_name, max_model_len=self.state.generator.context_limit(), owned_by="splitserve")])


def _response(rid: str, index: int, d: Delta) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(request_id=rid, token_ids=d.token_ids, index=index, text=d.text,
                                          finish_reason=FINISH_TO_PB[d.finish_reason], logprobs=d.logprobs or (),
                                          prompt_logprobs=d.prompt_logprobs or ())
    if d.finish_reason is not None:
        msg.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens,
                                                cached_tokens=d.cached_tokens))
    return msg


async def pushed(generator, inp: GenerateInput) -> AsyncIterator[Delta]:
    """One generation's deltas, pushed on the worker stream's turn (frontend/generation.py) and
    taken here once per wake: those that came while the previous message was being written go
    out merged in one (a stream the client or the server's writes fall behind on catches up in
    fewer, larger messages; otherwise, one message per token)."""
    pending: list[Delta] = []
    wake = asyncio.Event()

    def on_delta(d: Delta) -> None:
        pending.append(d)
        wake.set()
    task = asyncio.ensure_future(generator.stream(inp, on_delta))
    task.add_done_callback(lambda _t: wake.set())
    try:
        while True:
            await wake.wait()
            wake.clear()
            if pending:
                ds = pending[:]
                pending.clear()
                yield ds[0] if len(ds) == 1 else merged(ds)
            if task.done() and not pending:
                task.result()
                return
    finally:
        task.cancel()


def merged(ds: list[Delta]) -> Delta:
    """Consecutive deltas of one generation as one (the last one's finish and usage)."""
    last = ds[-1]
    logprobs = [lp for d in ds for lp in (d.logprobs or ())]
    return Delta([t for d in ds for t in d.token_ids], "".join(d.text for d in ds), last.finish_reason,
                 last.prompt_tokens, last.completion_tokens, last.cached_tokens, logprobs or None,
                 ds[0].prompt_logprobs)


async def start_grpc_server(state: FrontendState, host: str, port: int,
                            reuse_port: bool = False) -> tuple[grpc.aio.Server, int]:
    # clients that ping every 5 s or more keep their connection (runtime/grpc_links.py)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20),
                                      ("grpc.so_reuseport", int(reuse_port)), *server_options()])
    service = GenerationService(state)
    name = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_safe(generation_pb2.GenerateRequest.FromString),
            response_serializer=generation_pb2.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels, request_deserializer=_safe(generation_pb2.ListModelsRequest.FromString),
            response_serializer=generation_pb2.ListModelsResponse.SerializeToString),
    }),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME,
             V1_SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    add_v1_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("splitserve.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
    return server, bound
