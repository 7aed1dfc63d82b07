"""The engine's side of the KV tiers: building the tier manager from the config, running a plan's
block copies with the mover the start-up probe picked, and telling the scheduler when they land.

The scheduler's onboarding manager (engine/sched/onboarding.py) decides what moves (offload of
cached blocks ahead of their eviction from G1, onboarding of prefix hits below G1) and puts it in
`StepPlan.copies`; this module executes
those copies before the step's forward pass and polls them without blocking. Everything tier-side
that needs no device is in kvstore/tiers.py. Off (`--kv-host-gib 0`) none of this is built and the
step loop pays one `is None` test per step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass

from kvstore.block_format import BlockFormat
from kvstore.movers.disk_pool import DiskConfig
from kvstore.events import Tier
from kvstore.movers.host_copy import CopyDirection, CopyHandle, HostCopyError, choose
from kvstore.pools.tier_policy import OnboardMode, PathRate, PrefillSpeed, TierPath
from kvstore.tiers import DEFAULT_RATES, TierConfig, TierManager
from engine.plan import StepPlan
from engine.scheduler import Scheduler
from engine.sched.onboarding import OnboardingManager
from runtime.config import EngineConfig

log = logging.getLogger(__name__)

GIB = 1 << 30
PROBE_BLOCKS = 16                 # G1 <-> G2 probe at start-up (per mover, both directions)


class TierConfigError(ValueError):
    """The tier flags do not make a usable configuration (a start-up error)."""


def model_identity(cfg: EngineConfig) -> str:
    """What a disk directory is written for: the model directory, its config.json's digest, and for
    random weights their seed (two dummy models of one architecture hold different KV)."""
    path = os.path.realpath(cfg.model)
    digest = ""
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        pass
    ident = {"model": path, "config": digest, "load_format": cfg.load_format}
    if cfg.load_format == "dummy":
        ident["seed"] = cfg.seed
    return json.dumps(ident, sort_keys=True)


def tier_config(cfg: EngineConfig, pin_memory: bool) -> TierConfig:
    if cfg.kv_host_gib < 0 or cfg.kv_disk_gib < 0:
        raise TierConfigError("--kv-host-gib and --kv-disk-gib must not be negative")
    if cfg.kv_disk_gib > 0 and not cfg.kv_disk_dir:
        raise TierConfigError("--kv-disk-gib needs --kv-disk-dir")
    if cfg.kv_disk_dir and cfg.kv_disk_gib <= 0:
        raise TierConfigError("--kv-disk-dir needs --kv-disk-gib")
    if cfg.kv_disk_gib > 0 and cfg.kv_host_gib <= 0:
        raise TierConfigError("the disk tier needs the host tier: set --kv-host-gib")
    disk = DiskConfig(cfg.kv_disk_dir, int(cfg.kv_disk_gib * GIB)) if cfg.kv_disk_gib > 0 else None
    return TierConfig(int(cfg.kv_host_gib * GIB), disk, OnboardMode(cfg.kv_onboard), pin_memory=pin_memory)


@dataclass(slots=True)
class _Flight:
    step_id: int
    offload: bool
    handle: CopyHandle


class TierIO:
    """Runs a plan's copies with a G1 <-> G2 mover and reports landed ones to the scheduler's
    onboarding manager."""

    def __init__(self, tiers: TierManager, mover, onboarding: OnboardingManager) -> None:
        self.tiers, self.mover, self.onboarding = tiers, mover, onboarding
        self._flight: list[_Flight] = []
        self.copy_errors = 0
        self.probe_figures: dict[str, dict[str, float]] = {}    # G1 <-> G2 per mover, GB/s

    def start(self, plan: StepPlan) -> None:
        """Queue the plan's copies (before its forward pass: an onboard's blocks are read after it)."""
        off_b, off_s, on_b, on_s = [], [], [], []
        for c in plan.copies:
            if c.dst_tier == Tier.HOST:
                off_b.append(c.src_block)
                off_s.append(c.dst_block)
            else:
                on_s.append(c.src_block)
                on_b.append(c.dst_block)
        for offload, blocks, slots in ((True, off_b, off_s), (False, on_b, on_s)):
            if not blocks:
                continue
            try:
                if offload:
                    h = self.mover.offload(blocks, slots)
                elif plan.wait_onboard:         # an ordered mover: the step's forward reads these blocks
                    h, plan.layer_waits = self.mover.onboard_layers(slots, blocks)
                else:
                    h = self.mover.onboard(slots, blocks)
            except Exception as e:
                log.exception("KV tier copy (%s, %d blocks) failed", "offload" if offload else "onboard", len(blocks))
                self.copy_errors += 1
                self.onboarding.copies_landed(plan.step_id, offload, ok=False)
                if not offload and plan.wait_onboard:
                    # its requests were admitted on the copy and their prefix registered in G1: the
                    # cache forgets everything it holds (the blocks hold no KV) and the step fails
                    self.onboarding.pool.reset_cache()
                    raise HostCopyError(f"onboarding {len(blocks)} blocks failed: {e}") from e
                continue
            self._flight.append(_Flight(plan.step_id, offload, h))

    def poll(self) -> None:
        """Report the copies that landed (never waits)."""
        if not self._flight:
            return
        still = []
        for f in self._flight:
            try:
                done, ok = self.mover.done(f.handle), True
            except HostCopyError:
                log.exception("KV tier copy failed")
                self.copy_errors += 1
                done, ok = True, False
            if done:
                self.onboarding.copies_landed(f.step_id, f.offload, ok, f.handle.seconds)
            else:
                still.append(f)
        self._flight = still

    @property
    def busy(self) -> bool:
        return bool(self._flight)


class PrefillMeter:
    """The engine's prefill speed, for the load-or-recompute choice: what one more token of prefill
    costs. A step takes about `a + b * tokens` (a: the fixed cost of a step, b: per token), and a
    loaded prefix saves only the b part, since the request's tail still takes a step. So the meter
    fits that line to the last `window` steps of at least `min_tokens` and reports 1/b.

    The fit is Theil-Sen (the median of the pairwise slopes), so one step that also compiled a
    kernel or waited on something else does not move it; until the steps differ enough in size to
    have slopes (or where the median slope is not a cost), it reports the median rate, tokens /
    seconds, of the window. On the H100 a running mean of whole steps, most of them small and the
    first one compiling fp8 kernels, held 13k tokens/s where one more token cost 1/37k s, and made a
    disk load look faster than recomputing 1k tokens (docs/kv_tiers.md)."""

    def __init__(self, initial_tokens_per_s: float, min_tokens: int = 64, window: int = 16,
                 min_ratio: float = 1.25) -> None:
        self.tokens_per_s = initial_tokens_per_s
        self.min_tokens, self.min_ratio = min_tokens, min_ratio
        self.samples = 0
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, num_tokens: int, seconds: float) -> PrefillSpeed | None:
        if num_tokens < self.min_tokens or seconds <= 0:
            return None
        self._steps.append((num_tokens, seconds))
        self.samples += 1
        rates = [n / t for n, t in self._steps]
        # with one or two steps seen the median is their mean, and a first step that also compiled
        # kernels halves it (the H100's first 1k-token disk hit was then loaded, 2-3x slower than
        # recomputing): until a third, the fastest, which errs towards recomputing
        median_rate = statistics.median(rates) if len(rates) >= 3 else max(rates)
        self.tokens_per_s = max(self._marginal_rate() or 0.0, median_rate)   # never slower than the median: a >= 0
        return PrefillSpeed(self.tokens_per_s)

    def _marginal_rate(self) -> float | None:
        """1/b, b the median slope over pairs of steps whose sizes differ by `min_ratio` or more;
        None without such pairs or where b is not a positive cost."""
        steps = list(self._steps)
        slopes = [(t2 - t1) / (n2 - n1) for i, (n1, t1) in enumerate(steps) for n2, t2 in steps[i + 1:]
                  if max(n1, n2) >= self.min_ratio * min(n1, n2)]
        if not slopes:
            return None
        b = statistics.median(slopes)
        return 1.0 / b if b > 0 else None


def build(cfg: EngineConfig, runner, scheduler: Scheduler) -> TierIO:
    """The tier manager and its mover for a model runner (probes G1 <-> G2 and the disk: start-up;
    `runner`: a ModelRunner, whose KV cache it copies, or with `cfg.mock` the mock's)."""
    if cfg.mock:
        return _build_mock(cfg, scheduler)
    tcfg = tier_config(cfg, pin_memory=runner.device.type == "cuda")
    fmt = BlockFormat.of(runner.kv_cache, model_identity(cfg))
    tiers = TierManager(fmt, tcfg)
    try:
        if tiers.host.num_slots < 1:
            raise TierConfigError(f"--kv-host-gib {cfg.kv_host_gib} holds no block of {fmt.block_bytes} bytes")
        mover, figures = _choose_mover(cfg, runner, tiers)
        t0 = time.perf_counter()
        rates = tiers.probe_disk(probe_bytes=(64 << 20) if runner.device.type == "cuda" else (8 << 20))
        if rates is not None:
            log.info("disk tier probe took %.2f s", time.perf_counter() - t0)
    except BaseException:
        tiers.close()
        raise
    io = TierIO(tiers, mover, scheduler.use_tiers(tiers, mover.ordered))
    io.probe_figures = figures
    return io


class ModelledHostCopy:
    """The mock engine's G1 <-> G2 mover: moves no bytes; a copy lands when the modelled link
    (one per direction, copies queued behind each other) would have finished it."""
    name = "modelled"
    ordered = False           # a copy lands on the modelled clock: read after done()

    def __init__(self, block_bytes: int, bytes_per_s: float, clock=time.perf_counter) -> None:
        self.block_s = block_bytes / bytes_per_s
        self.block_bytes, self._clock = block_bytes, clock
        self._free_at = {CopyDirection.OFFLOAD: 0.0, CopyDirection.ONBOARD: 0.0}

    def _copy(self, direction, n: int) -> CopyHandle:
        now = self._clock()
        h = CopyHandle(direction, n * self.block_bytes, now)
        end = self._free_at[direction] = max(now, self._free_at[direction]) + n * self.block_s
        h._pending = end
        return h

    def offload(self, g1_blocks, g2_slots) -> CopyHandle:
        return self._copy(CopyDirection.OFFLOAD, len(g1_blocks))

    def onboard(self, g2_slots, g1_blocks) -> CopyHandle:
        return self._copy(CopyDirection.ONBOARD, len(g1_blocks))

    def done(self, handle: CopyHandle) -> bool:
        if handle._pending is not None and self._clock() >= handle._pending:
            handle.finished_s, handle._pending = handle._pending, None
        return handle._pending is None

    def close(self) -> None:
        pass


MOCK_SLOT_BYTES = 8          # the mock's tiers hold no KV: one word per slot, for the bookkeeping


def _build_mock(cfg: EngineConfig, scheduler: Scheduler) -> TierIO:
    """The mock engine's tiers: the real tier manager (slots, LRU, events, decisions) over a host
    tier of --kv-host-gib worth of modelled blocks and, with --kv-disk-gib, the real disk tier (slab
    files, checksums, index, restart survival, admission) of --kv-disk-gib worth of them, each slot
    MOCK_SLOT_BYTES standing for a block of the profile's size. Copies and disk reads and writes
    take the time the profile's rates would need for the modelled blocks, and the cost model sees
    those rates scaled to slot bytes. No probe: the profile is the measurement."""
    from perf.profile import load_tier_timing
    tcfg = tier_config(cfg, pin_memory=False)
    tt = load_tier_timing(cfg.mock_profile)
    block_bytes = tt.kv_bytes_per_token * cfg.block_size
    slots = tcfg.host_bytes // block_bytes
    if slots < 1:
        raise TierConfigError(f"--kv-host-gib {cfg.kv_host_gib} holds no block of {block_bytes} bytes")
    disk = None
    if tcfg.disk is not None:
        disk_slots = tcfg.disk.capacity_bytes // block_bytes
        if disk_slots < 1:
            raise TierConfigError(f"--kv-disk-gib {cfg.kv_disk_gib} holds no block of {block_bytes} bytes")
        # plain pwritev/preadv and one checksum thread: a word per block leaves NIXL nothing to do
        disk = dataclasses.replace(tcfg.disk, capacity_bytes=disk_slots * MOCK_SLOT_BYTES, file_io="os",
                                   checksum_threads=1)
    fmt = BlockFormat(f"mock:{model_identity(cfg)}", 1, MOCK_SLOT_BYTES, cfg.block_size, "mock")
    tiers = TierManager(fmt, dataclasses.replace(tcfg, host_bytes=slots * MOCK_SLOT_BYTES, disk=disk,
                                                 disk_block_s=block_bytes / (tt.disk_gbps * 1e9)))
    for path, gbps in ((TierPath.G1_TO_G2, tt.host_gbps), (TierPath.G2_TO_G1, tt.host_gbps),
                       (TierPath.G2_TO_G3, tt.disk_gbps), (TierPath.G3_TO_G2, tt.disk_gbps)):
        # the cost model sees slot bytes: scale the rate so a slot costs a modelled block's time
        tiers.set_rate(path, PathRate(gbps * 1e9 * MOCK_SLOT_BYTES / block_bytes, DEFAULT_RATES[path].latency_s))
    for meter in tiers.meters.values():
        meter.min_bytes = 1 << 62            # modelled copies: keep the profile's rate
    mover = ModelledHostCopy(block_bytes, tt.host_gbps * 1e9)
    io = TierIO(tiers, mover, scheduler.use_tiers(tiers, mover.ordered))
    log.info("mock KV tiers: %d host and %d disk modelled blocks of %d bytes, at %.0f and %.1f GB/s", slots,
             tiers.disk.num_slots if tiers.disk is not None else 0, block_bytes, tt.host_gbps, tt.disk_gbps)
    return io


def _choose_mover(cfg: EngineConfig, runner, tiers: TierManager):
    k = max(1, min(PROBE_BLOCKS, runner.num_blocks, tiers.host.slots.num_free))
    slots = [s for s in (tiers.host.slots.reserve(-1 - i, None) for i in range(k)) if s is not None]
    blocks = list(range(len(slots)))      # no request holds a block yet
    kinds = ("torch", "nixl") if cfg.kv_host_copy == "auto" else (cfg.kv_host_copy,)
    try:
        mover, seen = choose(runner.kv_cache, tiers.host, blocks, slots, kinds, runner.layer_events)
    finally:
        tiers.host.slots.abort(slots)
    nbytes = len(slots) * tiers.fmt.block_bytes
    off_s, on_s = seen[mover.name]
    tiers.set_rate(TierPath.G1_TO_G2, PathRate(nbytes / max(off_s, 1e-9), 20e-6))
    tiers.set_rate(TierPath.G2_TO_G1, PathRate(nbytes / max(on_s, 1e-9), 20e-6))
    figures = {k: {"offload_gbps": round(nbytes / o / 1e9, 3), "onboard_gbps": round(nbytes / i / 1e9, 3)}
               for k, (o, i) in seen.items()}
    log.info("KV host tier: %d slots of %d bytes; G1<->G2 mover %s (probe: %s)", tiers.host.num_slots,
             tiers.fmt.block_bytes, mover.name, figures)
    return mover, figures
