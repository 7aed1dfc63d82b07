"""A stand-in worker process for the pool controller's tests: it takes a lease in Redis as a real
worker does (starting, then ready), drains on SIGTERM (draining, then its lease goes, exit 0), and
with --crash-after S exits 1 after S seconds. No engine, no gRPC: it starts in a fraction of a second.

    python tests/integration/stand_in_worker.py REDIS_URL NAME ROLE [--crash-after S]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis.asyncio as aioredis  # noqa: E402

from runtime.discovery import Lease, WorkerInfo  # noqa: E402


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("redis_url")
    ap.add_argument("name")
    ap.add_argument("role")
    ap.add_argument("--crash-after", type=float, default=None)
    args = ap.parse_args()
    if args.crash_after == 0:
        return 1
    client = aioredis.Redis.from_url(args.redis_url)
    info = WorkerInfo(f"{args.name}-{uuid.uuid4().hex[:6]}", args.role, "127.0.0.1:1", "m", 16, 0,
                      state="starting", name=args.name, started_at=time.time())
    lease = Lease(client, "splitserve", info, 2.0)
    await lease.start()
    await lease.update(state="ready", num_blocks=100)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), args.crash_after)
    except asyncio.TimeoutError:
        return 1
    await lease.update(state="draining")
    await asyncio.sleep(0.3)
    await lease.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
