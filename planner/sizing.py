"""Pool sizing: the fewest workers of each kind that keep a latency target at a given load.

Pure queueing arithmetic over a profile's step times and a sample of request lengths; the core
(planner/core.py) decides which load, which corrections and when to act.

Prefill: a pool of c workers is an M/G/c queue (the router sends each prompt to the worker with
the least queued prefill work, close to one shared queue). For arrival rate lam and per-request
service times S_i (the profile's prefill time of each sampled prompt at its cached fraction):

    a = lam E[S]                 offered load (workers' worth of work), needs a < c
    C = ErlangC(c, a)            probability that a request waits
    W = C / (c / E[S] - lam) * (ca2 + cs2) / 2 * k_wait       mean wait (Allen-Cunneen)
    P(wait > t) = C exp(-t C / W)                              (conditional wait ~ exponential)
    attainment(c) = mean_i [S_i < T] (1 - C exp(-(T - S_i) C / W))

with cs2 the squared coefficient of variation of S, ca2 the arrivals' burstiness (index of
dispersion of counts; 1 for Poisson) and k_wait the observed/modelled wait correction. Requests
with S_i >= T miss the target at any c; the goal applies to the others: the pool needs the least c
with attainment(c) >= goal * mean_i [S_i < T].

Decode: every sequence on a worker waits the same step time f(B, C) per token (B sequences of mean
context C). By Little's law the sequences in flight are N = lam L f(B, C), L = mean decode steps
per request, so with D workers the batch per worker is the fixed point B = lam L f(B, C) / D.
A worker's batch is capped by the ITL target (f(B, C) <= ITL) and the engine's max_num_seqs: cap.
A decode worker admits a request before its prompt is prefilled (it reserves the sequence's KV,
then asks a prefill worker, engine/scheduler.py), and only while fewer than cap sequences run, so
a request that finds the pool full waits *before its first token*: it meets its TTFT target iff
that wait fits its slack T - S_i (S_i its prefill). Two resources are held: D * cap batch slots,
each for s_i f(B, C) seconds (s_i = its decode steps = output - 1), and the KV, D * K / R
sequences' worth (K the worker's KV tokens, R the mean reservation prompt + output weighted by how
long it is held), each from admission through the prefill to the last token. Each is an M/G/c
queue (the same Allen-Cunneen wait and exponential tail as prefill):

    attainment(D) = mean_i prod_r (1 - C_r exp(-(T - S_i) C_r / W_r))     (0 where T <= S_i)

and the pool needs the least D with attainment(D) >= goal (of the requests that can meet T). C is
step-weighted: a sequence of o output tokens stays o - 1 steps, so C = sum (o-1)(p + o/2) /
sum (o-1) over the sample. Its ITL is then f(B, C), within the target while B is within the cap.

Aggregated (no prefill pool, each decode worker computing its own prompts): the decode model with
each step stretched by the prompts' chunks, f(B, C) / (1 - u), u the share of a worker's time its
prompts take, and the prompts queued FIFO on the workers (aggregated_attainment says how).

It knows nothing of time, predictors, hysteresis or budgets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

StepFn = Callable[[float, float], float]   # (batch, context) -> seconds per decode step


# ---- prefill -----------------------------------------------------------------------------------

def erlang_c(c: int, a: float) -> float:
    """Probability that an arrival waits in M/M/c with offered load a (< c); 1 if a >= c."""
    if c <= 0 or a >= c:
        return 1.0
    if a <= 0:
        return 0.0
    b = 1.0                      # Erlang B by its stable recursion
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1 - rho * (1 - b))


@dataclass(frozen=True, slots=True)
class PrefillSizing:
    workers: int
    attainment: float      # predicted share of requests with TTFT <= target
    utilization: float     # a / c
    mean_wait_s: float


def prefill_wait(c: int, rate: float, service_s: np.ndarray, burst: float = 1.0,
                 wait_correction: float = 1.0) -> tuple[float, float]:
    """(probability of waiting, mean wait in s) of c workers at `rate`; (1, inf) if unstable."""
    mean_s = float(service_s.mean()) if len(service_s) else 0.0
    if rate <= 0 or mean_s <= 0:
        return 0.0, 0.0
    a = rate * mean_s
    if c <= 0 or a >= c:
        return 1.0, math.inf
    cs2 = float(service_s.var()) / (mean_s * mean_s)
    p_wait = erlang_c(c, a)
    wait = p_wait / (c / mean_s - rate) * (burst + cs2) / 2 * wait_correction
    return p_wait, wait


def prefill_attainment(c: int, rate: float, service_s: np.ndarray, target_s: float,
                       burst: float = 1.0, wait_correction: float = 1.0, deadline: bool = False) -> PrefillSizing:
    """The attainment of c workers whose queues run in arrival order (M/G/c, above), or with
    `deadline` in deadline order (prefill_attainment_deadline)."""
    if deadline:
        return prefill_attainment_deadline(c, rate, service_s, target_s, burst, wait_correction)
    slack = target_s - service_s
    feasible = slack > 0
    p_wait, wait = prefill_wait(c, rate, service_s, burst, wait_correction)
    util = rate * float(service_s.mean()) / c if c > 0 and len(service_s) else 0.0
    if math.isinf(wait):
        return PrefillSizing(c, 0.0, util, wait)
    if wait <= 0 or p_wait <= 0:
        return PrefillSizing(c, float(feasible.mean()), util, 0.0)
    ok = np.where(feasible, 1.0 - p_wait * np.exp(-np.maximum(slack, 0.0) * (p_wait / wait)), 0.0)
    return PrefillSizing(c, float(ok.mean()), util, wait)


def deadline_miss(c: int, rate: float, mean_s: float, patience_s: np.ndarray) -> float:
    """Share of arrivals whose wait would exceed their patience in M/M/c+G (Erlang-A): c servers
    of mean service mean_s, Poisson arrivals at `rate`, each arrival's patience drawn from the
    sample `patience_s`; an arrival that cannot be served within its patience leaves the queue
    (the deadline order serves it later, when no other can be saved: it no longer delays anyone).

    Baccelli and Hebuterne's density of the virtual wait v > 0: pi(c-1) rate exp(h(v)), with
    h(v) = rate E[min(P, v)] - (c / mean_s) v and the idle states pi(k) = pi(0) a^k / k!, k < c;
    an arrival misses if v exceeds its patience, so miss = integral of f(v) P(P < v) dv / total.
    Between consecutive sorted patience values h is linear, so the integrals are exact sums.
    Stable at any load: above c the misses carry the excess."""
    if c <= 0:
        return 1.0
    if rate <= 0 or mean_s <= 0:
        return 0.0
    p = np.sort(np.maximum(patience_s, 0.0))
    m = len(p)
    if not m:
        return 0.0
    cmu = c / mean_s
    seg = np.diff(p, prepend=0.0)                          # segment j: from p[j-1] (0) to p[j]
    below = np.arange(m) / m                               # P(patience < v) on segment j
    slope = rate * (1.0 - below) - cmu
    h = np.concatenate(([0.0], np.cumsum(slope * seg)))    # h at 0, p[0], ..., p[m-1]
    top = float(h.max())
    e0, e1 = np.exp(h[:-1] - top), np.exp(h[1:] - top)
    flat = np.abs(slope * seg) < 1e-9
    part = np.where(flat, e0 * seg, (e1 - e0) / np.where(flat, 1.0, slope))   # integral of e^(h - top)
    tail = e1[-1] / cmu                                    # beyond the largest patience, all miss
    waiting = float(part.sum()) + tail
    missing = float((part * below).sum()) + tail
    a = rate * mean_s
    log_terms = [k * math.log(a) - math.lgamma(k + 1) for k in range(c)]
    peak = max(log_terms)
    idle = sum(math.exp(t - peak) for t in log_terms)      # sum of a^k / k!, scaled by e^-peak
    log_wait = log_terms[-1] - peak + math.log(rate) + top  # pi(c-1) rate e^top, on the same scale
    if log_wait + math.log(waiting) > 700:
        return missing / waiting                           # the idle states are negligible
    scaled = math.exp(log_wait)
    return scaled * missing / (idle + scaled * waiting)


def prefill_attainment_deadline(c: int, rate: float, service_s: np.ndarray, target_s: float,
                                burst: float = 1.0, wait_correction: float = 1.0) -> PrefillSizing:
    """The attainment of c workers whose queues run in deadline order (engine/sched/order.py
    `PrefillOrder`): a prompt meets the target iff it starts within its slack T - S_i, and one
    that cannot is set aside, so it delays no one: M/G/c with patience, deadline_miss. General
    arrivals and service times enter as in Allen-Cunneen: the waits scale by (ca2 + cs2) / 2 and the
    wait correction, so the patience is divided by that factor and the rest taken as M/M/c."""
    slack = target_s - service_s
    feasible = slack > 0
    mean_s = float(service_s.mean()) if len(service_s) else 0.0
    util = rate * mean_s / c if c > 0 else 0.0
    if rate <= 0 or mean_s <= 0:
        return PrefillSizing(c, float(feasible.mean()) if len(service_s) else 1.0, util, 0.0)
    if c <= 0 or not feasible.any():
        return PrefillSizing(c, 0.0, util, math.inf)
    cs2 = float(service_s.var()) / (mean_s * mean_s)
    scale = max((burst + cs2) / 2 * wait_correction, 1e-6)
    miss = deadline_miss(c, rate, mean_s, slack[feasible] / scale)
    _, wait = prefill_wait(c, rate, service_s, burst, wait_correction)
    return PrefillSizing(c, float(feasible.mean()) * (1.0 - miss), util, wait)


def size_prefill(rate: float, service_s: np.ndarray, target_s: float, goal: float,
                 burst: float = 1.0, wait_correction: float = 1.0,
                 max_workers: int = 4096, deadline: bool = False) -> PrefillSizing:
    """The least c whose attainment reaches `goal` of the attainable share (at most max_workers);
    `deadline`: the workers' queues run in deadline order, else in arrival order."""
    if rate <= 0 or not len(service_s):
        return PrefillSizing(0, 1.0, 0.0, 0.0)
    need = goal * float((service_s < target_s).mean())
    c = max(1, math.floor(rate * float(service_s.mean())) + 1)
    while True:
        s = prefill_attainment(c, rate, service_s, target_s, burst, wait_correction, deadline)
        if s.attainment >= need or c >= max_workers:
            return s
        c += 1


