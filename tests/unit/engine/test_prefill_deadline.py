"""A prefill worker's deadline order (engine/sched/order.py, Scheduler.order.deadline_s): the real Engine around the mock
runner, with real waits. Prompts that can no longer meet the TTFT target go behind those that can,
each group in arrival order; without a target the queue stays in arrival order."""

from __future__ import annotations

import dataclasses
import time

import pytest

from engine.engine import Engine
from runtime.config import EngineConfig, FrontendConfig, ServeConfig, ServePlannerConfig
from runtime.types import EngineRequest, RequestId, SamplingParams
from splitserve.models import resolve_model
from splitserve.serve import worker_config


@pytest.fixture(scope="module")
def model_dir() -> str:
    return resolve_model("tiny")


def first_token_order(deadline_s: float | None, model_dir: str) -> tuple[list[str], Engine]:
    # one prompt a step (100 tokens, a budget of 128), so the order of first tokens is the queue's
    engine = Engine(EngineConfig(model=model_dir, mock=True, max_num_batched_tokens=128, num_blocks=256,
                                 async_scheduling=False))
    engine.scheduler.order.deadline_s = deadline_s

    def add(name: str) -> None:
        engine.add_request(EngineRequest(RequestId(name), [11 + (hash(name) + j) % 3000 for j in range(100)],
                                         SamplingParams(max_tokens=1)))

    for name in ("old0", "old1", "old2"):
        add(name)
    time.sleep(0.6)                  # the first three are now older than a 0.5 s target
    for name in ("new0", "new1", "new2"):
        add(name)
    order: list[str] = []
    while engine.has_work:
        order += [o.request_id for o in engine.step().outputs if o.request_id not in order]
    return order, engine


def test_prompts_past_saving_wait_behind_those_that_can_still_make_it(model_dir):
    order, engine = first_token_order(0.5, model_dir)
    assert order == ["new0", "new1", "new2", "old0", "old1", "old2"]
    assert engine.scheduler.order.num_deferred == 3


def test_without_a_deadline_the_queue_keeps_arrival_order(model_dir):
    order, engine = first_token_order(None, model_dir)
    assert order == ["old0", "old1", "old2", "new0", "new1", "new2"]
    assert engine.scheduler.order.num_deferred == 0


def test_all_late_or_all_on_time_keeps_arrival_order(model_dir):
    order, _ = first_token_order(30.0, model_dir)                  # every prompt can make 30 s
    assert order == ["old0", "old1", "old2", "new0", "new1", "new2"]


def test_serve_gives_prefill_workers_the_planner_s_ttft_target(model_dir):
    cfg = ServeConfig(engine=EngineConfig(model="tiny"), frontend=FrontendConfig(model="tiny"))
    assert worker_config(cfg, model_dir, "prefill", 0).prefill_deadline_ms is None     # no planner, no target
    planned = dataclasses.replace(cfg, planner=ServePlannerConfig(enabled=True, ttft_ms=750.0))
    assert worker_config(planned, model_dir, "prefill", 0).prefill_deadline_ms == 750.0
    assert worker_config(planned, model_dir, "decode", 0).prefill_deadline_ms is None
    # a planner told to size for FIFO prefill workers gets FIFO ones
    fifo = dataclasses.replace(cfg, planner=ServePlannerConfig(enabled=True, ttft_ms=750.0, prefill_order="fifo"))
    assert worker_config(fifo, model_dir, "prefill", 0).prefill_deadline_ms is None
