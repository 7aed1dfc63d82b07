"""PrefixIndex: prefix semantics, ordering of event batches, gaps, resync, worker loss."""

from __future__ import annotations

import random

import pytest

from kvstore.events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, Tier
from kvstore.hashing import block_hashes
from router.index import PrefixIndex


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def stored(*hashes: int, tier: Tier = Tier.GPU, parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tier)


def chain(text: str) -> list[int]:
    """Chained hashes of a prompt whose blocks are its letters (one-token blocks)."""
    return block_hashes([ord(c) for c in text], 1)


def test_overlap_counts_leading_blocks_and_a_hole_ends_the_run():
    idx = PrefixIndex()
    a, b, c, d = chain("abcd")
    idx.apply(KvEventBatch("a", 1, [stored(a, b, c, d)]))
    idx.apply(KvEventBatch("b", 1, [stored(a, b), stored(d, parent=c)]))    # lacks block c
    idx.apply(KvEventBatch("c", 1, [stored(b, c, d, parent=a)]))            # lacks the first block
    assert idx.overlaps([a, b, c, d]) == {"a": 4, "b": 2}
    assert idx.overlaps(chain("abx")) == {"a": 2, "b": 2}
    assert idx.overlaps(chain("x")) == {}
    assert idx.overlaps([]) == {}


def test_a_block_stored_again_reconnects_the_chain_below_it_and_a_removed_one_cuts_it():
    idx = PrefixIndex()
    h = chain("abcdefgh")
    idx.store("w", h)
    assert idx.overlaps(h) == {"w": 8}
    idx.remove("w", [h[2]])                  # a hole in the middle: the run stops before it
    assert idx.overlaps(h) == {"w": 2}
    idx.remove("w", [h[0]])
    assert idx.overlaps(h) == {}
    idx.store("w", h[:1])                    # the head comes back: still cut at the hole
    assert idx.overlaps(h) == {"w": 2}
    idx.store("w", [h[2]], parent=h[1])      # the hole is filled: the tail it held counts again
    assert idx.overlaps(h) == {"w": 8}
    assert idx.overlaps(h[:5]) == {"w": 5}


def test_runs_of_many_workers_are_found_at_every_length():
    idx = PrefixIndex()
    h = chain("abcdefghijklmnopqrstuvwxyz" * 4)
    for n in range(1, len(h) + 1):
        idx.store(f"w{n}", h[:n])
    assert idx.overlaps(h) == {f"w{n}": n for n in range(1, len(h) + 1)}
    assert idx.overlaps(h[:7]) == {f"w{n}": min(n, 7) for n in range(1, len(h) + 1)}


def test_lower_tiers_are_invisible_unless_asked_for():
    idx = PrefixIndex()
    idx.apply(KvEventBatch("a", 1, [stored(1, 2), stored(3, tier=Tier.HOST)]))
    assert idx.overlaps([1, 2, 3]) == {"a": 2}
    assert idx.overlaps([1, 2, 3], tiers=(Tier.GPU, Tier.HOST)) == {"a": 3}


def test_removed_and_cleared_blocks_stop_matching():
    idx = PrefixIndex()
    idx.apply(KvEventBatch("a", 1, [stored(1, 2, 3)]))
    idx.apply(KvEventBatch("a", 2, [BlockRemoved((2,))]))
    assert idx.overlaps([1, 2, 3]) == {"a": 1}
    idx.apply(KvEventBatch("a", 3, [AllCleared()]))
    assert idx.overlaps([1, 2, 3]) == {}
    assert idx.num_hashes() == 0


def test_duplicates_are_ignored_and_early_batches_wait_for_the_gap():
    idx = PrefixIndex()
    assert idx.apply(KvEventBatch("a", 1, [stored(1)])).applied_batches == 1
    assert idx.apply(KvEventBatch("a", 1, [stored(7)])).duplicate
    r = idx.apply(KvEventBatch("a", 3, [stored(3)]))
    assert r.buffered and not r.needs_resync
    assert idx.overlaps([1, 2, 3]) == {"a": 1}
    assert idx.apply(KvEventBatch("a", 2, [stored(2)])).applied_batches == 2
    assert idx.overlaps([1, 2, 3]) == {"a": 3}
    assert idx.worker_blocks("a") == {1, 2, 3}