# ---- decode ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DecodeWorkload:
    """What the decode pool holds per request, over a sample of requests."""
    steps: np.ndarray          # decode steps (output tokens after the first)
    context: float             # C: step-weighted mean tokens a decoding sequence attends
    kv_tokens: np.ndarray      # KV it reserves on its decode worker: prompt + output
    prefill_s: np.ndarray      # how long it holds that KV before its first token (its prefill, queue included)
    slack_s: np.ndarray        # how long it may wait for a decode worker and still meet the TTFT target

    @property
    def steps_per_request(self) -> float:
        return float(self.steps.mean()) if len(self.steps) else 0.0

    @staticmethod
    def from_lengths(prompt: np.ndarray, output: np.ndarray, prefill_s: np.ndarray | None = None,
                     slack_s: np.ndarray | float = math.inf) -> "DecodeWorkload":
        steps = np.maximum(output.astype(np.float64) - 1, 0)
        total = float(steps.sum())
        context = float((steps * (prompt + output / 2)).sum()) / total if len(prompt) and total > 0 else 0.0
        zeros = np.zeros(len(prompt))
        return DecodeWorkload(steps, context, (prompt + output).astype(np.float64),
                              zeros if prefill_s is None else prefill_s, zeros + slack_s)


@dataclass(frozen=True, slots=True)
class DecodeSizing:
    workers: int
    attainment: float      # predicted share of requests whose wait for a decode worker fits their slack
    batch: float           # mean sequences decoding per worker
    itl_s: float           # the step time at that batch
    batch_cap: int         # the most sequences a worker decodes at once
    limit: str             # what bounds the pool: itl | max_num_seqs (the batch) or kv (the KV held)


