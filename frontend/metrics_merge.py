"""One scrape sees the whole cluster: the frontend's /metrics also carries every worker's samples,
and the pool controller's (desired and ready workers per pool, restarts: `splitserve serve`'s, whose
address comes from its record in Redis, runtime/pool_record.py), and the SLA planner's when the
record names it (`serve --ray --planner` runs the planner as an actor with its own /metrics).

Each worker serves its own /metrics (as pods are scraped in Kubernetes); their samples already
carry a `worker` label. The frontend fetches them concurrently (short timeout; a slow or dead
worker is skipped) and merges families of the same name, so the exposition stays valid.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry


class _Families(Collector):
    def __init__(self, families) -> None:
        self._families = families

    def collect(self):
        return self._families


class WorkerMetricsScraper:
    def __init__(self, pool, timeout_s: float = 1.0) -> None:
        self._pool = pool
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def scrape(self) -> bytes:
        urls = [c.info.metrics_url for c in self._pool.workers.values() if c.alive and c.info.metrics_url]
        pools = self._pool.pools
        if pools is not None:
            urls += [u for u in (pools.metrics_url, pools.planner_metrics_url) if u]
        if not urls:
            return b""
        texts = await asyncio.gather(*(self._fetch(u) for u in urls))
        merged: dict[str, object] = {}
        for text in texts:
            if not text:
                continue
            for fam in text_string_to_metric_families(text):
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        registry = CollectorRegistry()
        registry.register(_Families(list(merged.values())))
        return generate_latest(registry)

    async def _fetch(self, url: str) -> str:
        try:
            r = await self._client.get(url)
            return r.text if r.status_code == 200 else ""
        except httpx.HTTPError:
            return ""
