"""A disaggregated request is routed twice: to its decode worker, then to the prefill worker that
computes its prompt. Once its first token is out it decodes on the first, and the router counts it
there (the KV policy weighs a worker's decodes), not on the prefill worker, however the prefill
half ended."""

from __future__ import annotations

from collections import Counter

from kvstore.hashing import block_hashes
from router import Router, RouterConfig, WorkerRole
from router.queues import PrefillQueues

BS = 16


def prompt(seed: int, n: int = 256) -> tuple[list[int], int]:
    toks = [(seed * 7919 + i) % 4096 for i in range(n)]
    return block_hashes(toks, BS), len(toks)


def disaggregated_fleet(seed: int = 0) -> Router:
    r = Router(RouterConfig(), block_size=BS, seed=seed)
    for w in ("d0", "d1"):
        r.add_worker(w, WorkerRole.DECODE)
    r.add_worker("p0", WorkerRole.PREFILL)
    return r


def test_decodes_of_disaggregated_requests_steer_new_requests_away_from_their_decode_worker():
    r = disaggregated_fleet()
    for i in range(8):                      # eight streams decode on d0, their prompts computed on p0
        hs, n = prompt(i)
        assert r.route(f"s{i}", hs, n, WorkerRole.DECODE, exclude={"d1"}).worker_id == "d0"
        assert r.route(f"s{i}", hs, n, WorkerRole.PREFILL).worker_id == "p0"
        r.first_token(f"s{i}")
    picks = Counter()
    for i in range(20):
        hs, n = prompt(100 + i)
        picks[r.route(f"new{i}", hs, n, WorkerRole.DECODE).worker_id] += 1
        r.finished(f"new{i}")
    assert picks == {"d1": 20}, picks
    for i in range(8):                      # they end: the fleet is even again
        r.finished(f"s{i}")
    picks.clear()
    for i in range(40):
        hs, n = prompt(200 + i)
        picks[r.route(f"late{i}", hs, n, WorkerRole.DECODE).worker_id] += 1
        r.finished(f"late{i}")
    assert picks["d0"] > 0 and picks["d1"] > 0, picks


def routed_twice(*others: str, cached: int = 0) -> PrefillQueues:
    """Queues of d0, p0 and `others`, with request "r" routed to decode worker d0 (0.2 s of prefill
    there, `cached` tokens) and then to prefill worker p0 (0.1 s)."""
    q = PrefillQueues(clock=lambda: 0.0)
    for w in ("d0", "p0", *others):
        q.add_worker(w)
    q.route("r", "d0", 0.2, cached)
    q.route("r", "p0", 0.1, 0)
    return q


def test_the_decode_count_lands_on_the_decode_worker_and_leaves_with_the_request():
    q = routed_twice()
    assert q.busy_until[q.row["d0"]] == 0.0 and q.busy_until[q.row["p0"]] == 0.1
    q.first_token("r")
    assert q.decoding[q.row["d0"]] == 1 and q.decoding[q.row["p0"]] == 0
    q.finished("r", "p0")                   # the prefill half's release changes no decode count
    assert q.decoding[q.row["d0"]] == 1
    q.finished("r")
    assert q.decoding_total == 0 and not q.decoding.any()


def test_a_prefill_half_released_before_the_first_token_still_decodes_on_its_decode_worker():
    """The simulator releases the prefill worker when the prompt is computed (the KV lands later);
    the frontend, when the prefill pool is saturated and the decode worker computes the prompt."""
    q = routed_twice(cached=32)
    q.finished("r", "p0")
    assert q.queued("p0") == 0 and q.busy_until[q.row["p0"]] == 0.0
    q.first_token("r")
    assert q.decoding[q.row["d0"]] == 1 and q.decoding[q.row["p0"]] == 0
    q.finished("r")
    assert q.decoding_total == 0


def test_a_decode_worker_that_lets_a_queued_request_go_takes_it_off_every_queue():
    q = routed_twice("d1")
    q.finished("r", "d0")                   # d0 was lost: the request is routed anew
    assert not q.is_queued("r") and q.queued("p0") == 0
    q.route("r", "d1", 0.2, 0)
    q.route("r", "p0", 0.1, 0)
    q.first_token("r")
    assert q.decoding[q.row["d1"]] == 1 and q.decoding_total == 1


def test_a_decode_worker_removed_meanwhile_counts_nothing():
    q = routed_twice()
    q.remove_worker("d0")
    q.first_token("r")
    assert q.decoding_total == 0
    q.finished("r")
    assert q.decoding_total == 0
