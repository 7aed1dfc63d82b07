"""KV tier bandwidth: device pool <-> host RAM (G1 <-> G2) and host RAM <-> disk (G2 <-> G3), each
against a ceiling this script measures on the same machine in the same run.

Ceilings:
- ``memcpy``: one contiguous copy of the largest batch's bytes; on CUDA a pinned host <-> device
  copy each way (the issue's "55 GB/s pinned-copy ceiling" on the H100), on the CPU host <-> host.
- ``disk_seq`` write / read: one file of ``--disk-mib`` written in 8 MiB sequential O_DIRECT
  writes then fdatasync, and read back the same way (buffered + fadvise DONTNEED where O_DIRECT is
  not supported), in ``--dir``; one I/O at a time (dd) and four in flight; the better is the ceiling.

Paths, per batch size (blocks of the model's shape; G1 blocks scattered at random, host slots one
run, as a batch reserved together is):
- ``g1_g2``: kvstore/movers/host_copy.py, movers ``torch`` (staging gather + one copy per slot run, side
  stream) and ``nixl`` (UCX loopback), directions offload (G1 -> G2) and onboard (G2 -> G1).
- ``write_back``: the tier manager writing admitted host blocks to disk on its I/O thread while a
  step loop polls it: GB/s, ``poll()`` times, and the loop's longest gaps against an idle run.
- ``g2_g3``: kvstore/movers/disk_pool.py's full write (unindex, preallocated slabs, xxh3 checksums, write,
  fdatasync, index commit) and read (with checksum verification), file I/O ``nixl`` (POSIX, AIO),
  ``nixl-uring`` and ``os`` (pwritev/preadv); plus ``file_io`` rows: the bare I/O of the same
  batch (no checksums, no index, no sync) to show what the tier's safety costs.

    python bench/kv_tiers_bench.py --seed 0 --device cpu --shape 8b --dir /tmp/kvtiers
    python bench/kv_tiers_bench.py --seed 0 --device cuda --shape 8b --dir /local/nvme/kvtiers

Prints one JSON line per measurement (stdout) and a table (stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvstore.block_format import BlockFormat  # noqa: E402
from kvstore.movers.disk_pool import DiskConfig, DiskPool, ReadItem, WriteItem  # noqa: E402
from kvstore.movers.host_copy import make_host_copy  # noqa: E402
from kvstore.movers.host_pool import HostPool  # noqa: E402
from kvstore.movers.transfer import nixl_available  # noqa: E402
from splitserve.bench.records import git_sha  # noqa: E402

# (layers, block_size, kv_heads, head_dim, dtype): KV bytes per block = layers*2*bs*heads*dim*itemsize
SHAPES = {"tiny": (4, 16, 2, 32, torch.float32),          # 32 KiB blocks
          "8b": (32, 16, 8, 128, torch.bfloat16)}         # Llama-3.1-8B: 2 MiB blocks, 128 KiB/token


def median_s(fn, reps: int) -> float:
    fn()                                  # warm-up: page faults, allocator, NIXL connection
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def memcpy_ceilings(nbytes: int, device: str, reps: int) -> dict[str, float]:
    """GB/s of one contiguous copy of ``nbytes``: offload and onboard directions."""
    if device == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def d2h():
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()

        def h2d():
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
        return {"offload": nbytes / median_s(d2h, reps) / 1e9, "onboard": nbytes / median_s(h2d, reps) / 1e9}
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    bw = nbytes / median_s(lambda: b.copy_(a), reps) / 1e9
    return {"offload": bw, "onboard": bw}


def disk_ceilings(d: str, mib: int, reps: int, depth: int) -> tuple[dict[str, float], bool]:
    """Sequential write (synced) and read GB/s of one file in 8 MiB I/Os, O_DIRECT where supported,
    ``depth`` I/Os in flight (threads issuing consecutive chunks; 1 is dd)."""
    from concurrent.futures import ThreadPoolExecutor
    chunk = 8 << 20
    n = max(depth, (mib << 20) // chunk)
    bufs = [mmap.mmap(-1, chunk) for _ in range(depth)]
    for b in bufs:
        b.write(np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    path = os.path.join(d, "seq-ceiling.bin")
    direct = True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        direct = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, n * chunk)
    pool = ThreadPoolExecutor(depth)

    def lane(k: int, write: bool) -> None:
        for i in range(k, n, depth):
            (os.pwritev if write else os.preadv)(fd, [bufs[k]], i * chunk)

    def write():
        list(pool.map(lambda k: lane(k, True), range(depth)))
        os.fdatasync(fd)

    def read():
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        list(pool.map(lambda k: lane(k, False), range(depth)))
    out = {"write": n * chunk / median_s(write, reps) / 1e9, "read": n * chunk / median_s(read, reps) / 1e9}
    pool.shutdown()
    os.close(fd)
    os.unlink(path)
    return out, direct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--blocks", default="1,4,16,64", help="batch sizes (blocks)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--disk-mib", type=int, default=256, help="bytes of the sequential disk ceiling")
    ap.add_argument("--movers", default="torch,nixl")
    ap.add_argument("--file-ios", default="nixl,nixl-uring,os")
    args = ap.parse_args()
    if nixl_available():        # NIXL's logger prints INFO on stdout, among our JSON lines
        import nixl  # noqa: F401
        logging.getLogger("nixl").setLevel(logging.WARNING)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    if args.device == "cpu":
        torch.set_num_threads(1)    # a copy is memory-bound; intra-op threads only add waits on a shared box
    sizes = [int(x) for x in args.blocks.split(",")]
    max_n = max(sizes)
    layers, bs, heads, dim, dtype = SHAPES[args.shape]
    num_g1 = 2 * max_n + 8
    dev = torch.device(args.device)
    kv = torch.randn(layers, num_g1, 2, bs, heads, dim, device=dev).to(dtype)
    fmt = BlockFormat.of(kv, f"bench-{args.shape}")
    base = {"bench": "kv_tiers", "git_sha": git_sha(), "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "shape": args.shape, "block_bytes": fmt.block_bytes, "layer_bytes": fmt.layer_bytes,
            "reps": args.reps, "seed": args.seed}

    def emit(row: dict) -> None:
        row = {**base, **row}
        print(json.dumps(row), flush=True)
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else "-"
        print(f"{row['path']:14s} {row.get('via', ''):11s} {row.get('direction', ''):9s} "
              f"{row.get('blocks', ''):>4} {row['gbps']:8.2f} GB/s  ratio {ratio}", file=sys.stderr)

    ceiling_bytes = max(max_n * fmt.block_bytes, 64 << 20)
    mem = memcpy_ceilings(ceiling_bytes, args.device, args.reps)
    for direction, bw in mem.items():
        emit({"path": "memcpy", "direction": direction, "bytes": ceiling_bytes, "gbps": round(bw, 3)})

    host = HostPool(fmt, (max_n + 8) * fmt.block_bytes, pin_memory=args.device == "cuda")
    for name in args.movers.split(","):
        if name == "nixl" and not nixl_available():
            continue
        mover = make_host_copy(name, kv, host)
        for n in sizes:
            blocks = rng.choice(num_g1, n, replace=False)
            slots = np.arange(n)

            def offload():
                h = mover.offload(blocks, slots)
                while not mover.done(h):
                    pass

            def onboard():
                h = mover.onboard(slots, blocks)
                while not mover.done(h):
                    pass
            for direction, fn in (("offload", offload), ("onboard", onboard)):
                bw = n * fmt.block_bytes / median_s(fn, args.reps) / 1e9
                emit({"path": "g1_g2", "via": name, "direction": direction, "blocks": n,
                      "bytes": n * fmt.block_bytes, "gbps": round(bw, 3), "ceiling_gbps": round(mem[direction], 3),
                      "ratio": round(bw / mem[direction], 4)})
        mover.close()

    tmp = args.dir or tempfile.mkdtemp(prefix="kvtiers-bench-")
    os.makedirs(tmp, exist_ok=True)
    ceil = {"write": 0.0, "read": 0.0}
    for depth in (1, 4):                  # the better of dd-like and 4 I/Os in flight is the ceiling
        c, direct = disk_ceilings(tmp, args.disk_mib, args.reps, depth)
        for direction, bw in c.items():
            emit({"path": "disk_seq", "via": f"qd{depth}", "direction": direction, "direct_io": direct,
                  "bytes": args.disk_mib << 20, "gbps": round(bw, 3)})
            ceil[direction] = max(ceil[direction], bw)
    host.data[:] = rng.integers(0, 256, host.data.shape, dtype=np.uint8)
    for io_name in args.file_ios.split(","):
        if io_name.startswith("nixl") and not nixl_available():
            continue
        d = os.path.join(tmp, f"tier-{io_name}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        disk = DiskPool(fmt, DiskConfig(d, (max_n + 8) * fmt.block_bytes, file_io=io_name), host)
        for n in sizes:
            dslots = [disk.slots.reserve(1_000_000 + i, None) for i in range(n)]
            items = [WriteItem(s, 1_000_000 + i, None, i) for i, s in enumerate(dslots)]
            reads = [ReadItem(s, 1_000_000 + i, i) for i, s in enumerate(dslots)]

            def write():
                assert disk.write(items) == [None] * n

            def read():
                if not disk.direct:
                    for fd in disk._fds.values():
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert disk.read(reads) == [None] * n
            write()                       # creates the slabs the bare I/O rows address
            raw = [(disk.host.slot_addr(i), *disk._where(s)) for i, s in enumerate(dslots)]
            args_io = ([r[0] for r in raw], [disk._fds[r[1]] for r in raw], [r[2] for r in raw], fmt.block_bytes)
            for kind, direction, fn, ceiling in (
                    ("g2_g3", "offload", write, ceil["write"]), ("g2_g3", "onboard", read, ceil["read"]),
                    ("file_io", "offload", lambda: disk.file_io.write(*args_io), ceil["write"]),
                    ("file_io", "onboard", lambda: disk.file_io.read(*args_io), ceil["read"])):
                bw = n * fmt.block_bytes / median_s(fn, args.reps) / 1e9
                emit({"path": kind, "via": disk.file_io.name, "direct_io": disk.direct, "direction": direction,
                      "blocks": n, "bytes": n * fmt.block_bytes, "gbps": round(bw, 3),
                      "ceiling_gbps": round(ceiling, 3), "ratio": round(bw / ceiling, 4)})
            disk.slots.abort(dslots)
        disk.close()
        shutil.rmtree(d, ignore_errors=True)
    write_back(fmt, tmp, max_n, rng, emit)
    if args.dir is None:
        shutil.rmtree(tmp, ignore_errors=True)


def write_back(fmt: BlockFormat, tmp: str, max_n: int, rng, emit) -> None:
    """The tier manager's write-back of ``4 * max_n`` admitted host blocks to disk, as a step loop
    sees it: how long each ``poll()`` takes, and the longest gap in a loop of 0.1 ms work units
    (what the I/O thread's GIL holds cost the loop), against the same loop with the disk idle."""
    from kvstore.tiers import TierConfig, TierManager
    n = 4 * max_n
    d = os.path.join(tmp, "tier-manager")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    tiers = TierManager(fmt, TierConfig(n * fmt.block_bytes, DiskConfig(d, (n + 8) * fmt.block_bytes),
                                        max_disk_inflight_blocks=64, disk_batch_blocks=32, clean_fraction=1.0))
    tiers.host.data[:] = rng.integers(0, 256, tiers.host.data.shape, dtype=np.uint8)
    hashes = [int(h) for h in rng.integers(1, 2**63, n, dtype=np.uint64)]
    for _ in range(2):
        tiers.record_use(hashes)                       # admitted: used twice

    def step_loop(until) -> tuple[list[float], list[float]]:
        polls, gaps = [], []
        last = time.perf_counter()
        while not until():
            t0 = time.perf_counter()
            tiers.poll()
            polls.append(time.perf_counter() - t0)
            for _ in range(10):                       # ~1 ms of "step" work in 0.1 ms units
                t = time.perf_counter()
                while time.perf_counter() - t < 1e-4:
                    pass
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
        return polls, gaps
    end = time.perf_counter() + 0.5
    _, idle_gaps = step_loop(lambda: time.perf_counter() > end)
    slots = [p[1] for p in tiers.reserve_offload(hashes, [None] * n)]
    tiers.offload_landed(slots)                        # as if copied down from the device
    t0 = time.perf_counter()
    polls, gaps = step_loop(lambda: tiers.disk.slots.num_ready == n)
    secs = time.perf_counter() - t0
    pct = lambda xs, q: float(np.percentile(np.array(xs) * 1e3, q))   # noqa: E731
    emit({"path": "write_back", "via": tiers.disk.file_io.name, "direction": "offload", "blocks": n,
          "bytes": n * fmt.block_bytes, "gbps": round(n * fmt.block_bytes / secs / 1e9, 3),
          "poll_ms_p50": round(pct(polls, 50), 4), "poll_ms_max": round(max(polls) * 1e3, 3),
          "loop_gap_ms_p99": round(pct(gaps, 99), 3), "loop_gap_ms_max": round(max(gaps) * 1e3, 3),
          "idle_loop_gap_ms_p99": round(pct(idle_gaps, 99), 3), "idle_loop_gap_ms_max": round(max(idle_gaps) * 1e3, 3)})
    tiers.close()
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
