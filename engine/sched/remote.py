"""Remote prefill bookkeeping, both sides of a disaggregated request.

Decode side: a request whose prompt a prefill worker computes is admitted by reserving its blocks
(no step budget); it then waits in `awaiting_kv` and its `KvReservation` waits in `reservations`
until the caller takes it to send the Prefill call. Prefill side: a finished `hold_blocks` request's
blocks stay pinned in `held` until the decode side has the KV (or gave up).

`RemotePrefills` owns those three and the blocks it releases; it does not move a request into
the running batch (the scheduler does, on `kv_arrived` / `kv_failed`), nor send or receive any KV.
"""

from __future__ import annotations

from kvstore.pools.block_pool import BlockPool
from engine.request import Request
from runtime.types import KvReservation


class RemotePrefills:
    """Contract: `reserve` a request once its blocks are allocated; `done` hands it back when
    its KV landed or its prefill failed (None if it is not awaited: aborted meanwhile) with `remote_prefill` cleared, for the
    scheduler to run; `forget` drops an awaited request that ended (True if it was awaited).
    `hold` pins a finished request's blocks (its `block_ids` list) until `release_held` frees them
    to the pool. `seen` is set once any request came with a remote prefill: only then can one be
    queued behind local prompts, so only then does admission walk past a prompt without budget."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.awaiting_kv: dict[str, Request] = {}      # decode side: blocks reserved, KV in flight
        self.reservations: list[KvReservation] = []     # new reservations for the caller to act on
        self.held: dict[str, list[int]] = {}            # prefill side: finished, blocks still pinned
        self.seen = False

    # ---- decode side ----------------------------------------------------------------------
    def reserve(self, req: Request) -> None:
        """The request's blocks are reserved: await its KV, and ask the caller to start its prefill."""
        self.awaiting_kv[req.request_id] = req
        self.reservations.append(KvReservation(req.request_id, list(req.token_ids), list(req.block_ids),
                                               req.num_computed_tokens, req.session))

    def take_reservations(self) -> list[KvReservation]:
        """Reservations made since the last call, for the caller to start their remote prefills."""
        out, self.reservations = self.reservations, []
        return out

    def done(self, request_id: str) -> Request | None:
        """The remote prefill is over (its KV landed in the reserved blocks, or it failed)."""
        req = self.awaiting_kv.pop(request_id, None)
        if req is not None:
            req.remote_prefill = False
        return req

    def forget(self, request_id: str) -> bool:
        return self.awaiting_kv.pop(request_id, None) is not None

    # ---- prefill side ---------------------------------------------------------------------
    def hold(self, req: Request) -> None:
        self.held[req.request_id] = req.block_ids

    def release_held(self, request_id: str) -> None:
        """The decode side has the KV (or gave up): unpin the blocks."""
        blocks = self.held.pop(request_id, None)
        if blocks is not None:
            self.pool.free(blocks)