def decode_batch_cap(step: StepFn, context: float, itl_target_s: float, max_num_seqs: int) -> tuple[int, str]:
    """The largest batch within the ITL target and max_num_seqs."""
    lo, hi = 0, max_num_seqs       # bisection: step time grows with the batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step(mid, context) <= itl_target_s:
            lo = mid
        else:
            hi = mid - 1
    return (max_num_seqs, "max_num_seqs") if lo >= max_num_seqs else (lo, "itl")


def decode_batch(workers: int, rate: float, wl: DecodeWorkload, step: StepFn, ceiling: float) -> float:
    """The batch per worker B = rate L f(B, C) / workers (least fixed point); inf past `ceiling`."""
    if rate <= 0 or wl.steps_per_request <= 0:
        return 0.0
    k = rate * wl.steps_per_request / workers
    b = k * step(1, wl.context)
    for _ in range(200):
        nxt = k * step(max(b, 1.0), wl.context)
        if nxt > ceiling:
            return math.inf
        if abs(nxt - b) < 1e-4:
            return nxt
        b = nxt
    return b


def _admission_ok(servers: float, rate: float, hold_s: np.ndarray, slack_s: np.ndarray, burst: float) -> np.ndarray:
    """Per request, the probability that its wait for one of `servers` held hold_s each fits slack_s."""
    p_wait, wait = prefill_wait(int(servers), rate, hold_s, burst)
    if math.isinf(wait):
        return np.zeros(len(slack_s))
    if wait <= 0 or p_wait <= 0:
        return np.ones(len(slack_s))
    return 1.0 - p_wait * np.exp(-np.maximum(slack_s, 0.0) * (p_wait / wait))


