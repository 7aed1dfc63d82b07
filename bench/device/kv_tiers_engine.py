"""KV tiers in the engine, on the device: what the issue's H100 targets ask for, past the movers'
bandwidth (bench/kv_tiers_bench.py measures G1<->G2 and G2<->G3 against their ceilings).

  python bench/device/kv_tiers_engine.py [--arch llama-3.1-8b] [--only ttft,itl,replay] [--out FILE]
  python bench/device/kv_tiers_engine.py --smoke        # the tiny model on the CPU, tiny sizes

Sections (one JSON line per figure, with provenance):
- ``ttft``: per KV dtype (bf16, fp8) and prompt length (1k..32k): TTFT of a prompt recomputed,
  onboarded from host RAM (G2), onboarded from disk (G3, host copy dropped first), and with
  ``--kv-onboard auto`` given each (the cost-aware choice; its ratio to recomputing is the "never
  more than 5% worse" check). Each prompt is new to G1 for every measurement (G1's prefix cache is
  reset; the lower tiers keep what the measurement needs).
- ``itl``: a steady decode batch (the engine's own loop, async scheduling), step time p50/p90
  with the tiers off, then on under G1 pressure (every block the batch allocates evicts a cached
  block not yet in G2, so the offload-ahead-of-eviction policy copies one block down for each: the
  issue's "offload running" check, ``p50_ratio``), then on with room in G1 (nothing cached at risk:
  the policy copies nothing, ``room_p50_ratio``); bytes offloaded during the timed steps of each.
- ``replay``: a multi-turn Mooncake trace (prompts rebuilt from hash_ids) whose working set
  exceeds G1 (``--replay-g1-blocks``), closed loop at ``--replay-concurrency``, tiers off then on:
  prefix hit rate, TTFT p50/p90, output and total tokens/s.

Weights are random (load_format=dummy), the architecture's config.json is written locally.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from common import Emitter  # noqa: E402  (sets sys.path)
from engine.engine import Engine  # noqa: E402
from engine.loader import write_arch_dir  # noqa: E402
from kvstore.events import Tier  # noqa: E402
from kvstore.pools.tier_policy import OnboardMode  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.types import EngineRequest, SamplingParams  # noqa: E402

FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
_ids = iter(range(1 << 62))


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def sync(eng: Engine) -> None:
    if eng.runner.device.type == "cuda":
        torch.cuda.synchronize()


def run_one(eng: Engine, prompt: list[int], sampling: SamplingParams = FIRST) -> float:
    """Seconds from submission to the first token (the engine stepped on this thread)."""
    rid = f"r{next(_ids)}"
    sync(eng)
    t0 = time.perf_counter()
    eng.add_request(EngineRequest(rid, prompt, sampling))
    first = None
    while eng.has_work:
        for o in eng.step().outputs:
            if o.request_id == rid and first is None and o.new_token_ids:
                first = time.perf_counter() - t0
    return first


def settle(eng: Engine) -> None:
    """Every copy landed and every admitted disk write done (between measurements)."""
    for _ in range(1000):
        eng.step()
        eng.tiers.drain()
        if not eng.has_work and not eng.scheduler.tier_busy:
            before = eng.tiers.stats().blocks.get(Tier.DISK, 0)
            eng.tiers.drain()
            if eng.tiers.stats().blocks.get(Tier.DISK, 0) == before:
                return
    raise RuntimeError("the tiers did not settle")


def forget_g1(eng: Engine) -> None:
    eng.pool.reset_cache()
    eng.pool.take_events()


def forget_host(eng: Engine, prompt: list[int]) -> int:
    """Drop the prompt's blocks from host RAM (they stay on disk); returns how many are on disk."""
    from engine.request import Request
    req = Request.new("hash", prompt, FIRST)
    eng.scheduler._update_hashes(req)
    host, disk = eng.tiers.host.slots, eng.tiers.disk.slots
    slots = [s for s in (host.find(h) for h in req.block_hashes) if s is not None]
    host.drop(slots)
    return sum(disk.holds(h) for h in req.block_hashes)


def set_mode(eng: Engine, mode: OnboardMode) -> None:
    eng.tiers.cfg = dataclasses.replace(eng.tiers.cfg, onboard=mode)


