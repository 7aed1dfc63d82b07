"""The parts of a frontend token's CPU, each alone: the Python token path, and grpc.aio's receive.

    python bench/frontend_token_cost.py [--steps 256 --streams 32 --messages 2000] [--output FILE]

`token_path`: the pushed path of frontend/generation.py and frontend/sse.py in this process, with
the tiny model's real tokenizer and metrics: worker `StepOutput`s (serialized, `--streams` deltas
of one token each) are parsed and fanned out to `--streams` generations, each detokenizing,
encoding its SSE event and writing it to a transport that only counts bytes. CPU per token.

`grpc_receive`: a grpc.aio server in a child process streams `--messages` `StepOutput`s of
`--streams` deltas, one every 4 ms (an engine step's pace); the client here reads them on asyncio's
and on uvloop's loop and reports its CPU per message: the fixed cost the frontend pays for each
worker step, whatever the message holds. Prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from proto.splitserve.v1 import worker_pb2  # noqa: E402
from splitserve.bench.records import cpu_model, git_sha  # noqa: E402


def token_path(steps: int, streams: int) -> float:
    """CPU microseconds per token of the pushed path, in this process."""
    from frontend.generate import GenerateInput, Generator
    from frontend.generation import Generation
    from frontend.latency_publisher import LatencyPublisher
    from frontend.sse import ChunkEncoder
    from frontend.tokenizer import ModelTokenizer
    from runtime.metrics import FrontendMetrics
    from runtime.types import SamplingParams
    from splitserve.models import resolve_model

    class Router:
        def first_token(self, rid): pass
        def finished(self, *a): pass

    class Pool:
        router = Router()

    class Conn:
        def cancel(self, rid): pass

    class Transport:
        def __init__(self) -> None:
            self.bytes = 0

        def write(self, data: bytes) -> None:
            self.bytes += len(data)

    g = Generator(Pool(), ModelTokenizer(resolve_model("tiny")), FrontendMetrics(), 1 << 20)
    latency = LatencyPublisher(None, "bench")
    g.on_first_token, g.on_itls = latency.first_token, latency.inter_tokens
    transport = Transport()

    async def run() -> float:
        gens = {}
        for i in range(streams):
            enc = ChunkEncoder(f"cmpl-{i:032x}", 1767225600, "tiny", False, True)

            def on_delta(d, enc=enc):
                data = enc.encode(d, None)
                transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            gen = Generation(g, GenerateInput([1] * 128, SamplingParams(max_tokens=steps)), on_delta)
            gen.conn = Conn()
            gens[gen.rid] = gen
        rng = random.Random(0)
        wire = [worker_pb2.StepOutput(deltas=[worker_pb2.RequestDelta(request_id=rid, token_ids=[rng.randrange(300, 4000)])
                                              for rid in gens]).SerializeToString() for _ in range(steps)]
        t0 = time.process_time()
        for raw in wire:
            for d in worker_pb2.StepOutput.FromString(raw).deltas:
                gens[d.request_id].put_nowait(d)
        return (time.process_time() - t0) / (steps * streams) * 1e6
    return asyncio.run(run())


def serve(port: int, messages: int, streams: int) -> None:
    import grpc

    from proto.splitserve.v1 import worker_pb2_grpc
    msg = worker_pb2.StepOutput(deltas=[worker_pb2.RequestDelta(request_id=f"{i:032x}", token_ids=[i])
                                        for i in range(streams)])

    class Service(worker_pb2_grpc.WorkerServicer):
        async def Session(self, request_iterator, context):
            for _ in range(messages):
                await asyncio.sleep(0.004)
                yield msg

    async def main() -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(Service(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()
    asyncio.run(main())


def grpc_receive(port: int, messages: int, use_uvloop: bool) -> float:
    """CPU microseconds per message read on one Session stream."""
    import grpc

    from proto.splitserve.v1 import worker_pb2_grpc

    async def main() -> float:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = worker_pb2_grpc.WorkerStub(channel)

        async def requests():
            await asyncio.sleep(3600)
            yield worker_pb2.SessionRequest()
        call = stub.Session(requests())
        n, t0 = 0, time.process_time()
        async for _ in call:
            n += 1
            if n == messages:
                break
        cpu = time.process_time() - t0
        call.cancel()
        await channel.close()
        return cpu / n * 1e6
    if use_uvloop:
        import uvloop
        return uvloop.run(main())
    return asyncio.run(main())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--output", default=None)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve, args.messages * 2, args.streams)
        return 0
    common = {"bench": "frontend_token_cost", "git_sha": git_sha(), "cpu_model": cpu_model(),
              "device": f"cpu ({os.cpu_count()} cores)", "streams": args.streams,
              "load_avg_1m": round(os.getloadavg()[0], 2)}
    rows = [{**common, "part": "token_path", "steps": args.steps,
             "cpu_us_per_token": round(token_path(args.steps, args.streams), 2)}]
    from runtime.redis_embedded import free_port
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--messages", str(args.messages),
                               "--streams", str(args.streams)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        server.stdout.readline()
        for loop in ("asyncio", "uvloop"):
            rows.append({**common, "part": "grpc_receive", "loop": loop, "messages": args.messages,
                         "cpu_us_per_message": round(grpc_receive(port, args.messages, loop == "uvloop"), 1)})
    finally:
        server.kill()
        server.wait()
    with open(args.output, "a") if args.output else open(os.devnull, "w") as out:
        for row in rows:
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
