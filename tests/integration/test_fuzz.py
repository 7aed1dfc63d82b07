"""Fuzzing the client APIs against a real cluster: no input gets a 5xx, and the cluster serves
normally afterwards.

- HTTP: schemathesis generates requests from the served OpenAPI schema (/openapi.json, which
  describes every request body), both inside the schema (positive: valid bodies that generate) and
  outside it (negative: wrong types, out-of-range numbers, missing and unknown fields).
- gRPC: hypothesis builds `GenerateRequest` messages from their fields (random prompts, sampling
  values over each field's whole range) and also sends raw random bytes.

The cluster is the real launcher, frontend, router, Redis and an aggregated worker with the real
scheduler and block pool; the worker's model is the timing mock with zero step time
(engine/mock_runner.py), and the context is 64 tokens, so that each valid case generates in
milliseconds and thousands of cases fit in about a minute (FUZZ_HTTP_CASES, FUZZ_GRPC_CASES).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import grpc
import httpx
import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from proto.splitserve.v1 import generation_pb2 as pb
from proto.splitserve.v1 import generation_pb2_grpc as pb_grpc
from tests.integration.cluster import start_cluster

schemathesis = pytest.importorskip("schemathesis")

pytestmark = pytest.mark.slow

# 5,000 cases per run in 100-150 s on 2 shared cores; generating an HTTP case from the schema
# (~25 ms) costs far more than sending it, so most of the volume is gRPC (~7 ms a case)
HTTP_CASES = int(os.environ.get("FUZZ_HTTP_CASES", "1200"))     # 60% positive, 40% negative
GRPC_CASES = int(os.environ.get("FUZZ_GRPC_CASES", "3800"))
CONTEXT = 64
ZERO_TIME = {"curve": {"base_s": 0.0, "per_token_s": 0.0, "per_attn_pair_s": 0.0, "per_kv_token_s": 0.0}}
FAST = settings(deadline=None, phases=[Phase.generate], database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("fuzz")
    profile = tmp / "zero-time.json"
    profile.write_text(json.dumps(ZERO_TIME))
    c = start_cluster(tmp, "--model", "tiny", "--mock", "--mock-profile", str(profile), "--prefill-workers", "0",
                      "--max-model-len", str(CONTEXT), "--namespace", "fuzz", redis_url=redis_server.url)
    c.namespace = "fuzz"
    yield c
    assert c.stop() == 0, c.log()[-3000:]


def still_serves(c) -> None:
    assert c.proc.poll() is None, c.log()[-3000:]
    assert httpx.get(f"{c.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{c.url}/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    with grpc.insecure_channel(c.grpc_target) as ch:
        out = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            model="tiny", text="hi", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)), timeout=30))
    assert out[-1].usage.completion_tokens == 3
    c.wait_idle()


def test_schemathesis_finds_no_server_error(fuzz_cluster):
    schema = schemathesis.openapi.from_url(f"{fuzz_cluster.url}/openapi.json")
    bodies = [(path, op) for path, item in schema.raw_schema["paths"].items() for op in item.values()
              if "requestBody" in op]
    assert {p for p, _ in bodies} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for path, op in bodies:     # every body is described: an object schema with its properties
        ref = op["requestBody"]["content"]["application/json"]["schema"]
        assert "$ref" in ref or "anyOf" in ref, (path, ref)
    statuses: Counter = Counter()
    failures: list = []
    session = requests.Session()
    started = time.perf_counter()

    def check(case) -> None:
        r = case.call(base_url=fuzz_cluster.url, session=session, timeout=30)
        statuses[r.status_code] += 1
        if r.status_code >= 500:
            failures.append((case.method, case.formatted_path, case.body, r.status_code, r.text[:300]))
        elif r.status_code >= 400:
            err = r.json()["error"]       # the OpenAI shape, for every 4xx
            assert err["message"] and err["type"], r.text

    def served_model(case, k: int):
        # a random model id is a 404 before anything else is looked at: most valid bodies name ours
        if k and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"
        return case

    for mode, share in (("positive", 0.6), ("negative", 0.4)):
        strategy = schema.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
        if mode == "positive":
            strategy = st.builds(served_model, strategy, st.integers(0, 4))
        given(case=strategy)(settings(FAST, max_examples=int(HTTP_CASES * share))(lambda case: check(case)))()
    elapsed = time.perf_counter() - started
    session.close()
    total = sum(statuses.values())
    print(f"schemathesis: {total} cases in {elapsed:.1f} s, statuses {dict(sorted(statuses.items()))}")
    assert not failures, failures[:5]
    assert total >= HTTP_CASES * 0.9
    assert statuses[200] > total * 0.05, statuses     # the fuzzer reaches generation, not only 400s
    still_serves(fuzz_cluster)


FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)
SAMPLING = st.builds(
    pb.SamplingParams, temperature=st.one_of(st.none(), FLOATS), top_p=st.one_of(st.none(), FLOATS),
    top_k=st.one_of(st.none(), INT32), max_tokens=st.one_of(st.none(), INT32, st.integers(1, 16)),
    seed=st.one_of(st.none(), st.integers(0, 2 ** 64 - 1)), stop_token_ids=st.lists(INT32, max_size=4),
    stop=st.lists(st.text(max_size=8), max_size=20), ignore_eos=st.booleans(),
    n=st.one_of(st.none(), st.integers(-1, 3), INT32), presence_penalty=st.one_of(st.none(), FLOATS),
    frequency_penalty=st.one_of(st.none(), FLOATS), repetition_penalty=st.one_of(st.none(), FLOATS),
    min_p=st.one_of(st.none(), FLOATS), min_tokens=st.one_of(st.none(), INT32, st.integers(0, 8)),
    logit_bias=st.dictionaries(st.one_of(INT32, st.integers(0, 4095)), FLOATS, max_size=4),
    logprobs=st.one_of(st.none(), INT32, st.integers(0, 5)),
    response_format=st.one_of(st.none(), st.builds(
        pb.ResponseFormat, type=st.sampled_from([0, 1, 2, 7]),
        json_schema=st.one_of(st.just('{"type": "object", "properties": {"a": {"type": "boolean"}}}'),
                              st.just('{"type": "nonsense"}'), st.text(max_size=20)))))
PROMPT = st.one_of(
    st.fixed_dictionaries({"text": st.text(max_size=200)}),
    st.fixed_dictionaries({"token_ids": st.builds(pb.TokenIds, ids=st.lists(
        st.one_of(st.integers(0, 4095), INT32), max_size=80))}),
    st.fixed_dictionaries({"chat": st.builds(pb.ChatMessages, messages=st.lists(st.builds(
        pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant", "tool", ""]),
        content=st.text(max_size=50)), max_size=4))}),
    st.just({}))
REQUEST = st.builds(lambda model, rid, prompt, sampling: pb.GenerateRequest(
    model=model, request_id=rid, sampling=sampling, **prompt),
    st.sampled_from(["tiny", "", "other"]), st.text(max_size=300), PROMPT, st.one_of(st.none(), SAMPLING))
OK_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


def test_hypothesis_grpc_requests_find_no_server_error(fuzz_cluster):
    codes: Counter = Counter()
    bad: list = []
    with grpc.insecure_channel(fuzz_cluster.grpc_target) as ch:
        stub = pb_grpc.GenerationStub(ch)
        raw = ch.unary_stream("/splitserve.v1.Generation/Generate", request_serializer=None,
                              response_deserializer=None)

        def call(fn, what) -> None:
            try:
                list(fn())
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            codes[code] += 1
            if code not in OK_CODES:
                bad.append((code, what))

        @settings(FAST, max_examples=GRPC_CASES * 4 // 5)
        @given(req=REQUEST)
        def messages(req):
            call(lambda: stub.Generate(req, timeout=30), req)

        @settings(FAST, max_examples=GRPC_CASES // 5)
        @given(data=st.binary(max_size=200))
        def raw_bytes(data):
            call(lambda: raw(data, timeout=30), data)

        started = time.perf_counter()
        messages()
        raw_bytes()
        print(f"gRPC fuzz: {sum(codes.values())} calls in {time.perf_counter() - started:.1f} s, {dict(codes)}")
    assert not bad, bad[:5]
    assert codes[grpc.StatusCode.OK] > GRPC_CASES * 0.05, codes
    still_serves(fuzz_cluster)