def bench_ttft(emit, cfg: EngineConfig, lengths: list[int], common: dict, disk_dir: str, reps: int) -> None:
    eng = Engine(cfg)
    # write-back of the whole host tier (not only its LRU tail) so G3 holds what we ask of it
    eng.tiers.cfg = dataclasses.replace(eng.tiers.cfg, clean_fraction=1.0)
    vocab = eng.runner.model_config.vocab_size
    rng = np.random.default_rng(0)
    common = {**common, "kv_cache_dtype": str(eng.runner.kv_cache.dtype).removeprefix("torch."),
              "block_bytes": eng.tiers.fmt.block_bytes, "mover": eng.tier_io.mover.name,
              "probe": eng.tier_io.probe_figures}
    emit(**common, metric="tier_rates", rates_gbps={p.value: round(r / 1e9, 3)
                                                     for p, r in eng.tiers.stats().path_rate_bytes_per_s.items()})
    run_one(eng, rng.integers(1, vocab, 512).tolist())          # warm-up
    for n in lengths:
        for rep in range(reps):
            prompt = rng.integers(1, vocab, n + 1).tolist()
            set_mode(eng, OnboardMode.ALWAYS)
            t_rec = run_one(eng, prompt)                          # new everywhere: computed
            run_one(eng, prompt)                                  # a second use (G1 hit): worth a disk write
            settle(eng)
            forget_g1(eng)
            t_g2 = run_one(eng, prompt)                           # G2 -> G1
            forget_g1(eng)
            set_mode(eng, OnboardMode.AUTO)
            speed_auto_g2 = eng.scheduler.prefill_speed.tokens_per_s
            t_auto_g2 = run_one(eng, prompt)
            settle(eng)
            forget_g1(eng)
            on_disk = forget_host(eng, prompt)
            set_mode(eng, OnboardMode.ALWAYS)
            t_g3 = run_one(eng, prompt)                           # G3 -> G2 -> G1
            settle(eng)
            forget_g1(eng)
            forget_host(eng, prompt)
            set_mode(eng, OnboardMode.AUTO)
            speed_auto_g3 = eng.scheduler.prefill_speed.tokens_per_s
            t_auto_g3 = run_one(eng, prompt)
            settle(eng)
            forget_g1(eng)
            emit(**common, metric="ttft", prompt_tokens=n, rep=rep, blocks_on_disk=on_disk,
                 recompute_ms=round(t_rec * 1e3, 2), g2_ms=round(t_g2 * 1e3, 2), g3_ms=round(t_g3 * 1e3, 2),
                 auto_g2_ms=round(t_auto_g2 * 1e3, 2), auto_g3_ms=round(t_auto_g3 * 1e3, 2),
                 g2_speedup=round(t_rec / t_g2, 2), g3_speedup=round(t_rec / t_g3, 2),
                 auto_g2_vs_recompute=round(t_auto_g2 / t_rec, 3), auto_g3_vs_recompute=round(t_auto_g3 / t_rec, 3),
                 prefill_tok_s=round(eng.scheduler.prefill_speed.tokens_per_s),
                 prefill_tok_s_at_auto=[round(speed_auto_g2), round(speed_auto_g3)],
                 meter_steps=[(n, round(t * 1e3, 2)) for n, t in eng._prefill_meter._steps])
    st = eng.stats().tiers
    emit(**common, metric="ttft_counts", loaded={t.name: v for t, v in st.loaded_blocks.items()},
         recomputed={t.name: v for t, v in st.recomputed_blocks.items()},
         errors={e.value: v for e, v in st.errors.items()})
    eng.close()
    del eng
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def _offloaded(eng: Engine) -> int:
    from kvstore.pools.tier_policy import TierPath
    return eng.tiers.stats().path_bytes[TierPath.G1_TO_G2] if eng.scheduler.onboarding is not None else 0


def _steady(eng: Engine, batch: int, ctx: int, steps: int, vocab: int, seed: int) -> tuple[list[float], int]:
    """Step times of a decode batch once every prompt is computed, and the bytes offloaded meanwhile."""
    rng = np.random.default_rng(seed)        # new prompts each time: nothing is in a tier yet
    sp = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(EngineRequest(f"d{next(_ids)}", rng.integers(1, vocab, ctx).tolist(), sp))
    while len(eng.scheduler.running) < batch or any(r.num_computed_tokens < r.num_prompt_tokens
                                                    for r in eng.scheduler.running):
        eng.step()
    times = []
    before = _offloaded(eng)
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    moved = _offloaded(eng) - before
    for r in list(eng.scheduler.requests):
        eng.abort_request(r)
    while eng.has_work:
        eng.step()
    return times, moved


