"""The public gRPC API, called by a client generated from the .proto at test time.

The client (grpc_external_client.py) runs in its own interpreter on stubs that grpc_tools.protoc
writes into a temporary directory, so it shares no code with the server: a broken .proto, or a
server that drifted from it, fails here. Health and reflection are checked with the standard
grpcio-health-checking and grpcio-reflection clients.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from .conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stubs_dir(tmp_path_factory) -> Path:
    pytest.importorskip("grpc_tools")
    out = tmp_path_factory.mktemp("stubs")
    # protoc in its own interpreter: loading grpc_tools' bundled protobuf next to nixl's (imported
    # by earlier tests in this process) segfaults
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto/splitserve/v1'}",
                    f"--python_out={out}", f"--grpc_python_out={out}", "generation.proto"], check=True)
    assert sorted(p.name for p in out.iterdir()) == ["generation_pb2.py", "generation_pb2_grpc.py"]
    return out


@pytest.fixture(scope="module")
def seen(_session_cluster, stubs_dir, tmp_path_factory) -> dict:
    script = Path(__file__).with_name("grpc_external_client.py")
    r = subprocess.run([sys.executable, "-I", str(script), str(stubs_dir), _session_cluster.grpc_target],
                       cwd=tmp_path_factory.mktemp("client"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_list_models(seen, model_name):
    assert seen["models"] == [{"id": model_name, "max_model_len": 2048, "owned_by": "splitserve"}]


def test_generate_streams_token_ids_text_finish_reason_and_usage(seen, cluster, model_name):
    msgs = seen["token_ids"]
    assert len(msgs) > 1                                    # streamed, not one reply
    assert all(m["request_id"] == "my-id-1" for m in msgs)
    assert [m["finish_reason"] for m in msgs[:-1]] == ["FINISH_REASON_UNSPECIFIED"] * (len(msgs) - 1)
    assert msgs[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert not any(m["has_usage"] for m in msgs[:-1]) and msgs[-1]["has_usage"]
    assert msgs[-1]["usage"][:2] == [5, 12]
    ids = [t for m in msgs for t in m["token_ids"]]
    assert len(ids) == 12
    # the same greedy request over HTTP gives the same tokens and text
    r = httpx.post(f"{cluster.url}/v1/completions", json={
        "model": model_name, "prompt": [0, 400, 500, 600, 700], "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout=60).json()
    assert r["choices"][0]["token_ids"] == ids
    assert r["choices"][0]["text"] == "".join(m["text"] for m in msgs)


def test_prompt_logprobs_come_with_the_first_message(seen, cluster, model_name):
    first, *rest = seen["prompt_logprobs"]
    lps = first["prompt_logprobs"]
    assert [p[0] for p in lps] == [400, 500, 600, 700]       # one per prompt token from the second on
    assert all(len(p[2]) == 2 and p[3] >= 1 for p in lps)   # the 2 best, and the token's rank
    assert all(not m["prompt_logprobs"] for m in rest)
    r = httpx.post(f"{cluster.url}/v1/completions", json={
        "model": model_name, "prompt": [0, 400, 500, 600, 700], "max_tokens": 0, "echo": True, "logprobs": 1},
        timeout=60).json()
    http = r["choices"][0]["logprobs"]["token_logprobs"]
    assert http[0] is None and http[1:] == pytest.approx([p[1] for p in lps], abs=1e-5)
    assert seen["named_chat"][-1]["finish_reason"] == "FINISH_REASON_LENGTH"


def test_text_and_chat_prompts(seen):
    for kind in ("text", "chat"):
        msgs = seen[kind]
        assert msgs[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
        assert sum(len(m["token_ids"]) for m in msgs) == 12 == msgs[-1]["usage"][1]
        assert "".join(m["text"] for m in msgs)
        assert msgs[0]["request_id"]                     # the server made one up
    assert seen["chat"][-1]["usage"][0] > seen["text"][-1]["usage"][0]   # the chat template added tokens


def test_model_field_may_be_left_empty(seen):
    assert seen["no_model_field"][-1]["finish_reason"] == "FINISH_REASON_LENGTH"


def test_stop_token_ids_end_with_stop(seen):
    msgs = seen["stop_token"]
    assert msgs[-1]["finish_reason"] == "FINISH_REASON_STOP"
    assert [t for m in msgs for t in m["token_ids"]] == seen["token_ids"][0]["token_ids"][:1]


def test_seeded_sampling_is_reproducible(seen):
    a, b = ([t for m in run for t in m["token_ids"]] for run in seen["seeded"])
    assert a == b and len(a) == 16


def test_bad_input_is_invalid_argument_and_unknown_model_not_found(seen):
    errors = seen["errors"]
    assert errors.pop("unknown_model")["code"] == "NOT_FOUND"
    for what, e in errors.items():
        assert e["code"] == "INVALID_ARGUMENT", (what, e)
        assert e["details"], what


def test_health_check_serving(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(cluster.grpc_target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "splitserve.v1.Generation"):
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_generation_service(cluster):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    from google.protobuf.descriptor_pool import DescriptorPool
    with grpc.insecure_channel(cluster.grpc_target) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = db.get_services()
        assert "splitserve.v1.Generation" in services
        assert "grpc.health.v1.Health" in services
        pool = DescriptorPool(db)
        svc = pool.FindServiceByName("splitserve.v1.Generation")
        assert {m.name for m in svc.methods} == {"Generate", "ListModels"}
        generate = svc.methods_by_name["Generate"]
        assert generate.server_streaming and not generate.client_streaming
