"""The prefix index's data structure: per block, the workers that hold the WHOLE chain up to it.

Block hashes are chained (kvstore/hashing.py): a hash names its block and every block before it, so
each hash has one parent. A worker's cached prefix of a prompt is the run of leading blocks it
holds; a hole (a block it lacks) ends the run even if it holds later blocks. Instead of walking a
prompt block by block, this structure keeps, per tier,

    chain[h] = bitmask of the workers that hold h AND every block before it,

so the masks along a prompt can only lose bits: chain[h_0] ⊇ chain[h_1] ⊇ ... A lookup reads the
last block's mask (a run to the prompt's end is then found at once: a whole hit costs two dict
reads), gallops and bisects for the positions where the mask changes, ~2·log2(n) dict reads per
distinct mask, and reads the workers that drop out at each change: that position is their run.

Keeping the masks exact whatever order blocks come and go in:

- per worker and tier, the set of blocks it holds (the truth events and snapshots describe);
- per hash, its parent (learned from BlockStored: an event's first block has ``parent_hash``, each
  later one follows the previous) and the children seen, so that a change can travel down a chain;
- a held block is *chained* on a worker when its parent is the root or is chained there. Storing a
  block whose parent is chained chains it, and if the worker holds orphans (held, not chained: their
  parent went away first) it adopts the orphans below it. Removing a chained block orphans the
  chained blocks below it. A worker's blocks are LRU-evicted tail first, so both walks are usually
  empty: the orphan count lets a store skip looking for orphans, and removals find no chained child.
- Parents and children are kept only for hashes some worker holds; a child that goes away unlinks
  itself from its parent. Whether anyone holds a hash is read from the masks (chained holders) and
  a count of orphan holders per hash (rare), not from a reference count per hash: on a large index
  every table a store touches is a cache miss, and a new block touches three big tables (its mask,
  its parent, its parent's children), a block another worker holds already only its mask.

A snapshot entry without a parent takes the one this structure learned, if any; a block whose
parent is unknown stays an orphan (it is not counted as cached) until an event names its parent.

Lookups over several tiers (a prefix held partly on the GPU and partly on host memory) walk the
prompt against the workers' sets, block by block: exact, not fast.

It knows nothing of worker names, event ordering or time (router/index.py does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kvstore.events import Tier

_TIERS = tuple(Tier)
_GALLOP = tuple(1 << k for k in range(63))     # a lookup's probe offsets (prompts of < 2**63 blocks)


@dataclass(slots=True)
class Holdings:
    """One worker's blocks: its bit in the masks, the blocks it holds and how many are orphans."""
    bit: int
    blocks: dict[Tier, set[int]] = field(default_factory=lambda: {t: set() for t in _TIERS})
    orphans: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(_TIERS, 0))