def bench_itl(emit, cfg: EngineConfig, common: dict, batch: int, ctx: int, steps: int) -> None:
    eng = Engine(cfg)
    vocab = eng.runner.model_config.vocab_size
    io = eng.tier_io
    _steady(eng, batch, ctx, 16, vocab, 1)                       # warm-up
    eng.tier_io, eng.scheduler.onboarding = None, None          # tiers off: the same engine, no tier work
    off, _ = _steady(eng, batch, ctx, steps, vocab, 2)           # ... leaving its blocks cached, not in G2
    eng.tier_io, eng.scheduler.onboarding = io, io.onboarding
    on, on_bytes = _steady(eng, batch, ctx, steps, vocab, 3)     # allocations evict those: copied ahead
    eng.pool.reset_cache()                                       # nothing cached at risk: room in G1
    eng.pool.take_events()
    room, room_bytes = _steady(eng, batch, ctx, steps, vocab, 4)
    emit(**common, metric="itl", batch=batch, context=ctx, steps=steps, policy="ahead_of_eviction",
         offload_window_blocks=eng.tier_io.onboarding.offload_window, block_bytes=eng.tiers.fmt.block_bytes,
         off_p50_ms=round(q(off, 0.5) * 1e3, 3), off_p90_ms=round(q(off, 0.9) * 1e3, 3),
         on_p50_ms=round(q(on, 0.5) * 1e3, 3), on_p90_ms=round(q(on, 0.9) * 1e3, 3),
         p50_ratio=round(q(on, 0.5) / q(off, 0.5), 4), offloaded_bytes=on_bytes,
         room_p50_ms=round(q(room, 0.5) * 1e3, 3), room_p90_ms=round(q(room, 0.9) * 1e3, 3),
         room_p50_ratio=round(q(room, 0.5) / q(off, 0.5), 4), room_offloaded_bytes=room_bytes)
    eng.close()
    del eng
    gc.collect()


