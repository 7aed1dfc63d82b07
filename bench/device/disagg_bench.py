"""Prefill → decode KV handoff on one GPU, two processes: GB/s and the share of TTFT it costs.

One command on the GPU machine:
    python bench/device/disagg_bench.py --arch llama-3.1-8b --lengths 512,1024,2048,4096,8192,16384,32768

The prefill process P and the decode process D each run the real engine on a Llama-3.1-8B-
architecture model with the same random bf16 weights (load_format=dummy). For each prompt
length: D reserves blocks for the prompt (the engine's remote-prefill path), P computes the prompt
(one-token request whose blocks stay pinned), pushes the KV of every prompt block into D's
blocks with NIXL (UCX, VRAM → VRAM WRITE, notification = request id), D sees the notification,
continues from P's first token and decodes a few tokens. Reported per length (median of --reps):
prefill_s (P), transfer_s (push start → D saw the notification), GB/s, the share of TTFT spent
moving KV = transfer / (prefill + transfer + D's first decode step), and whether D's tokens equal
P decoding the same prompt itself (the bytes moved are the right ones). A device-to-device copy
of the same bytes is the ceiling. JSON lines on stdout.

Two GPUs (`--prefill-gpu 0 --decode-gpu 1`): P runs on one, D on the other, each process seeing only
its own GPU as `serve` places workers (CUDA_VISIBLE_DEVICES; `--visibility all`: both see both, P
and D pick theirs), and the ceiling is a torch peer copy GPU to GPU (NVLink where the GPUs have it)
of the same bytes, measured in this run by a process that sees both. Run with UCX_PROTO_INFO=y to
have UCX print the protocol and transport it picks (cuda_ipc: a copy GPU to GPU; cuda_copy with
host memory: staged through the host).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import git_sha  # noqa: E402  (sets sys.path)


PEER_COPY = """
import sys, time, torch
n, reps = int(sys.argv[1]), 10
src = torch.empty(n, dtype=torch.uint8, device="cuda:0"); dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
dst.copy_(src); torch.cuda.synchronize(0); torch.cuda.synchronize(1)
t = time.perf_counter()
for _ in range(reps):
    dst.copy_(src)
torch.cuda.synchronize(0); torch.cuda.synchronize(1)
print(n * reps / (time.perf_counter() - t) / 1e9)
"""


def peer_copy_gbps(src_gpu: int, dst_gpu: int, nbytes: int) -> float | None:
    """GB/s of a torch copy of `nbytes` from GPU `src_gpu` to GPU `dst_gpu` (a process seeing both)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": f"{src_gpu},{dst_gpu}", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    r = subprocess.run([sys.executable, "-c", PEER_COPY, str(nbytes)], env=env, capture_output=True, text=True,
                       timeout=120)
    return round(float(r.stdout.split()[-1]), 1) if r.returncode == 0 and r.stdout.strip() else None


def pin_gpu(gpu: int | None, visibility: str) -> None:
    """Put this process (and what it spawns next) on GPU `gpu`: alone (own) or among all (all)."""
    if gpu is None:
        return
    if visibility == "own":
        os.environ.update(CUDA_VISIBLE_DEVICES=str(gpu), CUDA_DEVICE_ORDER="PCI_BUS_ID")
    else:
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ["SPLITSERVE_BENCH_GPU"] = str(gpu)


def use_pinned_gpu() -> None:
    """With --visibility all: make the GPU chosen by pin_gpu current before the engine allocates."""
    gpu = os.environ.get("SPLITSERVE_BENCH_GPU")
    if gpu is not None and torch.cuda.is_available():
        torch.cuda.set_device(int(gpu))