def decode_attainment(workers: int, rate: float, wl: DecodeWorkload, step: StepFn, itl_target_s: float,
                      cap: int, limit: str = "", burst: float = 1.0, kv_capacity: float = math.inf) -> DecodeSizing:
    """Predicted share of requests that `workers` decode workers admit in time.

    A decode worker admits a request (reserves its KV: prompt + output) before its prompt is
    prefilled, and while fewer than its batch cap decode (engine/scheduler.py): a request that
    waits for either waits before its first token, so it meets its TTFT target only if the wait
    fits its slack (the target less its own prefill). Two resources, each M/G/c (the prefill
    formulas): batch slots, D * cap of them, held for the decode time s_i f(B, C); and KV, D *
    kv_capacity / R of them (R the hold-weighted mean reservation), held from admission through
    the prefill to the last token. A request is admitted in time with the product of the two
    chances. Its mean ITL is then the step time f(B, C), within the target when B is within the
    cap."""
    cap = max(cap, 1)
    b = decode_batch(workers, rate, wl, step, ceiling=cap) if workers > 0 else math.inf
    if not math.isfinite(b):
        return DecodeSizing(workers, 0.0, b, math.inf, cap, limit)
    itl = step(max(b, 1.0), wl.context)
    if not len(wl.steps) or rate <= 0:
        return DecodeSizing(workers, 1.0, b, itl, cap, limit)
    decode_s = wl.steps * itl
    ok = _admission_ok(workers * cap, rate, decode_s, wl.slack_s, burst)
    hold = wl.prefill_s + decode_s
    if math.isfinite(kv_capacity) and hold.sum() > 0:
        per_seq = float((wl.kv_tokens * hold).sum() / hold.sum())
        kv_slots = workers * max(math.floor(kv_capacity / per_seq), 1)
        ok = ok * _admission_ok(kv_slots, rate, hold, wl.slack_s, burst)
        if rate * hold.mean() / kv_slots > rate * decode_s.mean() / (workers * cap):
            limit = "kv"
    ok = np.where(wl.slack_s > 0, ok, 0.0)
    if itl > itl_target_s:
        ok = np.where(wl.steps > 0, 0.0, ok)
    return DecodeSizing(workers, float(ok.mean()), b, itl, cap, limit)


def size_decode(rate: float, wl: DecodeWorkload, step: StepFn, itl_target_s: float, goal: float,
                burst: float = 1.0, max_num_seqs: int = 256, kv_tokens: float = math.inf,
                max_workers: int = 4096) -> DecodeSizing:
    """The least D whose predicted attainment reaches `goal` of the attainable share (the
    requests with slack that the ITL target allows at one sequence a step)."""
    cap, limit = decode_batch_cap(step, wl.context, itl_target_s, max_num_seqs)
    if rate <= 0 or not len(wl.steps):
        return DecodeSizing(0, 1.0, 0.0, 0.0, cap, limit)
    cap = max(cap, 1)              # a target no batch meets: one sequence per worker is the best
    feasible = (wl.slack_s > 0) & ((wl.steps == 0) | (step(1, wl.context) < itl_target_s))
    need = goal * float(feasible.mean())
    d = max(1, math.ceil(rate * wl.steps_per_request * step(cap, wl.context) / cap))
    while True:
        s = decode_attainment(d, rate, wl, step, itl_target_s, cap, limit, burst, kv_tokens)
        if s.attainment >= need or d >= max_workers:
            return s
        d += 1