def bench_replay(emit, cfg: EngineConfig, common: dict, trace: str | None, limit: int, max_input: int,
                 concurrency: int, max_output: int) -> None:
    from splitserve.bench.workloads import load_trace, trace_prompt
    for tiers_on in (False, True):
        c = cfg if tiers_on else dataclasses.replace(cfg, kv_host_gib=0.0, kv_disk_gib=0.0, kv_disk_dir=None)
        eng = Engine(c)
        vocab = eng.runner.model_config.vocab_size
        workload = os.path.basename(trace) if trace and os.path.exists(trace) else "synthetic-multiturn"
        if workload != "synthetic-multiturn":
            rows, bs = load_trace(trace, max_input_len=max_input, limit=limit)
            work = [(trace_prompt(r.hash_ids, r.input_len, bs, vocab, (7,)).tolist(), min(r.output_len, max_output))
                    for r in rows]
        else:      # a synthetic multi-turn set: sessions whose turns extend the previous prompt
            rng = np.random.default_rng(5)
            sessions = [rng.integers(1, vocab, max_input // 2).tolist() for _ in range(max(2, limit // 4))]
            work = []
            for turn in range(4):
                for s in range(len(sessions)):
                    sessions[s] = sessions[s] + rng.integers(1, vocab, max_input // 8).tolist()
                    work.append((sessions[s], max_output))
            work = work[:limit]
        submitted: dict[str, float] = {}
        ttft: list[float] = []
        out_tokens = 0
        pending = list(reversed(work))
        t0 = time.perf_counter()
        while pending or eng.has_work:
            while pending and len(submitted) < concurrency:
                prompt, n_out = pending.pop()
                rid = f"p{next(_ids)}"
                err = eng.add_request(EngineRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=max(1, n_out),
                                                                                ignore_eos=True)))
                if err is not None:
                    raise SystemExit(f"replay: {err.error} (raise --replay-g1-blocks or lower --replay-max-input)")
                submitted[rid] = time.perf_counter()
            for o in eng.step().outputs:
                out_tokens += len(o.new_token_ids)
                if o.request_id in submitted and submitted[o.request_id] > 0 and o.new_token_ids:
                    ttft.append(time.perf_counter() - submitted[o.request_id])
                    submitted[o.request_id] = -1.0
                if o.finish_reason is not None:
                    submitted.pop(o.request_id, None)
        wall = time.perf_counter() - t0
        s = eng.stats()
        emit(**common, metric="replay", workload=workload, tiers=tiers_on, requests=len(work), concurrency=concurrency,
             g1_blocks=eng.pool.num_blocks, prompt_tokens=s.num_prompt_tokens,
             hit_rate=round(s.num_prefix_hit_tokens / max(1, s.num_prompt_tokens), 4),
             ttft_p50_ms=round(q(ttft, 0.5) * 1e3, 1), ttft_p90_ms=round(q(ttft, 0.9) * 1e3, 1),
             output_tok_s=round(out_tokens / wall, 1), total_tok_s=round((s.num_prompt_tokens + out_tokens) / wall, 1),
             wall_s=round(wall, 2),
             hits_blocks={"device": s.num_gpu_hit_blocks,
                          **({t.name.lower(): v for t, v in s.tiers.loaded_blocks.items()} if s.tiers else {})})
        eng.close()
        del eng
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, tiny sizes (a test)")
    ap.add_argument("--only", default="ttft,itl,replay")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dir", default=None, help="disk tier directory (default: a new one under /tmp)")
    ap.add_argument("--kv-cache-dtypes", default="auto,fp8")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--host-gib", type=float, default=12.0)
    ap.add_argument("--disk-gib", type=float, default=12.0)
    ap.add_argument("--num-blocks", type=int, default=8192, help="G1 blocks for ttft/itl")
    ap.add_argument("--itl-batch", type=int, default=64)
    ap.add_argument("--itl-context", type=int, default=1024)
    ap.add_argument("--itl-steps", type=int, default=200)
    ap.add_argument("--trace", default="shared/data/traces/mooncake_synthetic_trace.jsonl")
    ap.add_argument("--replay-requests", type=int, default=96)
    ap.add_argument("--replay-max-input", type=int, default=16384)
    ap.add_argument("--replay-max-output", type=int, default=32)
    ap.add_argument("--replay-concurrency", type=int, default=8)
    ap.add_argument("--replay-g1-blocks", type=int, default=4096, help="G1 for the replay: below its working set")
    args = ap.parse_args()
    emit = Emitter("kv_tiers_engine", args.out)
    only = set(args.only.split(","))
    root = args.dir or tempfile.mkdtemp(prefix="kvtiers-engine-")
    os.makedirs(root, exist_ok=True)
    if args.smoke:
        from splitserve.models import resolve_model
        model, device, load = resolve_model("tiny"), "cpu", "auto"
        lengths, dtypes = [64, 160], ["auto"]
        host_gib, disk_gib, g1 = 0.004, 0.008, 64
        itl = (4, 48, 20)
        replay = dict(limit=8, max_input=128, concurrency=2, max_output=4)
        replay_g1 = 48
    else:
        model, device, load = str(write_arch_dir(args.arch, f"/tmp/splitserve-models/{args.arch}")), "cuda", "dummy"
        lengths, dtypes = [int(x) for x in args.lengths.split(",")], args.kv_cache_dtypes.split(",")
        host_gib, disk_gib, g1 = args.host_gib, args.disk_gib, args.num_blocks
        itl = (args.itl_batch, args.itl_context, args.itl_steps)
        replay = dict(limit=args.replay_requests, max_input=args.replay_max_input,
                      concurrency=args.replay_concurrency, max_output=args.replay_max_output)
        replay_g1 = args.replay_g1_blocks
    max_len = max(max(lengths), replay["max_input"]) + 256

    def cfg(sub: str, **kw) -> EngineConfig:
        d = os.path.join(root, sub)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        base = dict(model=model, device=device, load_format=load, num_blocks=g1, max_model_len=max_len,
                    max_num_batched_tokens=8192 if not args.smoke else 256, kv_host_gib=host_gib,
                    kv_disk_gib=disk_gib, kv_disk_dir=d, kv_onboard="always")
        return EngineConfig(**{**base, **kw})

    common = {"arch": "tiny" if args.smoke else args.arch, "smoke": args.smoke}
    t_all = time.perf_counter()
    if "ttft" in only:
        for dt in dtypes:
            t0 = time.perf_counter()
            bench_ttft(emit, cfg(f"ttft-{dt}", kv_cache_dtype=dt), lengths, common, root, args.reps)
            emit(**common, metric="section_s", section=f"ttft-{dt}", seconds=round(time.perf_counter() - t0, 1))
    if "itl" in only:
        t0 = time.perf_counter()
        bench_itl(emit, cfg("itl"), common, *itl)
        emit(**common, metric="section_s", section="itl", seconds=round(time.perf_counter() - t0, 1))
    if "replay" in only:
        t0 = time.perf_counter()
        bench_replay(emit, cfg("replay", num_blocks=replay_g1), common, args.trace, **replay)
        emit(**common, metric="section_s", section="replay", seconds=round(time.perf_counter() - t0, 1))
    emit(**common, metric="total_s", seconds=round(time.perf_counter() - t_all, 1))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
