"""One role's candidate workers, laid out for the KV policy's vectorized scan (router/selection.py).

A pool fixes the candidates' order (the order ties are broken in), their rows in the queue arrays
(router/queues.py), and how the prefix index's worker bitmasks (router/chains.py) translate into
candidate positions. Masks repeat from one prompt to the next (the workers holding a popular
system prompt, a session's worker), so each mask's positions are computed once and cached; a pool
is rebuilt whenever the candidates or the index's slots change, which drops the cache.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_CACHE_MAX = 4096       # distinct masks remembered; past it the cache starts over


class CandidatePool:
    def __init__(self, names: Sequence[str], rows: Sequence[int], slots: Sequence[int | None],
                 slots_version: int) -> None:
        self.names = list(names)
        self.position = {w: i for i, w in enumerate(self.names)}
        # the candidates' rows in the queue arrays: a slice where they are consecutive (a fleet of
        # one role, in registration order), which reads a view instead of gathering a copy
        first = rows[0] if len(rows) else 0
        self.rows: slice | np.ndarray = (slice(first, first + len(rows))
                                         if list(rows) == list(range(first, first + len(rows)))
                                         else np.array(rows, dtype=np.intp))
        self.slots = list(slots)            # position -> index slot (None: no events seen yet)
        self.slots_version = slots_version
        num_slots = 1 + max((s for s in slots if s is not None), default=-1)
        self._slot_pos: list[int] = [-1] * num_slots    # index slot -> candidate position, or -1
        self._bits = 0                                   # the candidates' slots as a mask
        for i, s in enumerate(slots):
            if s is not None:
                self._slot_pos[s] = i
                self._bits |= 1 << s
        self._slot_pos_array = np.array(self._slot_pos, dtype=np.intp)
        self._cache: dict[int, np.ndarray] = {}

    def positions(self, bits: int) -> np.ndarray:
        """Candidate positions (ascending) of the index slots in ``bits``; other slots are ignored."""
        found = self._cache.get(bits)
        if found is None:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            # the mask's bits as a 0/1 array by slot, in a few array operations rather than a
            # Python step per bit (a group of holders may be most of the fleet)
            num_slots = len(self._slot_pos)
            raw = (bits & self._bits).to_bytes((num_slots + 7) // 8, "little")
            held = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=num_slots,
                                 bitorder="little")
            found = self._cache[bits] = np.sort(self._slot_pos_array[held.nonzero()[0]])
        return found

    def position_of_slot(self, slot: int) -> int:
        """The candidate position of one index slot, or -1."""
        return self._slot_pos[slot] if slot < len(self._slot_pos) else -1
