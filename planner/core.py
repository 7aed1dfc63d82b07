"""The planner core: observations in, a decision out. No I/O, no clock of its own.

Every interval the caller (the live loop, the simulator, a test) hands `Planner.decide` an
`Observation` stamped with the time; the core answers a `Decision`: the desired size of each pool
and why. Time exists only as `Observation.now_s`, so a trace replays at any speed.

One decision, in order:

1. Observe: the interval's arrival count feeds the predictor; the arrivals' lengths (with their
   prefix-cache hits) join a window of recent requests; the arrivals' burstiness is measured; the
   finished prefills and the decode steps update three corrections (prefill compute vs the
   profile, prefill queue wait vs the queueing model, decode step vs the profile).
2. Plan the load: a new worker serves `startup_s` after it is asked for and the next decision comes
   `interval_s` later, so plan on the worst `arrival_quantile` of the predicted arrivals over
   H = ceil((startup_s + interval_s) / interval_s) intervals.
3. Size each pool (planner/sizing.py) at that load from the window's lengths, the profile and
   the corrections, for the pool's share of the attainment goal: `required`; and at the load times
   (1 + hysteresis): `required_down`. Prefill workers that queue in deadline order (the default,
   `prefill_deadline`) are sized as a queue with patience, FIFO ones as M/G/c.
4. Act: up at once to `required` (starting workers count as capacity, so a start-up in progress is
   never doubled). Down only to the largest `required_down` since the decision in force the
   pool's `down_delay` seconds ago (a worker goes once it has been unneeded that long; decode
   waits one start-up, prefill by default not at all, PlannerConfig.down_delay says why): the
   hysteresis means the survivors must still meet the goal if the load rises by that much, and
   since the model sizes from the total load, the N/(N-1) share the survivors absorb is already in
   it. Scale-down is never blocked by workers still starting (the caller cancels those first).
5. Clamp to each pool's min and max, then fit both pools in the GPU budget (draining workers
   still hold GPUs), sharing it in proportion to what each pool wants.

It knows nothing of Redis, processes, routers or how workers are started and stopped.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import Iterable, Sequence

import numpy as np

from planner.config import PlannerConfig, PoolLimits
from planner.correction import Correction, MissLift
from planner.decision import (FIXED_DISAGGREGATED, Bound, Decision, LoadEstimate, ModeDecision, Observation, Pool,
                              PoolDecision, PoolState, RequestSample)
from planner.mode import ModeChooser, ModeCosts
from planner.predictors import Forecast, Predictor, make_predictor
from planner.sizing import (AggregatedModel, DecodeWorkload, PromptWork, aggregated_attainment, aggregated_needs,
                            decode_attainment, decode_batch_cap, prefill_attainment, prefill_wait, size_aggregated,
                            size_decode, size_prefill)
from perf.profile import Profile
from runtime.config_planner import ServingMode

BURST_INTERVALS = 10         # burstiness is pooled over this many recent intervals
WAIT_FLOOR_SHARE = 0.05      # waits below 5% of the TTFT target are noise to the wait correction
MIN_BURST_ARRIVALS = 20      # fewer arrivals in an interval say nothing about burstiness


def dispersion_index(intervals: Iterable[tuple[float, float, np.ndarray, float]], window_s: float) -> float:
    """Index of dispersion (variance / mean) of arrival counts in windows of window_s, pooled over
    `intervals` (start, end, arrival times, the share of the interval's arrivals they are), each
    against its own mean (so a trend across intervals is not mistaken for bursts) and undoing the
    thinning of a sampled list. Never below 1: we do not plan on smoother than Poisson."""
    num = den = dof = 0.0
    for start, end, arrivals, fraction in intervals:
        bins = int((end - start) // window_s)
        if bins < 2:
            continue
        counts = np.bincount(((arrivals - start) // window_s).astype(int), minlength=bins)[:bins]
        mean = counts.mean()
        if mean > 0:
            num += float(((counts - mean) ** 2).sum()) / fraction
            den += mean / fraction * (bins - 1)
            dof += bins - 1
    if den <= 0:
        return 1.0
    idc = num / den
    # A variance ratio over `dof` degrees of freedom has a relative standard error of
    # sqrt(2 / dof): count only the burstiness above one standard error, so that Poisson
    # arrivals read as 1 instead of noise that moves the pools' step boundaries.
    return max(idc * (1 - math.sqrt(2 / dof)), 1.0)


class Planner:
    def __init__(self, config: PlannerConfig, profile: Profile, predictor: Predictor | None = None) -> None:
        self.config = config
        self.profile = profile
        self.predictor = predictor or make_predictor(config.predictor)
        # (prompt, cached, output, profile prefill seconds) of recent requests
        self._samples: deque[tuple[int, int, int, float]] = deque(maxlen=config.num_samples)
        self.service_correction = Correction()
        self.wait_correction = Correction()
        self.decode_correction = Correction()
        # the closed loop: the prefill pool lifted by its TTFT misses, the decode pool by its own
        # (ITL misses, and TTFT misses spent waiting for a decode worker)
        self.ttft_lift = MissLift()
        self.itl_lift = MissLift(judge_gain=False)
        self._burst = {Pool.PREFILL: 1.0, Pool.DECODE: 1.0}
        self._arrivals: deque[tuple[float, float, np.ndarray, float]] = deque(maxlen=BURST_INTERVALS)
        self._history: dict[Pool, deque[tuple[float, int]]] = {Pool.PREFILL: deque(), Pool.DECODE: deque()}
        self._first_s: float | None = None
        self.modes = ModeChooser(config.mode, config.mode_switch_intervals)
        self.last: Decision | None = None

    # ---- the two entry points -----------------------------------------------------------------

    def warm_start(self, counts: Sequence[float], samples: Sequence[RequestSample] = ()) -> None:
        """Prime the predictor with past per-interval arrival counts (oldest first) and the length
        window and burstiness with past requests, e.g. from a trace or the previous run."""
        self.predictor.warm_start(counts)
        self._add_samples(samples)
        if samples:
            t0 = samples[0].arrival_s
            for k in range(int((samples[-1].arrival_s - t0) // self.config.interval_s) + 1):
                lo = t0 + k * self.config.interval_s
                chunk = [s.arrival_s for s in samples if lo <= s.arrival_s < lo + self.config.interval_s]
                self._record_arrivals(chunk, lo, lo + self.config.interval_s, 1.0)
            self._update_burst()

    def _update_burst(self) -> None:
        """Burstiness at the prefill queue's time scale (the TTFT target) and at the decode pool's
        (a request's decode time at the ITL target)."""
        steps = np.mean([s[2] for s in self._samples]) - 1 if self._samples else 0.0
        self._burst[Pool.PREFILL] = self._burstiness(self.config.ttft_target_s)
        self._burst[Pool.DECODE] = self._burstiness(max(steps, 1.0) * self.config.itl_target_s)

    def decide(self, obs: Observation) -> Decision:
        if self._first_s is None:
            self._first_s = obs.now_s
        self._observe(obs)
        cfg = self.config
        horizon = self._horizon()
        forecasts = [self._rate_forecast(h) for h in range(1, horizon + 1)]
        rate = forecasts[0].mean / cfg.interval_s
        plan_rate = max(f.quantile(cfg.arrival_quantile) for f in forecasts) / cfg.interval_s
        prompt, cached, output, service = self._arrays()
        load = self._load_estimate(rate, plan_rate, horizon * cfg.interval_s, prompt, cached, output)
        if not len(prompt):
            pre = self._hold(Pool.PREFILL, obs.prefill, cfg.prefill)
            dec = self._hold(Pool.DECODE, obs.decode, cfg.decode)
            mode = self.modes.hold()
        else:
            pre, dec, mode = self._size(obs, plan_rate, prompt, cached, output, service)
        self.last = Decision(obs.now_s, pre, dec, load, self.wait_correction.value, mode)
        return self.last

    def _horizon(self) -> int:
        """Decisions ahead a new worker needs: it serves startup_s after it is asked for, and the
        next decision comes one interval later."""
        cfg = self.config
        return max(1, math.ceil((cfg.startup_s + cfg.interval_s) / cfg.interval_s))

    def _rate_forecast(self, steps: int) -> Forecast:
        """The predictor's forecast of the count, less the count's own sampling noise: given the
        rate, the arrivals scatter with variance burst * mean, and the queueing models already
        plan for that scatter (their burstiness terms). What is left is the uncertainty of the
        rate itself, which is what the quantile must cover."""
        f = self.predictor.forecast(steps)
        noise = max(self._burst.values()) * f.mean
        return Forecast(f.mean, math.sqrt(max(f.sd * f.sd - noise, 0.0)))

    # ---- observing ----------------------------------------------------------------------------

    def _observe(self, obs: Observation) -> None:
        cfg = self.config
        self.predictor.observe(obs.num_arrivals * cfg.interval_s / obs.interval_s)
        self._add_samples(obs.requests)
        times = obs.arrival_times if obs.arrival_times is not None else [r.arrival_s for r in obs.requests]
        if times and obs.num_arrivals:
            # only the arrivals inside the interval (requests that finished in it may have arrived
            # before it), as the sampled share of the interval's arrivals
            start = obs.now_s - obs.interval_s
            inside = [t for t in times if start < t <= obs.now_s]
            self._record_arrivals(inside, start, obs.now_s, min(len(inside) / obs.num_arrivals, 1.0))
        self._update_burst()
        self._correct_prefill(obs)
        st = obs.decode_stats
        if st.num_steps >= cfg.min_records and st.mean_batch > 0:
            modelled = self.profile.decode_step_s(st.mean_batch, st.mean_context)
            if self._aggregated_serving(obs):
                # the aggregated model prices the prompts' chunks in the steps itself (the stretch,
                # planner/sizing.py): compare against the stretched step, or they count twice
                modelled /= 1 - self._prefill_share(obs)
            self.decode_correction.update(st.mean_step_s, modelled)

    def _prefill_share(self, obs: Observation) -> float:
        """The share of each ready decode worker's time the interval's prompts took (their profile
        prefill, corrected), for aggregated serving; inf past 1 (no step time to compare with)."""
        if not obs.requests or not obs.decode.ready:
            return 0.0
        seconds = sum(self.profile.prefill_s(r.prompt_tokens, r.cached_tokens) for r in obs.requests)
        share = (seconds * obs.num_arrivals / len(obs.requests) * self.service_correction.value
                 / (obs.interval_s * obs.decode.ready))
        return share if share < 1 else math.inf

    def _add_samples(self, samples: Sequence[RequestSample]) -> None:
        prefill_s = self.profile.prefill_s
        for s in samples:
            self._samples.append((s.prompt_tokens, s.cached_tokens, s.output_tokens,
                                  prefill_s(s.prompt_tokens, s.cached_tokens)))

    def _correct_prefill(self, obs: Observation) -> None:
        records = obs.prefills
        if len(records) < self.config.min_records:
            return
        modelled = np.array([self.profile.prefill_s(r.prompt_tokens, r.cached_tokens) for r in records])
        observed = np.array([r.compute_s for r in records])
        self.service_correction.update(float(observed.sum()), float(modelled.sum()))
        if obs.prefill.ready:
            rate = obs.num_arrivals / obs.interval_s
            _, wait = prefill_wait(obs.prefill.ready, rate, modelled * self.service_correction.value,
                                   self._burst[Pool.PREFILL])
            observed_wait = sum(r.wait_s for r in records) / len(records)
            self.wait_correction.update(observed_wait, wait, WAIT_FLOOR_SHARE * self.config.ttft_target_s)

    def _record_arrivals(self, arrivals: Sequence[float], start_s: float, end_s: float, fraction: float) -> None:
        if len(arrivals) >= MIN_BURST_ARRIVALS and end_s > start_s:
            self._arrivals.append((start_s, end_s, np.asarray(arrivals, dtype=np.float64), fraction))

    def _burstiness(self, window_s: float) -> float:
        return dispersion_index(self._arrivals, min(window_s, self.config.interval_s / 2))

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if not self._samples:
            empty = np.zeros(0)
            return empty, empty, empty, empty
        a = np.array(self._samples, dtype=np.float64)
        return a[:, 0], a[:, 1], a[:, 2], a[:, 3]

    def _load_estimate(self, rate: float, plan_rate: float, horizon_s: float, prompt: np.ndarray,
                       cached: np.ndarray, output: np.ndarray) -> LoadEstimate:
        def q(x: np.ndarray, p: float) -> float:
            return float(np.percentile(x, p)) if len(x) else 0.0
        hit = float(cached.sum() / prompt.sum()) if len(prompt) and prompt.sum() else 0.0
        return LoadEstimate(self.predictor.name, rate, plan_rate, horizon_s, len(prompt), q(prompt, 50),
                            q(prompt, 90), hit, q(output, 50), q(output, 90),
                            self._burst[Pool.PREFILL], self._burst[Pool.DECODE])

    # ---- sizing -------------------------------------------------------------------------------

    def _size(self, obs: Observation, plan_rate: float, prompt: np.ndarray, cached: np.ndarray,
              output: np.ndarray, service: np.ndarray) -> tuple[PoolDecision, PoolDecision, ModeDecision]:
        """Steps 3-6 of a decision with requests to size from: both pools of the disaggregated
        mode; with the mode choice on, the aggregated pool too and the mode (planner/mode.py);
        then the pools for the chosen mode, fitted in the budget, with their predictions."""
        cfg = self.config
        service = service * self.service_correction.value
        prompts = PromptWork(service, prompt - cached, self.profile.max_num_batched_tokens)
        alone = DecodeWorkload.from_lengths(prompt, output)     # the decode side of aggregated serving
        self._close_loop(obs, service, prompt, output, prompts, alone)
        rates = (plan_rate, plan_rate * (1 + cfg.hysteresis))
        lift = self.ttft_lift.value
        pre = self._pool(Pool.PREFILL, obs.now_s, obs.prefill, cfg.prefill,
                         *(self._prefill_workers(r * lift, service) for r in rates), self.ttft_lift)
        workload = self._decode_workload(prompt, output, service, pre.desired, plan_rate)
        lift = self.itl_lift.value
        split = [self._decode_workers(r * lift, workload) for r in rates]
        if cfg.mode is ServingMode.DISAGGREGATED:
            mode, decode_need = FIXED_DISAGGREGATED, split
        else:
            aggregated = [self._aggregated_workers(r * lift, prompts, alone) for r in rates]
            mode = self.modes.choose(self._costs(pre, split, aggregated))
            decode_need = aggregated if mode.mode is ServingMode.AGGREGATED else split
        dec = self._pool(Pool.DECODE, obs.now_s, obs.decode, cfg.decode, *decode_need, self.itl_lift)
        if mode.mode is ServingMode.AGGREGATED:
            pre, dec = self._fit_budget(self._drain_prefill(pre, obs, dec.desired), dec, obs)
            return (*self._predict_aggregated(pre, dec, plan_rate, prompts, alone), mode)
        pre, dec = self._fit_budget(pre, dec, obs)
        return self._predict(pre, plan_rate, service), self._predict_decode(dec, plan_rate, workload), mode

    def _prefill_workers(self, rate: float, service: np.ndarray) -> int:
        return size_prefill(rate, service, self.config.ttft_target_s, self.config.pool_goal,
                            self._burst[Pool.PREFILL], self.wait_correction.value,
                            self.config.prefill.max_workers + 1, self.config.prefill_deadline).workers

    def _decode_step(self, batch: float, context: float) -> float:
        return self.decode_correction.value * self.profile.decode_step_s(batch, context)

    def _decode_workload(self, prompt: np.ndarray, output: np.ndarray, service: np.ndarray, prefill_workers: int,
                         rate: float) -> DecodeWorkload:
        """The decode pool's view of the sample: a request holds its decode worker's KV from
        admission through its prefill (the prefill pool's mean queue wait at its size, plus its
        own compute) and may wait for admission as long as its TTFT slack."""
        cfg = self.config
        _, wait = prefill_wait(prefill_workers, rate, service, self._burst[Pool.PREFILL], self.wait_correction.value)
        if self.ttft_lift.value > 1.0:
            # the prefill pool was seen missing its target: until its lift is undone, prompts
            # wait up to their TTFT slack (not the model's wait), holding their decode slots
            wait = cfg.ttft_target_s
        hold = service + min(wait, cfg.ttft_target_s)
        return DecodeWorkload.from_lengths(prompt, output, hold, cfg.ttft_target_s - service)

    def _decode_workers(self, rate: float, workload: DecodeWorkload) -> int:
        p = self.profile
        return size_decode(rate, workload, self._decode_step, self.config.itl_target_s, self.config.pool_goal,
                           self._burst[Pool.DECODE], p.max_num_seqs, p.kv_capacity_tokens,
                           self.config.decode.max_workers + 1).workers

    def _aggregated_model(self) -> AggregatedModel:
        cfg, p = self.config, self.profile
        return AggregatedModel(self._decode_step, cfg.ttft_target_s, cfg.itl_target_s, p.max_num_seqs,
                               p.kv_capacity_tokens, (self._burst[Pool.PREFILL], self._burst[Pool.DECODE]))

    def _aggregated_workers(self, rate: float, prompts: PromptWork, alone: DecodeWorkload) -> int:
        return size_aggregated(rate, prompts, alone, self._aggregated_model(), self.config.pool_goal,
                               self.config.decode.max_workers + 1).workers

    # ---- the serving mode (planner/mode.py) ---------------------------------------------------

    def _costs(self, pre: PoolDecision, split: list[int], aggregated: list[int]) -> ModeCosts:
        """The GPUs of each mode's requirements at the planned load and with the hysteresis margin."""
        gp, gd = self.config.prefill_gpus, self.config.decode_gpus
        return ModeCosts(pre.required * gp + split[0] * gd, aggregated[0] * gd,
                         pre.required_down * gp + split[1] * gd, aggregated[1] * gd)

    def _drain_prefill(self, pre: PoolDecision, obs: Observation, decode_desired: int) -> PoolDecision:
        """Aggregated serving's prefill pool: 0, once the decode pool has the ready workers to
        compute every prompt; until then (a switch's decode workers still starting) it keeps the
        workers it has, so prompts are not piled on the decode workers that were sized beside it."""
        desired = 0 if obs.decode.ready >= decode_desired else pre.current
        return replace(pre, desired=desired, bound=Bound.MODE)

    def _aggregated_serving(self, obs: Observation) -> bool:
        """No prefill worker was ready in the interval, with the mode choice on: the decode workers
        computed every prompt (the frontend's no_prefill_pool), so the interval is aggregated
        serving whatever the mode planned, and the aggregated model is what it is judged against."""
        return self.config.mode is not ServingMode.DISAGGREGATED and obs.prefill.ready == 0

    # ---- the closed loop --------------------------------------------------------------------

    def _close_loop(self, obs: Observation, service: np.ndarray, prompt: np.ndarray, output: np.ndarray,
                    prompts: PromptWork, alone: DecodeWorkload) -> None:
        """Feed each pool's lift the interval's outcomes, with whether the model (without the
        lift) predicted that the pool meets its goal at the interval's load and ready workers.
        In aggregated serving the decode pool is the one pool: its lift takes every miss, TTFT and
        ITL, against the allowance of both targets, judged by the aggregated model."""
        cfg, o = self.config, obs.outcomes
        allowance = 1 - cfg.pool_goal
        rate = obs.num_arrivals / obs.interval_s
        if self._aggregated_serving(obs):
            ready = obs.decode.ready
            model = self._aggregated_model()
            needs = aggregated_needs(prompts, alone, model, cfg.pool_goal)
            self.itl_lift.observe(max(o.ttft_count, o.itl_count), o.ttft_missed + o.itl_missed, 2 * allowance, ready,
                                  lambda: aggregated_attainment(ready, rate, prompts, alone, model).meets(needs),
                                  cfg.min_records)
            # no prefill pool to judge: its lift, a correction for misses seen while it served,
            # is undone as in an interval its model agreed with, so that the disaggregated mode's
            # GPUs (the mode choice's challenger) are not priced at a burst long gone
            if o.ttft_count >= cfg.min_records:
                self.ttft_lift.relax()
            return
        self.ttft_lift.observe(o.ttft_count, o.ttft_missed - o.ttft_missed_decode, allowance, obs.prefill.ready,
                               lambda: self._prefill_meets(obs.prefill.ready, rate, service), cfg.min_records)
        wl = lambda: self._decode_workload(prompt, output, service, obs.prefill.ready, rate)  # noqa: E731
        self.itl_lift.observe(max(o.ttft_count, o.itl_count), o.ttft_missed_decode + o.itl_missed, allowance,
                              obs.decode.ready, lambda: self._decode_meets(obs.decode.ready, rate, wl()),
                              cfg.min_records)

    def _prefill_meets(self, workers: int, rate: float, service: np.ndarray) -> bool:
        cfg = self.config
        s = prefill_attainment(workers, rate, service, cfg.ttft_target_s, self._burst[Pool.PREFILL],
                               self.wait_correction.value, cfg.prefill_deadline)
        return workers > 0 and s.attainment >= cfg.pool_goal * float((service < cfg.ttft_target_s).mean())

    def _decode_meets(self, workers: int, rate: float, wl: DecodeWorkload) -> bool:
        p, cfg = self.profile, self.config
        cap, limit = decode_batch_cap(self._decode_step, wl.context, cfg.itl_target_s, p.max_num_seqs)
        s = decode_attainment(workers, rate, wl, self._decode_step, cfg.itl_target_s, cap, limit,
                              self._burst[Pool.DECODE], p.kv_capacity_tokens)
        return workers > 0 and s.attainment >= cfg.pool_goal * float((wl.slack_s > 0).mean())

    # ---- acting -------------------------------------------------------------------------------

    def _pool(self, pool: Pool, now_s: float, state: PoolState, limits: PoolLimits,
              required: int, required_down: int, lift: MissLift) -> PoolDecision:
        history = self._history[pool]
        # The window reaches back to the decision in force down_delay ago (made up to one interval
        # before it): a worker goes only once it has been unneeded for a whole down_delay. Keeping
        # only the decisions inside the delay left just the latest one whenever decisions are
        # further apart than the delay: no cooldown at all. With no delay the window is this
        # decision alone (the hysteresis margin is then the only guard), whatever the spacing.
        delay = self.config.down_delay(decode=pool is Pool.DECODE)
        if delay <= 0:
            history.clear()
        history.append((now_s, required_down))
        while history and history[0][0] <= now_s - delay - self.config.interval_s:
            history.popleft()
        current = state.active
        lifted = lift.floor > required
        if lifted:
            required, required_down = lift.floor, max(required_down, lift.floor)
        if required >= current:
            desired, bound = required, Bound.LIFT if lifted else Bound.MODEL
        elif self._first_s is None or now_s - self._first_s < delay:
            desired, bound = current, Bound.DOWN_DELAY       # not yet a whole delay of evidence
        else:
            floor = max(v for _, v in history)
            desired = min(current, max(required, floor))
            bound = (Bound.MODEL if desired == required else
                     Bound.HYSTERESIS if desired == required_down else Bound.DOWN_DELAY)
        desired, bound = self._clamp(desired, bound, limits)
        corr = self.service_correction.value if pool is Pool.PREFILL else self.decode_correction.value
        return PoolDecision(pool, current, required, required_down, self.config.hysteresis, desired, bound, corr,
                            0.0, 0.0, lift=lift.value)

    def _hold(self, pool: Pool, state: PoolState, limits: PoolLimits) -> PoolDecision:
        desired, bound = self._clamp(state.active, Bound.NO_DATA, limits)
        return PoolDecision(pool, state.active, desired, desired, self.config.hysteresis, desired, bound, 1.0,
                            0.0, 0.0)

    @staticmethod
    def _clamp(desired: int, bound: Bound, limits: PoolLimits) -> tuple[int, Bound]:
        if desired < limits.min_workers:
            return limits.min_workers, Bound.MIN
        if desired > limits.max_workers:
            return limits.max_workers, Bound.MAX
        return desired, bound

    def _fit_budget(self, pre: PoolDecision, dec: PoolDecision, obs: Observation) -> tuple[PoolDecision, PoolDecision]:
        cfg = self.config
        if cfg.gpu_budget is None:
            return pre, dec
        gp, gd = cfg.prefill_gpus, cfg.decode_gpus          # GPUs per worker (their TP sizes)
        avail = max(cfg.gpu_budget - obs.prefill.draining * gp - obs.decode.draining * gd, cfg.min_gpus)
        if pre.desired * gp + dec.desired * gd <= avail:
            return pre, dec
        p, d = split_gpu_budget(avail, pre.desired, dec.desired, (gp, gd),
                                (cfg.prefill.min_workers, cfg.decode.min_workers))
        return (replace(pre, desired=p, bound=Bound.BUDGET) if p < pre.desired else pre,
                replace(dec, desired=d, bound=Bound.BUDGET) if d < dec.desired else dec)

    def _predict_aggregated(self, pre: PoolDecision, dec: PoolDecision, rate: float, prompts: PromptWork,
                            alone: DecodeWorkload) -> tuple[PoolDecision, PoolDecision]:
        """Aggregated serving's predictions at the decode pool's size: the TTFT attainment and each
        worker's prefill share on the prefill line, the stretched ITL and the batch on decode's."""
        s = aggregated_attainment(max(dec.desired, 1), rate, prompts, alone, self._aggregated_model())
        return (replace(pre, predicted=s.ttft_attainment, per_worker=s.prefill_share),
                replace(dec, predicted=s.itl_s, per_worker=s.batch, limit=s.limit))

    def _predict(self, d: PoolDecision, rate: float, service: np.ndarray) -> PoolDecision:
        s = prefill_attainment(d.desired, rate, service, self.config.ttft_target_s, self._burst[Pool.PREFILL],
                               self.wait_correction.value, self.config.prefill_deadline)
        return replace(d, predicted=s.attainment, per_worker=s.utilization)

    def _predict_decode(self, d: PoolDecision, rate: float, wl: DecodeWorkload) -> PoolDecision:
        p = self.profile
        cap, limit = decode_batch_cap(self._decode_step, wl.context, self.config.itl_target_s, p.max_num_seqs)
        s = decode_attainment(max(d.desired, 1), rate, wl, self._decode_step, self.config.itl_target_s, cap,
                              limit, self._burst[Pool.DECODE], p.kv_capacity_tokens)
        return replace(d, predicted=s.itl_s, per_worker=s.batch, limit=s.limit)


def split_gpu_budget(avail_gpus: int, prefill: int, decode: int, gpus: tuple[int, int],
                     mins: tuple[int, int]) -> tuple[int, int]:
    """Worker counts (prefill, decode) within `avail_gpus` when the wanted ones do not fit: each pool
    gets the budget's share its wanted GPUs have, at least its minimum, at most what it wants; a
    worker of each holds `gpus` GPUs (with one each: a split of workers)."""
    gp, gd = gpus
    share = round(avail_gpus * prefill * gp / (prefill * gp + decode * gd) / gp)
    p = min(max(share, mins[0]), (avail_gpus - mins[1] * gd) // gp, prefill)
    d = min((avail_gpus - p * gp) // gd, decode)
    p = min((avail_gpus - d * gd) // gp, prefill)
    return p, d
