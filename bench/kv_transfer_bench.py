"""KV push bandwidth between two processes over NIXL, against an in-process memcpy ceiling.

Two processes: this one is the source (prefill side, pushes), a spawned child is the target
(decode side). Per block count, each repetition: the target gets ready and busy-polls for the
notification; the source stamps the clock and pushes; the target stamps the clock when it sees
the notification. Both stamps are CLOCK_MONOTONIC of one host, so end-to-end = target stamp -
source stamp. The last repetition of each size is byte-checked on the target.

    python bench/kv_transfer_bench.py --seed 0 --device cpu --shape tiny
    python bench/kv_transfer_bench.py --seed 0 --device cuda --shape 8b
    python bench/kv_transfer_bench.py --seed 0 --device cpu --shape 8b --target-heads 0:4   # a TP=2 rank

`--target-heads A:B`: the target holds only KV heads A..B-1 (a tensor-parallel rank's share) and
the source pushes those heads of its blocks: the head-split push between workers of different TP
sizes, one descriptor per (layer, block, K or V, token) (kvstore/movers/transfer.py).

Prints one JSON line per block count (stdout) and a table (stderr).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvstore.movers.transfer import KvTransferAgent, Strategy, TransferState  # noqa: E402
from splitserve.bench.records import git_sha  # noqa: E402


@dataclass(frozen=True, slots=True)
class Shape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    cuda_dtype: torch.dtype  # fp32 on the CPU always

    def dtype(self, device: str) -> torch.dtype:
        return self.cuda_dtype if device == "cuda" else torch.float32


PUSH_TIMEOUT_S = 60.0
SHAPES = {"tiny": Shape(4, 16, 2, 32, torch.float32),
          "8b": Shape(32, 16, 8, 128, torch.bfloat16)}  # Llama-3.1-8B


def make_cache(shape: Shape, num_blocks: int, device: str, gpu: int, fill: float | None,
               heads: int | None = None) -> torch.Tensor:
    dev = torch.device("cuda", gpu) if device == "cuda" else torch.device("cpu")
    dims = (shape.num_layers, num_blocks, 2, shape.block_size, heads or shape.num_kv_heads, shape.head_dim)
    kv = torch.empty(dims, dtype=shape.dtype(device), device=dev)
    if fill is not None:
        kv.fill_(fill)
    else:  # block (l, b) holds (7*l + b) % 256: exact in bf16, a misplaced block shows
        tag = ((7 * torch.arange(dims[0])[:, None] + torch.arange(dims[1])[None, :]) % 256).to(dev)
        kv.copy_(tag.to(kv.dtype).view(*dims[:2], 1, 1, 1, 1).expand(dims))
    return kv


def target_main(conn, shape: Shape, num_blocks: int, device: str, gpu: int, pthread: bool,
                heads: tuple[int, int] | None = None) -> None:
    kv = make_cache(shape, num_blocks, device, gpu, fill=-1.0, heads=heads and heads[1] - heads[0])
    agent = KvTransferAgent(f"bench-target-{os.getpid()}", kv, progress_thread=pthread,
                            head_start=heads[0] if heads else 0)
    conn.send(agent.metadata())
    while (msg := conn.recv()) is not None:
        tag, check = msg  # check: None, or (src blocks, dst blocks) to verify after this push
        if check is not None:
            kv.fill_(-1.0)
            if device == "cuda":
                torch.cuda.synchronize()
        conn.send("ready")
        deadline = time.monotonic() + PUSH_TIMEOUT_S
        while not (seen := any(n == tag for _, n in agent.take_notifications())):
            if time.monotonic() > deadline:
                break
        t_seen = time.monotonic_ns()
        conn.send((t_seen, seen and (check is None or verify(kv, *check))))
    agent.close()


def verify(kv: torch.Tensor, src_blocks: list[int], dst_blocks: list[int]) -> bool:
    want = (7 * torch.arange(kv.shape[0])[:, None] + torch.tensor(src_blocks)[None, :]) % 256
    got = kv[:, dst_blocks].flatten(2)
    return bool((got == want.to(kv.dtype).to(kv.device)[:, :, None]).all())


def busy_wait(agent: KvTransferAgent, handle, timeout_s: float) -> TransferState:
    """Like agent.wait without its back-off sleeps: our polls drive the progress that sends the notif."""
    deadline = time.monotonic() + timeout_s
    while agent.poll(handle) == TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0)  # yield: on a 2-core box the target busy-polls too
    return agent.wait(handle, 0.0)


def pick_blocks(rng: np.random.Generator, n: int, num_blocks: int, pattern: str) -> list[int]:
    if pattern == "scattered":
        return rng.choice(num_blocks, n, replace=False).tolist()
    start = int(rng.integers(0, num_blocks - n + 1))
    return list(range(start, start + n))


def memcpy_s(src: torch.Tensor, dst: torch.Tensor, nbytes: int, reps: int) -> float:
    """Median seconds of one in-process copy of nbytes (device-to-device on cuda)."""
    times = []
    for _ in range(reps + 1):
        sync(src)
        t0 = time.perf_counter()
        dst[:nbytes].copy_(src[:nbytes])
        sync(src)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--blocks", default=",".join(str(2**i) for i in range(10)))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pattern", choices=["contiguous", "scattered"], default="contiguous")
    ap.add_argument("--strategy", choices=[s.name.lower() for s in Strategy], default="auto")
    ap.add_argument("--target-gpu", type=int, default=0, help="cuda: the target's GPU (source: 0)")
    ap.add_argument("--progress-thread", action="store_true", help="NIXL progress thread (spins a core)")
    ap.add_argument("--target-heads", default=None, help="A:B: the target holds KV heads A..B-1 only (a TP rank)")
    args = ap.parse_args()
    heads = tuple(int(x) for x in args.target_heads.split(":")) if args.target_heads else None

    shape, blocks = SHAPES[args.shape], [int(b) for b in args.blocks.split(",")]
    if args.device == "cpu":  # one copy thread: the fair ceiling for UCX's single-threaded CMA copy
        torch.set_num_threads(1)  # (two torch threads took a flat 8 ms per copy on the 2-core box)
    rng = np.random.default_rng(args.seed)
    # uneven pools on purpose: the two sides never share a layout by accident
    src_num_blocks, dst_num_blocks = max(blocks) + 16, max(blocks) + 40
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    target = ctx.Process(target=target_main, daemon=True,
                         args=(child, shape, dst_num_blocks, args.device, args.target_gpu,
                               args.progress_thread, heads))
    target.start()
    kv = make_cache(shape, src_num_blocks, args.device, 0, fill=None)
    agent = KvTransferAgent(f"bench-source-{os.getpid()}", kv, strategy=Strategy[args.strategy.upper()],
                            progress_thread=args.progress_thread)
    peer = agent.add_peer(conn.recv())
    block_bytes = kv[0, 0].numel() * kv.element_size()
    if heads:                       # the bytes a push moves: the target's heads of each block
        block_bytes = block_bytes * (heads[1] - heads[0]) // shape.num_kv_heads
    flat = torch.empty(2, max(blocks) * shape.num_layers * block_bytes, dtype=torch.uint8, device=kv.device)

    def one_push(n: int, check: bool) -> tuple[float, float]:
        src = pick_blocks(rng, n, src_num_blocks, args.pattern)
        dst = pick_blocks(rng, n, dst_num_blocks, args.pattern)
        tag = f"{n}-{time.monotonic_ns()}".encode()
        conn.send((tag, (src, dst) if check else None))
        assert conn.recv() == "ready"
        sync(kv)
        t0 = time.monotonic_ns()
        handle = agent.push(peer, src, dst, tag)
        t_call = time.monotonic_ns() - t0
        state = busy_wait(agent, handle, PUSH_TIMEOUT_S)
        t_seen, ok = conn.recv()  # the target gives up after PUSH_TIMEOUT_S too
        if state != TransferState.DONE or not ok:
            sys.exit(f"push of {n} blocks: {state.name}; notification seen and bytes right: {ok}")
        return (t_seen - t0) / 1e9, t_call / 1e9

    one_push(1, check=False)  # connection setup, first-touch
    print(f"{'blocks':>6} {'MiB':>9} {'median_ms':>10} {'p90_ms':>9} {'call_ms':>8} "
          f"{'GB/s':>8} {'memcpy':>8} {'ratio':>6}", file=sys.stderr)
    for n in blocks:
        runs = [one_push(n, check=(r == args.reps)) for r in range(args.reps + 1)][1:]
        e2e = np.array([r[0] for r in runs])
        nbytes = n * shape.num_layers * block_bytes
        med, p90 = float(np.median(e2e)), float(np.percentile(e2e, 90))
        gbps = nbytes / med / 1e9
        memcpy_gbps = nbytes / memcpy_s(flat[0], flat[1], nbytes, args.reps) / 1e9
        row = {"bench": "kv_transfer", "git_sha": git_sha(), "device": args.device,
               "shape": args.shape, "blocks": n, "bytes": nbytes, "median_s": med, "p90_s": p90,
               "gbps": round(gbps, 3), "memcpy_gbps": round(memcpy_gbps, 3),
               "ratio": round(gbps / memcpy_gbps, 4), "call_median_s": float(np.median([r[1] for r in runs])),
               "strategy": args.strategy, "pattern": args.pattern, "reps": args.reps, "seed": args.seed,
               "target_heads": args.target_heads,
               "progress_thread": args.progress_thread}
        print(json.dumps(row), flush=True)
        print(f"{n:>6} {nbytes / 2**20:>9.2f} {med * 1e3:>10.3f} {p90 * 1e3:>9.3f} "
              f"{row['call_median_s'] * 1e3:>8.3f} {gbps:>8.2f} {memcpy_gbps:>8.2f} {row['ratio']:>6.3f}",
              file=sys.stderr, flush=True)
    conn.send(None)
    target.join(30)
    agent.close()


if __name__ == "__main__":
    main()
