"""The engine thread: a failing step ends its requests as a server error, frees their blocks, and
the loop keeps serving."""

from __future__ import annotations

import threading
import time

from engine.engine import Engine, EngineLoop
from runtime.types import EngineRequest, FinishReason, SamplingParams
from runtime.config import EngineConfig
from splitserve.models import resolve_model


def test_a_failing_step_is_an_internal_error_and_the_loop_keeps_serving():
    engine = Engine(EngineConfig(model=resolve_model("tiny"), num_blocks=64))
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return real_execute(plan)

    engine.runner.execute = flaky
    outputs, done = [], threading.Event()

    def on_outputs(outs):
        outputs.extend(outs)
        if any(o.request_id == "b" and o.finish_reason is not None for o in outs):
            done.set()

    loop = EngineLoop(engine, on_outputs)
    loop.start()
    try:
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        loop.submit(EngineRequest("a", [5, 6, 7, 8], greedy))
        for _ in range(100):
            if any(o.request_id == "a" for o in outputs):
                break
            done.wait(0.05)
        first = [o for o in outputs if o.request_id == "a"]
        assert first and first[-1].finish_reason == FinishReason.ERROR and first[-1].internal_error
        loop.submit(EngineRequest("b", [5, 6, 7, 8], greedy))
        assert done.wait(30)
        b = [t for o in outputs if o.request_id == "b" for t in o.new_token_ids]
        assert len(b) == 4
        assert loop.call(lambda e: e.pool.num_free).result(5) == 64
    finally:
        loop.stop()


def test_a_duplicate_request_id_is_refused_and_a_failing_command_never_ends_the_loop():
    engine = Engine(EngineConfig(model=resolve_model("tiny"), num_blocks=64))
    outputs, done = [], threading.Event()

    def on_outputs(outs):
        outputs.extend(outs)
        if any(o.request_id == "c" and o.finish_reason is not None for o in outs):
            done.set()

    loop = EngineLoop(engine, on_outputs)
    loop.start()
    try:
        slow = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        loop.submit(EngineRequest("a", [5, 6, 7, 8], slow))
        loop.submit(EngineRequest("a", [9, 10], slow))            # the same id while the first runs
        loop.call(lambda e: 1 / 0)                               # returned to the caller
        loop._inbox.put(object())                                # not a command: logged, skipped
        loop.submit(EngineRequest("c", [5, 6], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
        assert done.wait(30)
        a = [o for o in outputs if o.request_id == "a"]
        refused = [o for o in a if o.finish_reason == FinishReason.ERROR]
        assert len(refused) == 1 and "already running" in refused[0].error and not refused[0].new_token_ids
        for _ in range(600):
            if any(o.request_id == "a" and o.finish_reason == FinishReason.LENGTH for o in outputs):
                break
            time.sleep(0.05)
        assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "a") == 32, [o for o in outputs if o.request_id == "a"]
    finally:
        loop.stop()


def test_the_stats_read_with_a_last_output_say_idle():
    """A worker pushes its load to the frontends as it delivers outputs, reading the loop's stats:
    with a request's last tokens they say the engine is idle (read before the refresh, they still
    counted the request running, and the frontends routed around that stale load)."""
    engine = Engine(EngineConfig(model=resolve_model("tiny"), num_blocks=64))
    seen, done = [], threading.Event()
    loop = None

    def on_outputs(outs):
        seen.append((loop.stats.num_running, loop.stats.num_decoding))
        if any(o.finish_reason is not None for o in outs):
            done.set()

    loop = EngineLoop(engine, on_outputs)
    loop.start()
    try:
        loop.submit(EngineRequest("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
        assert done.wait(30)
        assert seen[-1] == (0, 0), seen[-3:]
        assert any(running for running, _ in seen)       # while it ran, the stats said so
    finally:
        loop.stop()