def test_a_gap_that_outlives_the_buffer_limit_asks_for_resync():
    called: list[str] = []
    idx = PrefixIndex(gap_max_buffered=2, on_resync_needed=called.append)
    idx.apply(KvEventBatch("a", 1, [stored(1)]))
    for seq in (3, 4):
        assert not idx.apply(KvEventBatch("a", seq, [stored(seq)])).needs_resync
    assert idx.apply(KvEventBatch("a", 5, [stored(5)])).needs_resync
    assert called == ["a"] and idx.workers_needing_resync() == ["a"]


def test_a_gap_that_outlives_the_timeout_asks_for_resync_even_in_silence():
    clock = FakeClock()
    idx = PrefixIndex(gap_timeout_s=1.0, clock=clock)
    idx.apply(KvEventBatch("a", 2, [stored(2)]))
    clock.t = 0.5
    assert idx.check_gaps() == []
    clock.t = 1.6
    assert idx.check_gaps() == ["a"]
    assert idx.check_gaps() == []          # reported once
    assert idx.workers_needing_resync() == ["a"]


def test_snapshot_replaces_state_and_replays_newer_buffered_batches():
    idx = PrefixIndex(gap_max_buffered=1)
    idx.apply(KvEventBatch("a", 1, [stored(1, 2, 3)]))
    idx.apply(KvEventBatch("a", 3, [stored(30)]))
    idx.apply(KvEventBatch("a", 4, [stored(40)]))             # gap limit → needs resync
    idx.apply(KvEventBatch("a", 5, [BlockRemoved((20,))]))     # buffered while waiting
    assert idx.workers_needing_resync() == ["a"]
    # the worker's truth after batch 4: batch 2 removed 3 and stored 20
    idx.apply_snapshot("a", 4, [(Tier.GPU, [1, 2, 20, 30, 40])])
    assert idx.workers_needing_resync() == []
    assert idx.applied_seq("a") == 5
    assert idx.worker_blocks("a") == {1, 2, 30, 40}
    assert idx.apply(KvEventBatch("a", 6, [stored(3)])).applied_batches == 1


def test_removing_a_worker_forgets_it_and_frees_its_slot():
    idx = PrefixIndex()
    idx.apply(KvEventBatch("a", 1, [stored(1, 2)]))
    idx.apply(KvEventBatch("b", 1, [stored(1)]))
    idx.remove_worker("a")
    assert idx.overlaps([1, 2]) == {"b": 1}
    idx.apply(KvEventBatch("c", 1, [stored(1, 2)]))            # reuses a's slot
    assert idx.overlaps([1, 2]) == {"b": 1, "c": 2}
    assert idx.applied_seq("a") == 0


class _Tree:
    """24 chained blocks: block k's parent is a random earlier block or the root."""

    def __init__(self, rng: random.Random) -> None:
        self.parent: dict[int, int | None] = {1: None}
        for k in range(2, 25):
            self.parent[k] = rng.choice([None, *range(1, k)])

    def path(self, k: int) -> list[int]:
        out = []
        while k is not None:
            out.append(k)
            k = self.parent[k]
        return out[::-1]


class _Publisher:
    """The truth: one worker's block sets after each of its batches."""

    def __init__(self, worker_id: str, rng: random.Random, tree: _Tree) -> None:
        self.worker_id = worker_id
        self.rng = rng
        self.tree = tree
        self.history: list[dict[Tier, frozenset[int]]] = [{t: frozenset() for t in Tier}]

    @property
    def seq(self) -> int:
        return len(self.history) - 1

    def next_batch(self) -> KvEventBatch:
        rng = self.rng
        state = {t: set(s) for t, s in self.history[-1].items()}
        events = []
        for _ in range(rng.randint(1, 3)):
            tier = rng.choice([Tier.GPU, Tier.GPU, Tier.HOST])
            roll = rng.random()
            if roll < 0.6:                       # a run of a chain, from any depth
                path = self.tree.path(rng.randint(1, 24))
                start = rng.randrange(len(path))
                hs = tuple(path[start:start + rng.randint(1, 5)])
                events.append(BlockStored(hs, path[start - 1] if start else None, tier))
                state[tier].update(hs)
            elif roll < 0.95:                    # any blocks, in any order: holes and orphans
                pool = sorted(state[tier]) or [1]
                hs = tuple(rng.sample(pool, min(len(pool), rng.randint(1, 3))))
                events.append(BlockRemoved(hs, tier))
                state[tier].difference_update(hs)
            else:
                events.append(AllCleared(tier))
                state[tier].clear()
        self.history.append({t: frozenset(s) for t, s in state.items()})
        return KvEventBatch(self.worker_id, self.seq, events)

    def snapshot(self) -> tuple[int, list[tuple[Tier, list[tuple[int, int | None]]]]]:
        return self.seq, [(t, [(h, self.tree.parent[h]) for h in sorted(s)])
                          for t, s in self.history[-1].items()]


