"""Host time per engine step that the KV tiers' bookkeeping costs, on the CPU (docs/kv_tiers.md,
"Offload policy"). With async scheduling the host work of a step overlaps the device's, so it
reaches decode ITL only once it exceeds the device step; these are the figures to watch.

  PYTHONPATH=$PWD python bench/kv_tiers_step_cost.py [--only poll,mock] [--steps 200] [--rounds 2]

- ``poll``: ``TierManager.poll()`` with a full host tier (6,144 slots: 12 GiB of 2 MiB blocks)
  whose blocks disk admission rejects (seen once), as in a decode of new prompts. First with the
  tables unchanged between calls, then with 4 new blocks entering G2 before each call (what a
  64-row decode under G1 pressure adds).
- ``mock``: the mock engine with its host tier and the 8B's modelled blocks, its modelled device
  time removed (so a step is host work only). A batch of 64 x 1k-token prompts decodes for
  ``--steps`` steps with the tiers off, then on under G1 pressure (the previous phase's cached
  blocks, not in G2, sit where the allocations come from), ``--rounds`` times interleaved, then on
  with room in G1 (nothing cached at risk). Each phase reports its G1 -> G2 blocks too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from kv_tiers_bench import git_sha  # noqa: E402
from kvstore.block_format import BlockFormat  # noqa: E402
from kvstore.movers.disk_pool import DiskConfig  # noqa: E402
from kvstore.pools.tier_policy import TierPath  # noqa: E402
from kvstore.tiers import TierConfig, TierManager  # noqa: E402


def quantiles_ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_ms": round(statistics.median(xs) * 1e3, 4), "p90_ms": round(xs[int(0.9 * len(xs))] * 1e3, 4)}


def bench_poll(emit, steps: int, slots: int = 6144) -> None:
    fmt = BlockFormat("step-cost", 1, 4096, 16, "bench")      # small blocks: the bookkeeping is per block
    with tempfile.TemporaryDirectory() as d:
        t = TierManager(fmt, TierConfig(slots * fmt.block_bytes, DiskConfig(d, 2 * slots * fmt.block_bytes)))
        try:
            for i in range(slots):
                t.host.slots.commit([t.host.slots.reserve(i + 1, None)])
            t.take_events()
            nxt = slots
            for new_per_step in (0, 4):
                times = []
                for _ in range(steps):
                    for _ in range(new_per_step):
                        nxt += 1
                        t.host.slots.commit([t.host.slots.reserve(nxt, None)])
                    t0 = time.perf_counter()
                    t.poll()
                    times.append(time.perf_counter() - t0)
                t.take_events()
                emit(section="poll", host_slots=slots, new_blocks_per_step=new_per_step, steps=steps,
                     **quantiles_ms(times))
        finally:
            t.close()


def bench_mock(emit, steps: int, rounds: int) -> None:
    from engine.engine import Engine
    from engine.mock_runner import MockModelRunner
    from runtime.config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams
    from splitserve.models import resolve_model

    cfg = EngineConfig(model=resolve_model("tiny"), mock=True, num_blocks=8192, kv_host_gib=12.0,
                       max_num_batched_tokens=8192, max_model_len=4096, kv_onboard="always")
    eng = Engine(cfg, runner=MockModelRunner(cfg, sleep=lambda s: None))
    io = eng.tier_io
    ids = iter(range(1 << 62))

    def offloaded_blocks() -> int:
        return eng.tiers.stats().path_bytes[TierPath.G1_TO_G2] // eng.tiers.fmt.block_bytes

    def steady(seed: int, n: int, batch: int = 64, ctx: int = 1024) -> tuple[list[float], int]:
        rng = np.random.default_rng(seed)
        sp = SamplingParams(temperature=0, max_tokens=n + 64, ignore_eos=True)
        for _ in range(batch):
            eng.add_request(EngineRequest(f"d{next(ids)}", rng.integers(1, 200, ctx).tolist(), sp))
        while len(eng.scheduler.running) < batch or any(r.num_computed_tokens < r.num_prompt_tokens
                                                        for r in eng.scheduler.running):
            eng.step()
        before, times = offloaded_blocks(), []
        for _ in range(n):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        moved = offloaded_blocks() - before
        for r in list(eng.scheduler.requests):
            eng.abort_request(r)
        while eng.has_work:
            eng.step()
        return times, moved

    def attach(on: bool) -> None:
        eng.tier_io, eng.scheduler.onboarding = (io, io.onboarding) if on else (None, None)

    try:
        steady(1, 16)                                              # warm-up, tiers on
        phases: dict[str, tuple[list[float], int]] = {}
        for r in range(rounds):
            for name, on in (("off", False), ("on_pressure", True)):
                attach(on)
                times, moved = steady(10 * r + on, steps)
                prev = phases.get(name, ([], 0))
                phases[name] = (prev[0] + times, prev[1] + moved)
        eng.pool.reset_cache()
        eng.pool.take_events()
        phases["on_room"] = steady(99, steps)
        for name, (times, moved) in phases.items():
            emit(section="mock", phase=name, steps=len(times), offloaded_blocks=moved,
                 offload_window_blocks=io.onboarding.offload_window, **quantiles_ms(times))
    finally:
        attach(True)
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="poll,mock")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    base = {"bench": "kv_tiers_step_cost", "git_sha": git_sha(), "device": "cpu"}

    def emit(**row) -> None:
        print(json.dumps({**base, **row}), flush=True)

    only = set(args.only.split(","))
    if "poll" in only:
        bench_poll(emit, args.steps)
    if "mock" in only:
        bench_mock(emit, args.steps, args.rounds)


if __name__ == "__main__":
    main()