# ---- aggregated serving ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PromptWork:
    """The prompts an aggregated worker computes itself, over a sample of requests."""
    prefill_s: np.ndarray      # S_i: each prompt's compute alone (the profile's prefill, corrected)
    uncached: np.ndarray       # the tokens it computes (prompt less its cached prefix)
    chunk_tokens: int          # a step's token budget (the engine's max_num_batched_tokens)

    def chunks(self, batch: float) -> np.ndarray:
        """k_i: the steps each prompt takes on a worker decoding `batch` sequences, one chunk of the
        budget the decodes leave per step."""
        return np.ceil(self.uncached / max(self.chunk_tokens - math.ceil(batch), 1))

    def beside_decodes_s(self, batch: float, step_s: float) -> np.ndarray:
        """Each prompt's compute on a worker decoding `batch` sequences: its k_i steps each also pay
        the decodes' step_s."""
        return self.prefill_s + self.chunks(batch) * step_s


@dataclass(frozen=True, slots=True)
class AggregatedModel:
    """What an aggregated pool is sized against, besides the load."""
    step: StepFn               # the decode step, corrected
    ttft_target_s: float
    itl_target_s: float
    max_num_seqs: int
    kv_capacity: float = math.inf
    bursts: tuple[float, float] = (1.0, 1.0)   # the arrivals' burstiness at the prefill and decode time scales


@dataclass(frozen=True, slots=True)
class AggregatedSizing:
    workers: int
    ttft_attainment: float     # predicted share whose wait for and compute on their worker fit the TTFT target
    attainment: float          # predicted share admitted in time with the ITL target held (decode_attainment's)
    prefill_share: float       # u: the share of a worker's time its prompts' chunks take
    batch: float               # mean sequences decoding per worker
    itl_s: float               # the mean step, stretched by the chunks
    limit: str                 # what bounds the decode side (itl | max_num_seqs | kv)

    def meets(self, needs: tuple[float, float]) -> bool:
        """Whether both attainments reach `needs` (aggregated_needs)."""
        return self.workers > 0 and self.ttft_attainment >= needs[0] and self.attainment >= needs[1]


def aggregated_needs(prompts: PromptWork, wl: DecodeWorkload, m: AggregatedModel, goal: float) -> tuple[float, float]:
    """The (TTFT, decode) attainments aggregated workers must reach: `goal` of the requests that can
    meet each target at all, counted as size_prefill and size_decode count them (from the prompt's
    compute alone, so that a request a prefill pool could serve is not written off here)."""
    slack = m.ttft_target_s - prompts.prefill_s
    feasible = (slack > 0) & ((wl.steps == 0) | (m.step(1, wl.context) < m.itl_target_s))
    return goal * float((slack > 0).mean()), goal * float(feasible.mean())