def make_engine(model_dir: str, num_blocks: int, budget: int, device: str = "cuda", load_format: str = "dummy"):
    from engine.engine import Engine
    from runtime.config import EngineConfig
    return Engine(EngineConfig(model=model_dir, device=device, load_format=load_format, num_blocks=num_blocks,
                               max_num_batched_tokens=budget, seed=0))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def checksum(kv: torch.Tensor, blocks: list[int]) -> int:
    """Exact fingerprint of the KV bytes of `blocks` (all layers), comparable across processes."""
    idx = torch.tensor(blocks, device=kv.device)
    total = 0
    for layer in range(kv.shape[0]):          # one layer at a time: bounded memory at 32k tokens
        x = kv[layer].index_select(0, idx).contiguous().view(torch.int16).to(torch.int64).flatten()
        w = (torch.arange(1, x.numel() + 1, device=kv.device, dtype=torch.int64) * (layer + 1)) % 65521
        total += int((x * w).sum().item())
    return total


def run_until(engine, rid: str):
    while True:
        for o in engine.step().outputs:
            if o.request_id == rid:
                return o


def decode_side(conn, model_dir: str, num_blocks: int, budget: int, decode_tokens: int, device: str,
                load_format: str) -> None:
    """D: reserve blocks, receive the push, continue decoding."""
    from runtime.types import EngineRequest, SamplingParams
    from kvstore.movers.transfer import KvTransferAgent
    use_pinned_gpu()
    engine = make_engine(model_dir, num_blocks, budget, device, load_format)
    agent = KvTransferAgent("decode", engine.runner.kv_cache)
    conn.send(agent.metadata())
    while True:
        msg = conn.recv()
        if msg is None:
            break
        rid, prompt = msg
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=decode_tokens,
                                                                     ignore_eos=True), remote_prefill=True))
        (res,) = engine.step().reservations  # admits it: blocks reserved, no compute
        conn.send(res.block_ids)
        first_token = conn.recv()           # P's answer (arrives with or after the push)
        seen = None
        while seen is None:                 # our polls drive the target side of the transfer
            for _peer, notif in agent.take_notifications():
                if notif.decode() == rid:
                    seen = time.monotonic()
        d_sum = checksum(engine.runner.kv_cache, res.block_ids)    # before decoding writes into the last block
        out = engine.kv_arrived(rid, first_token)
        tokens = list(out.new_token_ids)
        sync(device)
        t0 = time.perf_counter()
        first_step = None
        while len(tokens) < decode_tokens:
            for o in engine.step().outputs:
                tokens.extend(o.new_token_ids)
            if first_step is None:
                sync(device)
                first_step = time.perf_counter() - t0
        conn.send((seen, first_step, tokens, d_sum))
    agent.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=int, default=8192, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a real HF directory instead of --arch (e.g. for a CPU smoke run)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prefill-gpu", type=int, default=None, help="P's GPU (default: the one GPU P and D share)")
    ap.add_argument("--decode-gpu", type=int, default=None, help="D's GPU")
    ap.add_argument("--visibility", default="own", choices=["own", "all"],
                    help="own: each process sees only its GPU (as serve places workers); all: both see both")
    args = ap.parse_args()
    dev = args.device
    from engine.loader import write_arch_dir
    from runtime.types import EngineRequest, SamplingParams
    from kvstore.movers.transfer import KvTransferAgent, TransferState

    lengths = [int(x) for x in args.lengths.split(",")]
    if args.model:
        from splitserve.models import resolve_model
        model_dir, load_format = resolve_model(args.model), "auto"
    else:
        model_dir, load_format = str(write_arch_dir(args.arch, Path(tempfile.mkdtemp()) / args.arch)), "dummy"
    num_blocks = max(lengths) // 16 + 64
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    two_gpus = args.decode_gpu is not None and args.prefill_gpu is not None and args.decode_gpu != args.prefill_gpu
    pin_gpu(args.decode_gpu, args.visibility)             # the child inherits this environment ...
    dproc = ctx.Process(target=decode_side, args=(child, model_dir, num_blocks, args.budget, args.decode_tokens,
                                                         dev, load_format))
    dproc.start()
    pin_gpu(args.prefill_gpu, args.visibility)            # ... and this process uses its own GPU
    use_pinned_gpu()
    engine = make_engine(model_dir, num_blocks, args.budget, dev, load_format)
    agent = KvTransferAgent("prefill", engine.runner.kv_cache)
    peer = agent.add_peer(parent.recv())
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    vocab = engine.runner.model_config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    sha = git_sha()
    for length in lengths:
        rows = []
        for rep in range(args.reps + 1):                      # the first is a warm-up
            prompt = torch.randint(10, vocab - 10, (length,), generator=g).tolist()
            rid = f"r{length}-{rep}"
            parent.send((rid, prompt))
            dest = parent.recv()
            req = EngineRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                hold_blocks=True)
            sync(dev)
            t0 = time.perf_counter()
            engine.add_request(req)
            out = run_until(engine, rid)
            sync(dev)
            prefill_s = time.perf_counter() - t0
            n = -(-length // 16)
            start = time.monotonic()
            h = agent.push(peer, out.held_block_ids[:n], dest[:n], rid.encode())
            parent.send(out.new_token_ids[0])
            while agent.poll(h) == TransferState.PENDING:
                pass
            seen, first_step_s, d_tokens, d_sum = parent.recv()
            kv_match = d_sum == checksum(engine.runner.kv_cache, out.held_block_ids[:n])
            engine.release_held(rid)
            assert h.state == TransferState.DONE
            # P decodes the same prompt itself: D's continuation must be identical
            check = EngineRequest(rid + "-p", prompt, SamplingParams(temperature=0, max_tokens=args.decode_tokens,
                                                                  ignore_eos=True))
            engine.add_request(check)
            p_tokens = []
            while len(p_tokens) < args.decode_tokens:
                for o in engine.step().outputs:
                    p_tokens.extend(o.new_token_ids)
            if rep:
                rows.append((prefill_s, seen - start, first_step_s, h.num_bytes, p_tokens == d_tokens, kv_match))
        nbytes = rows[0][3]
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)
        sync(dev)
        t = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        sync(dev)
        memcpy_gbps = nbytes * 5 / (time.perf_counter() - t) / 1e9
        peer_gbps = peer_copy_gbps(args.prefill_gpu, args.decode_gpu, nbytes) if two_gpus else None
        prefill = statistics.median(r[0] for r in rows)
        transfer = statistics.median(r[1] for r in rows)
        first_step = statistics.median(r[2] for r in rows)
        print(json.dumps({
            "bench": "disagg_handoff", "git_sha": sha, "device": device, "model": args.model or args.arch + " (random bf16)",
            "prompt_tokens": length, "kv_bytes": nbytes, "prefill_s": round(prefill, 5),
            "prefill_tok_s": round(length / prefill), "transfer_s": round(transfer, 6),
            "transfer_gbps": round(nbytes / transfer / 1e9, 3), "memcpy_gbps": round(memcpy_gbps, 1),
            "prefill_gpu": args.prefill_gpu, "decode_gpu": args.decode_gpu, "visibility": args.visibility,
            "peer_copy_gbps": peer_gbps,
            "transfer_vs_peer_copy": round(nbytes / transfer / 1e9 / peer_gbps, 3) if peer_gbps else None,
            "decode_first_step_s": round(first_step, 5),
            "ttft_s": round(prefill + transfer + first_step, 5),
            "kv_share_of_ttft": round(transfer / (prefill + transfer + first_step), 4),
            "kv_bytes_match": all(r[5] for r in rows), "tokens_match": all(r[4] for r in rows), "reps": args.reps, "prefill_chunk": args.budget,
            "transport": "NIXL UCX WRITE, two processes" + (
                (", GPU to GPU (VRAM->VRAM)" if two_gpus else ", one GPU (VRAM->VRAM)") if dev == "cuda"
                else " (DRAM)")}), flush=True)
    parent.send(None)
    dproc.join(timeout=60)
    agent.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
