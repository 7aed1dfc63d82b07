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
A worker's batch is capped by the ITL target (f(B, C) <= ITL), the engine's max_num_seqs and its
KV (B * R <= capacity, R = the tokens a sequence reserves): cap. The pool is then D * cap batch
slots, and a request holds one for s_i f(B, C) seconds (s_i = its decode steps = output - 1).
When all are taken it waits after its first token, and its mean ITL absorbs the wait: it meets
the target iff wait <= s_i (ITL - f(B, C)). The wait is M/G/c's again (c = D * cap slots, same
Allen-Cunneen and exponential tail as prefill), so

    attainment(D) = mean_i (1 - C exp(-s_i (ITL - f(B, C)) C / W))      (1 for s_i = 0)

and the pool needs the least D with attainment(D) >= goal. C and R are time-weighted: a sequence
of o output tokens stays o - 1 steps, so C = sum (o-1)(p + o/2) / sum (o-1) and
R = sum (o-1)(p + o) / sum (o-1) over the sample.

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
    steps: np.ndarray          # per sampled request: decode steps (output tokens after the first)
    context: float             # C: time-weighted mean tokens a running sequence attends
    reserved: float            # R: time-weighted mean KV tokens a running sequence holds

    @property
    def steps_per_request(self) -> float:
        return float(self.steps.mean()) if len(self.steps) else 0.0

    @staticmethod
    def from_lengths(prompt: np.ndarray, output: np.ndarray) -> "DecodeWorkload":
        steps = np.maximum(output.astype(np.float64) - 1, 0)
        total = float(steps.sum())
        if not len(prompt) or total <= 0:
            return DecodeWorkload(steps, 0.0, 0.0)
        context = float((steps * (prompt + output / 2)).sum()) / total
        reserved = float((steps * (prompt + output)).sum()) / total
        return DecodeWorkload(steps, context, reserved)


@dataclass(frozen=True, slots=True)
class DecodeSizing:
    workers: int
    attainment: float      # predicted share of requests with mean ITL <= target
    batch: float           # mean sequences per worker
    itl_s: float           # the step time at that batch
    batch_cap: int         # the most sequences a worker runs at once
    limit: str             # what set the cap: itl | kv | max_num_seqs


def decode_batch_cap(step: StepFn, context: float, itl_target_s: float, max_num_seqs: int,
                     kv_tokens: int, reserved: float) -> tuple[int, str]:
    """The largest batch within the ITL target, max_num_seqs and the KV capacity."""
    lo, hi = 0, max_num_seqs       # bisection: step time grows with the batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step(mid, context) <= itl_target_s:
            lo = mid
        else:
            hi = mid - 1
    caps = {"itl": lo, "kv": int(kv_tokens // reserved) if reserved > 0 else max_num_seqs,
            "max_num_seqs": max_num_seqs}
    limit = min(("max_num_seqs", "kv", "itl"), key=lambda k: caps[k])   # ties: the engine's limits
    return caps[limit], limit


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


def decode_attainment(workers: int, rate: float, wl: DecodeWorkload, step: StepFn, itl_target_s: float,
                      cap: int, limit: str = "", burst: float = 1.0) -> DecodeSizing:
    """Predicted share of requests whose mean ITL meets the target with `workers` workers.

    The pool is workers * cap batch slots; a request holds one for its decode time s_i * f(B, C)
    (s_i = its decode steps) and, when all are taken, waits for one after its first token, which
    its mean ITL absorbs: it meets the target iff wait <= s_i (ITL - f(B, C)). The wait is
    M/G/c's (the prefill formulas, with c = slots)."""
    cap = max(cap, 1)
    b = decode_batch(workers, rate, wl, step, ceiling=cap) if workers > 0 else math.inf
    if not math.isfinite(b):
        return DecodeSizing(workers, 0.0, b, math.inf, cap, limit)
    itl = step(max(b, 1.0), wl.context)
    steps = wl.steps
    decoding = steps > 0
    slack = steps * (itl_target_s - itl)
    if not decoding.any() or rate <= 0:
        return DecodeSizing(workers, 1.0, b, itl, cap, limit)
    p_wait, wait = prefill_wait(workers * cap, rate, steps * itl, burst)
    if math.isinf(wait):
        ok = np.where(decoding, 0.0, 1.0)
    elif wait <= 0 or p_wait <= 0:
        ok = np.where(decoding, slack > 0, 1.0)
    else:
        ok = np.where(decoding, np.where(slack > 0, 1.0 - p_wait * np.exp(-np.maximum(slack, 0.0) * (p_wait / wait)), 0.0), 1.0)
    return DecodeSizing(workers, float(ok.mean()), b, itl, cap, limit)


def size_decode(rate: float, wl: DecodeWorkload, step: StepFn, itl_target_s: float, goal: float,
                burst: float = 1.0, max_num_seqs: int = 256, kv_tokens: int = 450_000,
                max_workers: int = 4096) -> DecodeSizing:
    """The least D whose predicted ITL attainment reaches `goal` of the attainable share."""
    cap, limit = decode_batch_cap(step, wl.context, itl_target_s, max_num_seqs, kv_tokens, wl.reserved)
    if rate <= 0 or wl.steps_per_request <= 0:
        return DecodeSizing(0, 1.0, 0.0, 0.0, cap, limit)
    cap = max(cap, 1)              # a target no batch meets: one sequence per worker is the best
    need = goal * float(((wl.steps == 0) | (step(1, wl.context) < itl_target_s)).mean())
    d = max(1, math.ceil(rate * wl.steps_per_request * step(cap, wl.context) / cap))
    while True:
        s = decode_attainment(d, rate, wl, step, itl_target_s, cap, limit, burst)
        if s.attainment >= need or d >= max_workers:
            return s
        d += 1
