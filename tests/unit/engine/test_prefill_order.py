"""The prefill queue's order on its own (engine/sched/order.py), on a clock the test sets: which
prompts go behind, in what order, and what is never moved. The engine around it is in
test_prefill_deadline.py."""

from __future__ import annotations

from collections import deque

from engine.request import Request
from engine.sched.order import PrefillOrder
from runtime.types import SamplingParams

PACE = 1000.0                   # tokens per second: a 100-token prompt computes in 0.1 s


def prompt(name: str, added_at: float, num_tokens: int = 100) -> Request:
    req = Request.new(name, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=1))
    req.timing.added_at = added_at
    return req


def names(q: deque[Request]) -> list[str]:
    return [r.request_id for r in q]


def test_prompts_past_saving_go_behind_in_arrival_order_and_are_counted_once():
    order = PrefillOrder(deadline_s=0.5)
    q = deque([prompt("old0", 0.0), prompt("new0", 0.9), prompt("old1", 0.1), prompt("new1", 0.95)])
    order.arrange(q, PACE, now=1.0)             # old*: 1.0 (+0.1 compute) past 0.5; new*: 0.2 at most
    assert names(q) == ["new0", "new1", "old0", "old1"]
    assert order.num_deferred == 2 and q[2].timing.deadline_late
    order.arrange(q, PACE, now=1.01)
    assert names(q) == ["new0", "new1", "old0", "old1"] and order.num_deferred == 2


def test_the_compute_at_the_measured_pace_counts_against_the_deadline():
    q = deque([prompt("long", 0.9, num_tokens=600), prompt("short", 0.9)])
    PrefillOrder(deadline_s=0.5).arrange(q, PACE, now=1.0)      # 0.1 + 0.6 s > 0.5; 0.1 + 0.1 fits
    assert names(q) == ["short", "long"]
    q = deque([prompt("long", 0.9, num_tokens=600), prompt("short", 0.9)])
    PrefillOrder(deadline_s=0.5).arrange(q, 10 * PACE, now=1.0)     # ten times faster: both fit
    assert names(q) == ["long", "short"]


def test_all_late_or_none_late_leaves_the_queue_and_the_count_alone():
    order = PrefillOrder(deadline_s=0.5)
    late = deque([prompt("a", 0.0), prompt("b", 0.1)])
    order.arrange(late, PACE, now=5.0)
    on_time = deque([prompt("c", 4.9), prompt("d", 4.95)])
    order.arrange(on_time, PACE, now=5.0)
    assert names(late) == ["a", "b"] and names(on_time) == ["c", "d"] and order.num_deferred == 0


def test_requests_admitted_before_keep_their_place_however_old():
    preempted, onboarded, remote = prompt("preempted", 0.0), prompt("onboarded", 0.0), prompt("remote", 0.0)
    preempted.num_cached_tokens = 0             # admitted once already
    onboarded.tier.ready = True                 # its loaded prefix waits for it at the head
    remote.remote_prefill = True                # a decode worker's: takes no prefill time here
    q = deque([preempted, onboarded, remote, prompt("late", 0.0), prompt("fresh", 4.9)])
    PrefillOrder(deadline_s=0.5).arrange(q, PACE, now=5.0)
    assert names(q) == ["preempted", "onboarded", "remote", "fresh", "late"]
