"""Several routers (one per frontend process) over one fleet: each counts the decodes the others
sent, from the workers' own decoding counts, and never its own twice."""

from __future__ import annotations

from collections import Counter

from kvstore.hashing import block_hashes
from router import Router, RouterConfig, WorkerRole

BS = 16


def make_router(seed: int) -> Router:
    r = Router(RouterConfig(), block_size=BS, seed=seed)
    for w in ("w0", "w1"):
        r.add_worker(w, WorkerRole.DECODE)
    return r


def prompt(seed: int) -> tuple[list[int], int]:
    toks = [(seed * 7919 + i) % 4096 for i in range(256)]
    return block_hashes(toks, BS), len(toks)


def decode_on(r: Router, worker: str, n: int, tag: str) -> None:
    """`n` requests routed by `r` that are decoding on `worker` (first token out)."""
    other = "w1" if worker == "w0" else "w0"
    for i in range(n):
        rid = f"{tag}-{i}"
        hs, n_tok = prompt(hash(rid) % 1000)
        d = r.route(rid, hs, n_tok, WorkerRole.DECODE, exclude={other})
        assert d.worker_id == worker
        r.first_token(rid)


def test_a_router_avoids_the_worker_another_router_loaded_once_the_worker_reports_it():
    a, b = make_router(1), make_router(2)
    decode_on(a, "w0", 6, "a")                     # frontend A's six streams decode on w0
    picks = Counter()
    for i in range(20):                             # B alone sees an idle fleet: a coin toss
        hs, n = prompt(100 + i)
        picks[b.route(f"probe-{i}", hs, n, WorkerRole.DECODE).worker_id] += 1
        b.finished(f"probe-{i}")
    assert picks["w0"] > 0
    b.update_worker_load("w0", 0, 0, num_decoding=6)   # w0 reports what it decodes
    b.update_worker_load("w1", 0, 0, num_decoding=0)
    for i in range(20):
        hs, n = prompt(200 + i)
        assert b.route(f"after-{i}", hs, n, WorkerRole.DECODE).worker_id == "w1"
        b.finished(f"after-{i}")


def test_a_router_never_counts_its_own_decodes_or_queued_prompts_as_the_others():
    a = make_router(1)
    decode_on(a, "w0", 4, "mine")
    hs, n = prompt(999)
    a.route("queued", hs, n, WorkerRole.DECODE, exclude={"w1"})    # routed, no first token yet
    # the worker counts the queued prompt as decoding a step before its first token reaches us
    a.update_worker_load("w0", 0, 0, num_decoding=5)
    q = a._queues                                                  # noqa: SLF001 (the counts under test)
    assert int(q.others[q.row["w0"]]) == 0
    a.update_worker_load("w0", 0, 0, num_decoding=8)              # 3 more from other frontends
    assert int(q.others[q.row["w0"]]) == 3
    assert list(q.decodes()[[q.row["w0"], q.row["w1"]]]) == [7, 0]