def aggregated_attainment(workers: int, rate: float, prompts: PromptWork, wl: DecodeWorkload,
                          m: AggregatedModel) -> AggregatedSizing:
    """Predicted attainments of `workers` aggregated workers: no prefill pool, each worker computes
    the prompts routed to it in its own decode steps (the frontend's behaviour without prefill
    workers, chunked prefill in the engine).

    1. The stretch: a worker computes rate / workers * E[S] seconds of prompt chunks per second, u.
       The engine fills each step's token budget with its decodes and then the next chunk, so in a
       second it runs (1 - u) / f(B, C) decode steps: the mean step, every decode's ITL, is
       f(B, C) / (1 - u). That stretched step goes through the decode model unchanged (the batch's
       fixed point, the batch cap under the ITL target, admission).
    2. The TTFT: a prompt is computed one chunk a step, each step also carrying its worker's B
       decodes (PromptWork.beside_decodes_s), and a worker computes its prompts one at a time in
       arrival order: the prefill pool's M/G/c FIFO model over the `workers` (prefill_attainment),
       with that compute as the service time. One shared queue is optimistic: a prompt is bound to
       its decode worker when it is routed (the router counts each worker's waiting prefill tokens,
       which keeps the queues close to one); an M/G/1 queue per worker is the other bound.
    3. Admission as in disaggregated decode: a request waits for a batch slot and KV before its
       prompt is computed, within its TTFT slack less that compute, and holds its KV through its
       wait for a lane and its compute.
    4. The ITL of short outputs (chunk_itl_ok): the stretched step is a mean over many steps, but
       a request of few steps meets its ITL target only if few of them carry a chunk.
    A request meets both with the product of the chances of 3 and 4 (taken as independent)."""
    if workers <= 0 or not len(wl.steps):
        return AggregatedSizing(workers, float(workers > 0), float(workers > 0), 0.0, 0.0, 0.0, "")
    share = rate * float(prompts.prefill_s.mean()) / workers
    if share >= 1:
        return AggregatedSizing(workers, 0.0, 0.0, share, math.inf, math.inf, "")

    def stretched(batch: float, context: float) -> float:
        return m.step(batch, context) / (1 - share)

    cap, limit = decode_batch_cap(stretched, wl.context, m.itl_target_s, m.max_num_seqs)
    cap = max(cap, 1)
    batch = decode_batch(workers, rate, wl, stretched, ceiling=cap)
    if not math.isfinite(batch):
        return AggregatedSizing(workers, 0.0, 0.0, share, batch, math.inf, limit)
    step_s = m.step(max(batch, 1.0), wl.context)
    compute_s = prompts.beside_decodes_s(batch, step_s)
    lane = prefill_attainment(workers, rate, compute_s, m.ttft_target_s, m.bursts[0])
    held = DecodeWorkload(wl.steps, wl.context, wl.kv_tokens, compute_s + min(lane.mean_wait_s, m.ttft_target_s),
                          m.ttft_target_s - compute_s)
    dec = decode_attainment(workers, rate, held, stretched, m.itl_target_s, cap, limit, m.bursts[1], m.kv_capacity)
    chunks = float(prompts.chunks(batch).mean())
    carry = min(rate / workers * chunks * step_s / (1 - share), 1.0)     # chunk steps / decode steps
    itl_ok = chunk_itl_ok(wl.steps, carry, float(prompts.prefill_s.mean()) / chunks, step_s, m.itl_target_s)
    return AggregatedSizing(workers, lane.attainment, dec.attainment * float(itl_ok.mean()), share, dec.batch,
                            dec.itl_s, dec.limit)


_erf = np.frompyfunc(math.erf, 1, 1)


def chunk_itl_ok(steps: np.ndarray, carry: float, chunk_s: float, step_s: float, itl_target_s: float) -> np.ndarray:
    """Per request, the chance that its mean inter-token gap meets the target on a worker whose
    decode steps take step_s and a share `carry` of which also carry a prompt's chunk of chunk_s:
    over its s steps, K ~ Binomial(s, carry) carry one, and its mean gap step_s + chunk_s K / s
    meets the target iff K <= s (target - step_s) / chunk_s (normal approximation, continuity
    corrected). A request of one token (s = 0) has no gap to miss."""
    room = steps * (itl_target_s - step_s) / max(chunk_s, 1e-12)
    if carry <= 0 or carry >= 1:
        return np.where((steps == 0) | (room >= steps * carry), 1.0, 0.0)
    sd = np.sqrt(np.maximum(steps * carry * (1 - carry), 1e-12))
    z = (room + 0.5 - steps * carry) / (sd * math.sqrt(2))
    return np.where(steps == 0, 1.0, 0.5 * (1 + _erf(z).astype(np.float64)))


def size_aggregated(rate: float, prompts: PromptWork, wl: DecodeWorkload, m: AggregatedModel, goal: float,
                    max_workers: int = 4096) -> AggregatedSizing:
    """The least number of aggregated workers whose TTFT and decode attainments both reach `goal`
    of the requests that can meet them (at most max_workers), from the least that keeps u < 1."""
    if rate <= 0 or not len(wl.steps):
        return AggregatedSizing(0, 1.0, 1.0, 0.0, 0.0, 0.0, "")
    needs = aggregated_needs(prompts, wl, m, goal)
    n = max(1, math.floor(rate * float(prompts.prefill_s.mean())) + 1)
    while True:
        s = aggregated_attainment(n, rate, prompts, wl, m)
        if s.meets(needs) or n >= max_workers:
            return s
        n += 1
