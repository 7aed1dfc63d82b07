"""Prometheus helpers: per-component registries with `splitserve_` names, and a /metrics server."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> int:
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port


class WorkerMetrics:
    """Gauges sampled from the engine's stats once a second."""

    def __init__(self, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["worker"]
        self.worker_id = worker_id
        self.blocks_free = Gauge("splitserve_kv_blocks_free", "Free KV blocks", labels, registry=self.registry)
        self.blocks_used = Gauge("splitserve_kv_blocks_used", "KV blocks in use", labels, registry=self.registry)
        self.running = Gauge("splitserve_worker_requests_running", "Requests running", labels,
                             registry=self.registry)
        self.waiting = Gauge("splitserve_worker_requests_waiting", "Requests waiting", labels,
                             registry=self.registry)
        self.preemptions = Gauge("splitserve_worker_preemptions", "Preemptions so far", labels,
                                 registry=self.registry)
        self.prefix_hit_tokens = Gauge("splitserve_worker_prefix_hit_tokens", "Prompt tokens served from "
                                       "the prefix cache so far", labels, registry=self.registry)
        self.deadline_deferred = Gauge("splitserve_worker_prefill_deadline_deferred", "Prefill side, with a "
                                       "TTFT target: prompts put behind those that could still meet it, so far",
                                       labels, registry=self.registry)

        r = self.registry
        self.kv_handoffs = Counter("splitserve_kv_handoffs", "Prompts whose KV a prefill worker pushed here",
                                   labels, registry=r)
        self.prefill_fallback = Counter("splitserve_prefill_fallback", "Remote prefills computed here instead, "
                                        "by reason: saturated | draining | timeout | unavailable | error",
                                        labels + ["reason"], registry=r)
        self.prefill_refused = Counter("splitserve_prefill_refused", "Prefill side: prompts refused at once, by "
                                       "reason: saturated (could not finish within the lease) | draining",
                                       labels + ["reason"], registry=r)
        self.prefill_timeouts = Counter("splitserve_prefill_timeouts", "Prefill side: prompts that did not "
                                        "finish within their lease (the decode worker computed them)", labels,
                                        registry=r)
        self.handoff_s = Histogram("splitserve_kv_handoff_seconds", "Decode side: reservation to KV landed",
                                   labels, registry=r, buckets=LATENCY_BUCKETS_S)
        self.reserve_wait_s = Histogram("splitserve_kv_reserve_wait_seconds", "Decode side: Submit of a remote "
                                        "prefill to its blocks reserved (the Prefill RPC is sent then)", labels,
                                        registry=r, buckets=LATENCY_BUCKETS_S)
        self.prefill_compute_s = Histogram("splitserve_prefill_compute_seconds", "Prefill side: a prompt "
                                           "accepted to computed (its wait in the queue and its steps)", labels,
                                           registry=r, buckets=LATENCY_BUCKETS_S)
        self.kv_transfer_bytes = Counter("splitserve_kv_transfer_bytes", "KV bytes pushed to decode workers",
                                         labels, registry=r)
        self.kv_transfer_s = Histogram("splitserve_kv_transfer_seconds", "Duration of one KV push (NIXL WRITE)",
                                       labels, registry=r, buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1, 3))

        # KV hits per tier (blocks) and the tiers below G1 (docs/kv_tiers.md); counters follow the
        # engine's running totals
        self.kv_hits = Counter("splitserve_kv_hits", "Prompt blocks served from a KV tier instead of computed "
                               "(device: the GPU prefix cache; host, disk: loaded from the lower tiers)",
                               labels + ["tier"], registry=r)
        self.kv_tier_recomputed = Counter("splitserve_kv_tier_recomputed", "Prompt blocks found in host or disk "
                                          "but recomputed (predicted faster than loading)", labels + ["tier"],
                                          registry=r)
        self.kv_tier_blocks = Gauge("splitserve_kv_tier_blocks", "KV blocks held per lower tier", labels + ["tier"],
                                    registry=r)
        self.kv_tier_capacity = Gauge("splitserve_kv_tier_capacity_blocks", "KV blocks a lower tier can hold",
                                      labels + ["tier"], registry=r)
        self.kv_tier_bytes = Counter("splitserve_kv_tier_bytes", "KV bytes moved between tiers, per path "
                                     "(g1_to_g2 offload, g2_to_g1 onboard, g2_to_g3 disk write, g3_to_g2 disk read)",
                                     labels + ["path"], registry=r)
        self.kv_tier_seconds = Counter("splitserve_kv_tier_seconds", "Seconds spent moving KV between tiers, "
                                       "per path", labels + ["path"], registry=r)
        self.kv_tier_errors = Counter("splitserve_kv_tier_errors", "KV tier failures by reason (damaged or "
                                      "truncated blocks, disk full, I/O errors, failed copies)",
                                      labels + ["reason"], registry=r)
        self._seen: dict[tuple, float] = {}

    def _advance(self, counter: Counter, key: tuple, total: float) -> None:
        """Move a counter up to an engine running total (sampled: inc by the difference)."""
        delta = total - self._seen.get((counter, key), 0)
        if delta > 0:
            counter.labels(*key).inc(delta)
            self._seen[(counter, key)] = total

    def observe(self, stats) -> None:
        w = self.worker_id
        self._advance(self.kv_hits, (w, "device"), getattr(stats, "num_gpu_hit_blocks", 0))
        t = getattr(stats, "tiers", None)
        if t is not None:
            for tier, name in ((2, "host"), (3, "disk")):
                if tier in t.capacity_blocks:
                    self._advance(self.kv_hits, (w, name), t.loaded_blocks.get(tier, 0))
                    self._advance(self.kv_tier_recomputed, (w, name), t.recomputed_blocks.get(tier, 0))
                    self.kv_tier_blocks.labels(w, name).set(t.blocks[tier])
                    self.kv_tier_capacity.labels(w, name).set(t.capacity_blocks[tier])
            for path, nbytes in t.path_bytes.items():
                self._advance(self.kv_tier_bytes, (w, path.value), nbytes)
                self._advance(self.kv_tier_seconds, (w, path.value), t.path_seconds[path])
            for reason, n in t.errors.items():
                self._advance(self.kv_tier_errors, (w, getattr(reason, "value", str(reason))), n)
            self._advance(self.kv_tier_errors, (w, "copy_failed"), getattr(stats, "tier_copy_errors", 0))
        self.blocks_free.labels(w).set(stats.num_free_blocks)
        self.blocks_used.labels(w).set(stats.num_total_blocks - stats.num_free_blocks)
        self.running.labels(w).set(stats.num_running)
        self.waiting.labels(w).set(stats.num_waiting)
        self.preemptions.labels(w).set(stats.num_preemptions)
        self.prefix_hit_tokens.labels(w).set(stats.num_prefix_hit_tokens)
        self.deadline_deferred.labels(w).set(getattr(stats, "num_deadline_deferred", 0))


class FrontendMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("splitserve_requests", "Finished requests", ["api", "finish_reason"], registry=r)
        self.errors = Counter("splitserve_request_errors", "Rejected or failed requests", ["api", "code"],
                              registry=r)
        self.running = Gauge("splitserve_requests_running", "Requests in flight", registry=r)
        self.ttft = Histogram("splitserve_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS_S)
        self.itl = Histogram("splitserve_inter_token_latency_seconds", "Time between output chunks per token",
                             registry=r, buckets=LATENCY_BUCKETS_S)
        self.e2e = Histogram("splitserve_e2e_request_latency_seconds", "Request latency", registry=r,
                             buckets=LATENCY_BUCKETS_S)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("splitserve_prompt_cached_tokens", "Prompt tokens from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Generated tokens", registry=r)
        self.prefill_remote = Counter("splitserve_prefill_remote", "Prompts sent to a prefill worker", registry=r)
        self.prefill_held_for_itl = Counter(
            "splitserve_prefill_held_for_itl", "Prompts sent to a saturated prefill worker because computing "
            "them on their decode worker would break --itl-target-ms", registry=r)
        self.prefill_local = Counter("splitserve_prefill_local", "Prompts prefilled on their decode worker, by "
                                     "reason", ["reason"], registry=r)
        self.migrations = Counter("splitserve_request_migrations", "Requests moved to another worker, by "
                                  "reason: worker_lost (it died) | drain (it was draining)", ["reason"], registry=r)
        self.shutdown_errors = Counter("splitserve_requests_ended_by_shutdown", "Requests ended with an error "
                                       "because the frontend stopped before they finished", registry=r)


class PoolMetrics:
    """The pool controller's (serve's, or the planner's): what each pool should have and has."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        pool = ["pool"]
        self.desired = Gauge("splitserve_pool_desired_workers", "Workers the pool should have", pool, registry=r)
        self.ready = Gauge("splitserve_pool_ready_workers", "Workers of the pool taking requests", pool, registry=r)
        self.starting = Gauge("splitserve_pool_starting_workers", "Workers of the pool starting (or waiting to be "
                              "restarted)", pool, registry=r)
        self.draining = Gauge("splitserve_pool_draining_workers", "Workers of the pool draining", pool, registry=r)
        self.failed = Gauge("splitserve_pool_failed_workers", "Workers of the pool left stopped after a crash "
                            "loop", pool, registry=r)
        self.degraded = Gauge("splitserve_pool_degraded", "1 while the pool has fewer ready workers than desired",
                              pool, registry=r)
        self.restarts = Counter("splitserve_worker_restarts", "Workers restarted after they crashed", pool, registry=r)
        self.crash_loops = Counter("splitserve_worker_crash_loops", "Workers not restarted any more (crash loop)",
                                   pool, registry=r)
        self.component_restarts = Counter("splitserve_component_restarts", "serve's own children restarted after "
                                          "they died", ["component"], registry=r)


class PlannerMetrics:
    """The SLA planner's (planner/live.py): each decision, and what it planned on. `registry`: share
    the pool controller's (under `serve`), or its own (`splitserve planner`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.decisions = Counter("splitserve_planner_decisions", "Planner decisions per pool, by direction: "
                                 "up | down | hold (desired against ready + starting)", ["pool", "direction"],
                                 registry=r)
        self.estimate = Gauge("splitserve_planner_estimate", "What the last decision planned on and predicted "
                              "(rate_rps, plan_rate_rps, prefix_hit_rate, POOL_desired, POOL_required, "
                              "POOL_correction, POOL_predicted, ...)", ["name"], registry=r)


def observe_many(hist, values_s: list[float]) -> None:
    """`hist.observe(v)` for every v, in one pass: one increment per bucket that got samples
    instead of several per sample (the frontend's ITL samples, one per token, come in batches).
    Reaches into prometheus_client's Histogram (non-cumulative per-bucket counters, a sum)."""
    if not values_s:
        return
    bounds = hist._upper_bounds
    counts = [0] * len(bounds)
    for v in values_s:
        counts[bisect_left(bounds, v)] += 1
    for bucket, n in zip(hist._buckets, counts):
        if n:
            bucket.inc(n)
    hist._sum.inc(sum(values_s))
