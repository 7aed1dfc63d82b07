"""A stand-alone gRPC client, run in its own interpreter by test_grpc_client.py.

It imports only stubs that protoc generated from proto/splitserve/v1/generation.proto into a
temporary directory (argv[1]) — nothing of Splitserve — so it is what any user's generated client
is. It runs the calls the test names and prints one JSON object with what it saw.

    python grpc_external_client.py STUBS_DIR HOST:PORT
"""

import json
import sys

import grpc

sys.path.insert(0, sys.argv[1])
import generation_pb2 as pb  # noqa: E402
import generation_pb2_grpc as pb_grpc  # noqa: E402


def stream(stub, **kw):
    out = []
    for msg in stub.Generate(pb.GenerateRequest(**kw), timeout=60):
        out.append({"request_id": msg.request_id, "token_ids": list(msg.token_ids), "text": msg.text,
                    "finish_reason": pb.FinishReason.Name(msg.finish_reason),
                    "has_usage": msg.HasField("usage"),
                    "usage": [msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens],
                    "prompt_logprobs": [[p.token_id, p.logprob, list(p.top_token_ids), p.rank]
                                        for p in msg.prompt_logprobs]})
    return out


def error(stub, **kw):
    try:
        stream(stub, **kw)
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details()}
    return {"code": "OK"}


def main():
    results = {}
    with grpc.insecure_channel(sys.argv[2]) as channel:
        stub = pb_grpc.GenerationStub(channel)
        models = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        results["models"] = [{"id": m.id, "max_model_len": m.max_model_len, "owned_by": m.owned_by} for m in models]
        name = models[0].id
        greedy = pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        results["token_ids"] = stream(stub, model=name, request_id="my-id-1",
                                      token_ids=pb.TokenIds(ids=[0, 400, 500, 600, 700]), sampling=greedy)
        results["text"] = stream(stub, model=name, text="def hello():", sampling=greedy)
        results["chat"] = stream(stub, model=name, chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="Say hello.")]), sampling=greedy)
        results["prompt_logprobs"] = stream(stub, model=name, token_ids=pb.TokenIds(ids=[0, 400, 500, 600, 700]),
                                            sampling=pb.SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
        results["named_chat"] = stream(stub, model=name, chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="Say hello.", name="alice")]), sampling=greedy)
        results["no_model_field"] = stream(stub, text="x", sampling=pb.SamplingParams(max_tokens=2))
        results["stop_token"] = stream(stub, model=name, token_ids=pb.TokenIds(ids=[0, 400, 500, 600, 700]),
                                       sampling=pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                                  stop_token_ids=[
                                                                      results["token_ids"][0]["token_ids"][0]]))
        seeded = pb.SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True)
        results["seeded"] = [stream(stub, model=name, text="import", sampling=seeded) for _ in range(2)]
        results["errors"] = {
            "unknown_model": error(stub, model="nope", text="x"),
            "no_prompt": error(stub, model=name),
            "negative_temperature": error(stub, model=name, text="x", sampling=pb.SamplingParams(temperature=-1)),
            "top_p_zero": error(stub, model=name, text="x", sampling=pb.SamplingParams(top_p=0.0)),
            "max_tokens_zero": error(stub, model=name, text="x", sampling=pb.SamplingParams(max_tokens=0)),
            "token_id_out_of_vocab": error(stub, model=name, token_ids=pb.TokenIds(ids=[1, 10 ** 6])),
            "empty_chat": error(stub, model=name, chat=pb.ChatMessages()),
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