class ChainIndex:
    def __init__(self) -> None:
        self._chain: dict[Tier, dict[int, int]] = {t: {} for t in _TIERS}
        self._parent: dict[int, int | None] = {}        # held hashes only
        self._orphan_refs: dict[int, int] = {}          # (worker, tier) holdings as an orphan, per hash
        self._children: dict[int, int | set[int]] = {}  # parent -> child, or set of children

    # ---- lookups -------------------------------------------------------------------------

    def runs(self, block_hashes: Sequence[int], tier: Tier) -> list[tuple[int, int]]:
        """(worker bits, run length) pairs: the workers whose cached prefix of the prompt on
        ``tier`` is exactly that many leading blocks. Workers holding none are absent."""
        if not block_hashes:
            return []
        get = self._chain[tier].get
        m = get(block_hashes[0], 0)
        if not m:               # nobody holds the first block: no lookup of the last one
            return []
        out: list[tuple[int, int]] = []
        n = len(block_hashes)
        i = 0
        last = get(block_hashes[n - 1], 0)
        while m:
            if m == last:       # the run goes to the end: a whole hit costs no gallop
                out.append((m, n))
                break
            # Masks only shrink along the prompt: gallop from i (i+1, i+2, i+4, ...) to a position
            # whose mask differs (n counts as the empty mask), then bisect for the last position
            # still equal to m. A for loop over fixed steps: fewer bytecodes than a while loop.
            lo, hi, m_hi = i, n, 0
            for step in _GALLOP:
                probe = i + step
                if probe >= n:
                    break
                mp = get(block_hashes[probe], 0)
                if mp != m:
                    hi, m_hi = probe, mp
                    break
                lo = probe
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                mm = get(block_hashes[mid], 0)
                if mm == m:
                    lo = mid
                else:
                    hi, m_hi = mid, mm
            out.append((m & ~m_hi, lo + 1))
            i, m = hi, m_hi
        return out

    def runs_any_tier(self, block_hashes: Sequence[int], tiers: Sequence[Tier],
                      holdings: dict[int, Holdings]) -> list[tuple[int, int]]:
        """Like ``runs``, a block counting if held on any of ``tiers`` (``holdings``: bit ->
        worker). A walk over the prompt and the workers still in the run."""
        if not block_hashes:
            return []
        first = block_hashes[0]
        alive = [w for w in holdings.values() if any(first in w.blocks[t] for t in tiers)]
        out: list[tuple[int, int]] = []
        for i, h in enumerate(block_hashes):
            if not alive:
                break
            keep = []
            for w in alive:
                if any(h in w.blocks[t] for t in tiers):
                    keep.append(w)
                elif i:
                    out.append((w.bit, i))
            alive = keep
        for w in alive:
            out.append((w.bit, len(block_hashes)))
        return out

    def num_hashes(self) -> int:
        """Distinct hashes held by some worker on some tier (a walk over the tables)."""
        return len(set().union(*self._chain.values(), self._orphan_refs))

    def held_anywhere(self, h: int) -> bool:
        """Some worker holds ``h`` on some tier."""
        if h in self._orphan_refs:
            return True
        for chain in self._chain.values():
            if h in chain:
                return True
        return False

    # ---- changes -------------------------------------------------------------------------

    def store(self, w: Holdings, tier: Tier, block_hashes: Iterable[int], parent: int | None) -> None:
        """``w`` now holds ``block_hashes`` on ``tier``: a chain continuing from ``parent``."""
        held = w.blocks[tier]
        chain = self._chain[tier]
        bit = w.bit
        learn, children = self._parent.setdefault, self._children
        chained = parent is None or bool(chain.get(parent, 0) & bit)
        orphans = w.orphans[tier]
        for h in block_hashes:
            if h in held:                       # already here: the run goes on from it
                chained = bool(chain.get(h, 0) & bit)
                parent = h
                continue
            held.add(h)
            m = chain.get(h, 0)
            if chained:
                chain[h] = m | bit if m else bit    # a new mask shares the worker's bit, unallocated
            else:
                self._orphan_refs[h] = self._orphan_refs.get(h, 0) + 1
                orphans += 1
            # A hash chained on this tier already has its parent recorded; otherwise record it.
            # A hash keeps the first parent it was given (a chained hash has only one), and one
            # recorded is linked already: link only if this call recorded it (``is``).
            if not m and learn(h, parent) is parent and parent is not None:
                kids = children.setdefault(parent, h)    # _link, inlined
                if kids is not h:
                    if type(kids) is int:
                        if kids != h:
                            children[parent] = {kids, h}
                    else:
                        kids.add(h)
            if chained and orphans:
                w.orphans[tier] = orphans
                self._adopt(w, tier, h)
                orphans = w.orphans[tier]
            parent = h
        w.orphans[tier] = orphans

    def remove(self, w: Holdings, tier: Tier, block_hashes: Iterable[int]) -> None:
        held = w.blocks[tier]
        chain = self._chain[tier]
        bit = w.bit
        for h in block_hashes:
            if h not in held:
                continue
            held.discard(h)
            m = chain.get(h, 0)
            if m & bit:
                m = self._unchain(chain, h, bit)
                if h in self._children:
                    self._orphan_below(w, tier, h)
            else:
                w.orphans[tier] -= 1
                self._unref_orphan(h)
            if not m:
                self._forget_if_unheld(h)

    def clear(self, w: Holdings, tier: Tier) -> None:
        """``w`` holds nothing on ``tier`` any more."""
        chain = self._chain[tier]
        bit = w.bit
        held = w.blocks[tier]
        for h in held:
            if chain.get(h, 0) & bit:
                self._unchain(chain, h, bit)
            else:
                self._unref_orphan(h)
        for h in held:
            if h not in chain:
                self._forget_if_unheld(h)
        held.clear()
        w.orphans[tier] = 0

    def replace(self, w: Holdings, tier: Tier, entries: Iterable[int | tuple[int, int | None]]) -> None:
        """``w``'s blocks on ``tier`` are exactly ``entries`` (hashes, or (hash, parent) pairs)."""
        given: dict[int, object] = {}
        for e in entries:       # parents first: clearing may forget those only ``w`` held
            if isinstance(e, tuple):
                given[e[0]] = e[1]
            else:
                given[e] = self._parent.get(e, _UNKNOWN)
        self.clear(w, tier)
        w.blocks[tier].update(given)
        learn = self._parent.setdefault
        for h, p in given.items():
            if p is not _UNKNOWN and learn(h, p) is p and p is not None:   # type: ignore[arg-type]
                self._link(p, h)        # type: ignore[arg-type]
        chained: dict[int, bool] = {}
        for h in given:
            path, x = [], h
            while x not in chained:     # up the chain until a root, a gap or a known answer
                p = given[x]
                if p is None or p is _UNKNOWN or p not in given:
                    chained[x] = p is None
                    break
                path.append(x)
                x = p                   # type: ignore[assignment]
            for y in path:
                chained[y] = chained[x]
        chain, bit, orphan_refs = self._chain[tier], w.bit, self._orphan_refs
        for h, ok in chained.items():
            if ok:
                chain[h] = chain.get(h, 0) | bit
            else:
                orphan_refs[h] = orphan_refs.get(h, 0) + 1
        w.orphans[tier] = len(given) - sum(chained.values())

    # ---- internals -----------------------------------------------------------------------

    def _link(self, parent: int, child: int) -> None:
        kids = self._children.get(parent)
        if kids is None:
            self._children[parent] = child
        elif type(kids) is int:
            if kids != child:
                self._children[parent] = {kids, child}
        else:
            kids.add(child)

    def _unlink(self, parent: int, child: int) -> None:
        kids = self._children.get(parent)
        if kids is None:
            return
        if type(kids) is int:
            if kids == child:
                del self._children[parent]
        else:
            kids.discard(child)
            if len(kids) == 1:
                self._children[parent] = next(iter(kids))

    def _kids(self, h: int) -> Iterable[int]:
        kids = self._children.get(h)
        if kids is None:
            return ()
        return (kids,) if type(kids) is int else tuple(kids)

    def _unref_orphan(self, h: int) -> None:
        r = self._orphan_refs[h] - 1
        if r:
            self._orphan_refs[h] = r
        else:
            del self._orphan_refs[h]

    def _forget_if_unheld(self, h: int) -> None:
        """Nobody holds ``h`` any more: forget its parent (its children stay, for when it comes back)."""
        if self.held_anywhere(h):
            return
        parent = self._parent.pop(h, None)
        if parent is not None:
            self._unlink(parent, h)

    @staticmethod
    def _unchain(chain: dict[int, int], h: int, bit: int) -> int:
        """Clear ``bit`` from ``h``'s mask; returns what is left of it."""
        m = chain[h] & ~bit
        if m:
            chain[h] = m
        else:
            del chain[h]
        return m

    def _adopt(self, w: Holdings, tier: Tier, h: int) -> None:
        """``h`` just became chained on ``w``: so do the orphans below it that ``w`` holds."""
        held, chain, bit = w.blocks[tier], self._chain[tier], w.bit
        stack = [h]
        while stack and w.orphans[tier]:
            for c in self._kids(stack.pop()):
                if c in held and not chain.get(c, 0) & bit:
                    chain[c] = chain.get(c, 0) | bit
                    w.orphans[tier] -= 1
                    self._unref_orphan(c)
                    stack.append(c)

    def _orphan_below(self, w: Holdings, tier: Tier, h: int) -> None:
        """``h`` is no longer chained on ``w``: neither is anything below it."""
        chain, bit = self._chain[tier], w.bit
        stack = [h]
        while stack:
            for c in self._kids(stack.pop()):
                if chain.get(c, 0) & bit:
                    self._unchain(chain, c, bit)
                    w.orphans[tier] += 1
                    self._orphan_refs[c] = self._orphan_refs.get(c, 0) + 1
                    stack.append(c)


class _Unknown:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<unknown parent>"


_UNKNOWN = _Unknown()