def _leading(held: frozenset[int], prompt: list[int]) -> int:
    n = 0
    for h in prompt:
        if h not in held:
            break
        n += 1
    return n


def _check_tables(idx: PrefixIndex) -> None:
    """The chain structure's own bookkeeping agrees with the workers' sets: each hash's count of
    orphan holders, and parents kept only for hashes someone holds."""
    chains = idx._chains                                                     # noqa: SLF001
    held: set[int] = set()
    orphans: dict[int, int] = {}
    for wid in idx.workers():
        w = idx._workers[wid].held                                           # noqa: SLF001
        for tier in Tier:
            held |= w.blocks[tier]
            loose = [h for h in w.blocks[tier] if not chains._chain[tier].get(h, 0) & w.bit]  # noqa: SLF001
            assert w.orphans[tier] == len(loose)
            for h in loose:
                orphans[h] = orphans.get(h, 0) + 1
    assert chains._orphan_refs == orphans                                    # noqa: SLF001
    assert set(chains._parent) <= held                                       # noqa: SLF001
    assert idx.num_hashes() == len(held)


@pytest.mark.parametrize("seed", range(8))
def test_index_matches_a_brute_force_model_under_loss_duplication_reordering_and_worker_loss(seed):
    rng = random.Random(seed)
    clock = FakeClock()
    idx = PrefixIndex(gap_max_buffered=6, gap_timeout_s=2.0, clock=clock)
    pubs: dict[str, _Publisher] = {}
    tree = _Tree(rng)
    next_id = 0
    in_flight: list[tuple[float, KvEventBatch]] = []
    for step in range(600):
        clock.t += 0.1
        if len(pubs) < 5 or rng.random() < 0.01:
            pubs[f"w{next_id}"] = _Publisher(f"w{next_id}", rng, tree)
            next_id += 1
        if len(pubs) > 1 and rng.random() < 0.01:   # lease expiry: the worker and its traffic vanish
            gone = rng.choice(sorted(pubs))
            del pubs[gone]
            idx.remove_worker(gone)
            in_flight = [(t, b) for t, b in in_flight if b.worker_id != gone]
        pub = pubs[rng.choice(sorted(pubs))]
        batch = pub.next_batch()
        roll = rng.random()
        copies = 0 if roll < 0.05 else 2 if roll < 0.10 else 1
        for _ in range(copies):
            in_flight.append((clock.t + rng.expovariate(1 / 0.3), batch))
        due = [x for x in in_flight if x[0] <= clock.t]
        in_flight = [x for x in in_flight if x[0] > clock.t]
        rng.shuffle(due)
        for _, b in due:
            idx.apply(b)
        idx.check_gaps()
        for wid in idx.workers_needing_resync():
            if rng.random() < 0.5:               # resyncs take a while to come back
                idx.apply_snapshot(wid, *pubs[wid].snapshot())
        # Invariant: the index holds exactly the worker's state after the batch it has applied.
        for wid, p in pubs.items():
            seq = idx.applied_seq(wid)
            for tier in Tier:
                assert idx.worker_blocks(wid, tier) == p.history[seq][tier], (step, wid, seq)
        _check_tables(idx)
        prompt = tree.path(rng.randint(1, 24))
        for tiers in ((Tier.GPU,), (Tier.GPU, Tier.HOST)):
            expect = {wid: n for wid, p in pubs.items()
                      if (n := _leading(frozenset().union(*(p.history[idx.applied_seq(wid)][t] for t in tiers)),
                                        prompt))}
            assert idx.overlaps(prompt, tiers) == expect, (step, tiers)
    # Quiesce: deliver everything, let gaps time out, resync: the index converges to the truth.
    for _, b in in_flight:
        idx.apply(b)
    for p in pubs.values():    # a lost last batch is only noticed when the next one comes
        idx.apply(p.next_batch())
    clock.t += 10
    idx.check_gaps()
    for wid in idx.workers_needing_resync():
        idx.apply_snapshot(wid, *pubs[wid].snapshot())
    assert set(idx.workers()) <= set(pubs)      # removed workers are gone for good
    _check_tables(idx)
    for wid in idx.workers():                   # (a worker whose every batch was lost is unseen)
        assert idx.applied_seq(wid) == pubs[wid].seq
        for tier in Tier:
            assert idx.worker_blocks(wid, tier) == pubs[wid].history[-1][tier]

