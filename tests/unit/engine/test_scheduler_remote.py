"""Decode-side admission of remote prefills (engine/scheduler.py `_admit`).

A request whose prompt a prefill worker computes takes no step budget here: the scheduler only
reserves its blocks and hands the reservation to the worker, which sends the Prefill RPC. These
tests pin down that a remote prefill queued behind local prompts is reserved in the same step,
not after their chunked prefills have used up the budget step after step (which kept the prefill
worker idle while the decode worker computed local prompts), and that blocks are still taken in
arrival order.
"""

from __future__ import annotations

from engine.request import Request
from engine.scheduler import Scheduler
from kvstore.pools.block_pool import BlockPool
from runtime.types import EngineRequest, RequestId, SamplingParams

BS = 16


def make(num_blocks: int = 1000, budget: int = 64) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), BS, max_model_len=4096, max_num_seqs=256,
                     max_num_batched_tokens=budget)


def add(s: Scheduler, rid: str, n: int, remote: bool = False, first: int = 0) -> None:
    prompt = [first + i % 500 + 1 for i in range(n)]
    s.add(Request.of(EngineRequest(RequestId(rid), prompt, SamplingParams(max_tokens=4), remote_prefill=remote)))


def reserved(s: Scheduler) -> list[str]:
    return [r.request_id for r in s.remote.take_reservations()]


def test_remote_prefill_behind_a_local_prompt_is_reserved_in_the_same_step():
    s = make(budget=64)
    add(s, "local", 200)                 # needs 4 steps of 64 tokens
    add(s, "remote-1", 100, remote=True, first=1000)
    add(s, "remote-2", 300, remote=True, first=2000)
    plan = s.schedule()
    assert [(r.request_id, r.num_tokens) for r in plan.rows] == [("local", 64)]
    assert reserved(s) == ["remote-1", "remote-2"]
    assert set(s.remote.awaiting_kv) == {"remote-1", "remote-2"}
    assert [r.request_id for r in s.waiting] == []


def test_local_prompts_keep_their_order_and_wait_for_budget():
    s = make(budget=64)
    add(s, "local-1", 200)
    add(s, "local-2", 100, first=1000)
    add(s, "remote", 100, remote=True, first=2000)
    add(s, "local-3", 50, first=3000)
    s.schedule()
    assert reserved(s) == ["remote"]
    assert [r.request_id for r in s.waiting] == ["local-2", "local-3"]   # still queued, in order
    assert [r.request_id for r in s.running] == ["local-1"]


def test_remote_prefill_before_local_prompts_takes_no_budget():
    s = make(budget=64)
    add(s, "remote", 100, remote=True)
    add(s, "local", 64, first=1000)
    plan = s.schedule()
    assert reserved(s) == ["remote"]
    assert [(r.request_id, r.num_tokens) for r in plan.rows] == [("local", 64)]


def test_blocks_are_still_taken_in_order():
    # 20 blocks: the local prompt's first chunk takes 4, the first remote one needs 19 (> 16 left):
    # its reservation fails and the smaller remote prefill behind it is not reserved ahead of it
    s = make(num_blocks=20, budget=64)
    add(s, "local", 200)
    add(s, "remote-big", 300, remote=True, first=1000)
    add(s, "remote-small", 32, remote=True, first=2000)
    s.schedule()
    assert reserved(s) == []
    assert [r.request_id for r in s.waiting] == ["remote-big", "remote-small"]


def test_aggregated_worker_admission_unchanged():
    s = make(budget=64)
    for i in range(3):
        add(s, f"r{i}", 100, first=1000 * i)
    plan = s.schedule()
    assert [(r.request_id, r.num_tokens) for r in plan.rows] == [("r0", 64)]
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]
    assert reserved(s) == []


def test_requests_awaiting_their_kv_count_against_max_num_seqs():
    # a decode-only step past max_num_seqs overflows the decode kernel's fixed buffers (sized for
    # max_num_seqs rows): a request whose KV is in flight holds one of those seats already
    s = Scheduler(BlockPool(1000), BS, max_model_len=4096, max_num_seqs=3, max_num_batched_tokens=64)
    add(s, "local", 32)
    for i in range(4):
        add(s, f"remote-{i}", 32, remote=True, first=1000 * (i + 1))
    s.schedule()
    assert reserved(s) == ["remote-0", "remote-1"]             # 1 running + 2 awaiting = 3 seats
    assert [r.request_id for r in s.waiting] == ["remote-2", "remote-3"]
    for i in range(2):
        s.kv_arrived(f"remote-{i}", 7)
    assert len(s.running) == 3
    plan = s.schedule()
    assert len(plan.rows) <= 3 and reserved(s) == []
