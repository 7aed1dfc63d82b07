"""`TpGroup.on_every_rank`, which every custom all-reduce is built through: kept where every rank
built it, None on every rank where one could not (a rank that kept its own would wait in a kernel
its peer never launches), and what a rank built is closed when another rank failed. Two real
processes over gloo."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from engine.parallel.group import TpGroup
from runtime.net import free_port


class Built:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _rank(rank: int, store: str, fail_on: int, out) -> None:
    tp = TpGroup.join(rank, 2, store, torch.device("cpu"))
    made: list[Built] = []

    def build() -> Built:
        if rank == fail_on:
            raise RuntimeError("no IPC here")
        made.append(Built())
        return made[-1]
    got = tp.on_every_rank(build, "a test all-reduce")
    out.put((rank, got is not None, [b.closed for b in made]))
    tp.close()


def run(fail_on: int) -> dict[int, tuple[bool, list[bool]]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, store, fail_on, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (kept, closed)) for r, kept, closed in (out.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def test_every_rank_keeps_what_every_rank_built():
    assert run(fail_on=-1) == {0: (True, [False]), 1: (True, [False])}


def test_one_rank_failing_leaves_none_on_any_rank_and_closes_what_the_others_built():
    assert run(fail_on=1) == {0: (False, [True]), 1: (False, [])}
