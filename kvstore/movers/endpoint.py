"""A worker's KV transfer endpoint over its ranks: the door the prefill and decode services use.

A worker at tensor-parallel size N holds its KV cache in N pieces, rank r's heads on rank r's GPU,
each registered with that rank's own NIXL agent (transfer.py `KvTransferAgent`; rank 0's lives in
the worker process, the others' in their rank processes, reached through proxies with the same
methods: engine/parallel/kv.py). `KvEndpoint` makes them one:

- `metadata()`: every rank's agent metadata (its layout says which heads it holds). At N = 1 it is
  the agent's own, byte for byte, so workers without tensor parallelism talk as before.
- `add_peer(metadata)`: each of our ranks adds the peer's ranks whose heads overlap its own; returns
  the peer's name (its rank 0 agent's, what the decode side sends as `decode_agent_name`).
- `push(peer, local, remote, notif)` / `wait_async`: every pair of overlapping ranks moves the
  heads it shares, directly between the two ranks' memory: nothing is gathered anywhere. With one
  pair the push carries the notification (as before); with several, none does, and once all have
  landed our rank 0 notifies the peer's rank 0, so the peer learns of the whole prompt at once.
- `take_notifications()`: rank 0's (the only one notified); it also keeps the other ranks' agents
  making progress while pushes may arrive, which a NIXL target must do.

Knows nothing about requests, gRPC or processes.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvstore.movers.transfer import KvLayout, KvTransferAgent, KvTransferError, TransferState

_MAGIC = b"SSKVTP1\0"          # a multi-rank metadata envelope (a single agent's never starts so)
_COUNT = struct.Struct("!I")


def pack_ranks(metadata: Sequence[bytes]) -> bytes:
    """One worker's metadata from its ranks' (one rank: that rank's, unchanged)."""
    if len(metadata) == 1:
        return metadata[0]
    parts = [_MAGIC, _COUNT.pack(len(metadata))]
    for md in metadata:
        parts += [_COUNT.pack(len(md)), md]
    return b"".join(parts)


def unpack_ranks(metadata: bytes) -> list[bytes]:
    """The ranks' metadata inside a worker's (KvTransferError when it is malformed)."""
    if not metadata.startswith(_MAGIC):
        return [metadata]
    try:
        pos = len(_MAGIC)
        (count,) = _COUNT.unpack_from(metadata, pos)
        pos += _COUNT.size
        out = []
        for _ in range(count):
            (n,) = _COUNT.unpack_from(metadata, pos)
            pos += _COUNT.size
            out.append(metadata[pos:pos + n])
            pos += n
    except struct.error as e:
        raise KvTransferError(f"malformed worker KV metadata ({e})") from None
    if not out or pos != len(metadata):
        raise KvTransferError("malformed worker KV metadata")
    return out


@dataclass(slots=True)
class EndpointHandle:
    """A push in flight over one or more rank pairs; `notify`: (our rank-0 agent, peer name, notif)
    to send once every part has landed."""
    parts: list[tuple[Any, Any]]              # (rank agent, its handle)
    notify: tuple[Any, str, bytes] | None = None
    state: TransferState = TransferState.PENDING
    num_bytes: int = field(default=0)


class KvEndpoint:
    def __init__(self, agents: Sequence[Any]) -> None:
        """`agents`: the worker's rank agents in rank order; rank 0's in this process."""
        self.agents = list(agents)
        self.name = self.agents[0].name
        self._pairs: dict[str, list[tuple[int, str]]] = {}     # peer -> (our rank, its rank agent's name)
        heads = sum(a.layout.num_heads for a in self.agents)
        self.num_heads = heads

    @property
    def layouts(self) -> list[KvLayout]:
        return [a.layout for a in self.agents]

    def metadata(self) -> bytes:
        return pack_ranks([a.metadata() for a in self.agents])

    def add_peer(self, metadata: bytes) -> str:
        """Connect our ranks to the peer worker's ranks that share heads with them; the peer's name."""
        ranks = unpack_ranks(metadata)
        layouts = [KvTransferAgent.layout_of(md) for md in ranks]
        theirs = sum(lay.num_heads for lay in layouts)
        if len(ranks) > 1 or len(self.agents) > 1:
            if theirs != self.num_heads or layouts[0].head_start != 0:
                raise KvTransferError(f"the peer's ranks hold {theirs} KV heads, ours {self.num_heads}: "
                                      "not the same model")
        pairs = []
        for i, agent in enumerate(self.agents):
            for md, lay in zip(ranks, layouts):
                if _overlap(agent.layout, lay):
                    pairs.append((i, agent.add_peer(md)))
        peer = pairs[0][1]                   # our rank 0 and theirs both start at head 0
        self._pairs[peer] = pairs
        return peer

    def push(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
             notif: bytes) -> EndpointHandle:
        pairs = self._pairs.get(peer)
        if pairs is None:
            raise KvTransferError(f"unknown peer {peer!r}")
        if len(pairs) == 1:
            agent = self.agents[pairs[0][0]]
            h = agent.push(pairs[0][1], local_blocks, remote_blocks, notif)
            return EndpointHandle([(agent, h)], None, num_bytes=h.num_bytes)
        parts = []
        for i, name in pairs:
            agent = self.agents[i]
            parts.append((agent, agent.push(name, local_blocks, remote_blocks, b"")))
        return EndpointHandle(parts, (self.agents[0], peer, notif), num_bytes=sum(h.num_bytes for _, h in parts))

    async def wait_async(self, handle: EndpointHandle, timeout_s: float) -> TransferState:
        """Until every part landed (then the notification goes) or one failed or `timeout_s` passed."""
        states = await asyncio.gather(*(agent.wait_async(h, timeout_s) for agent, h in handle.parts))
        ok = all(s == TransferState.DONE for s in states)
        if ok and handle.notify is not None:
            agent, peer, notif = handle.notify
            try:
                agent.notify(peer, notif)
            except Exception:                # the peer is gone: the push did not complete for it
                ok = False
        handle.state = TransferState.DONE if ok else TransferState.ERROR
        return handle.state

    def remove_peer(self, peer: str) -> bool:
        """Forget a peer worker on every rank pair (it left); False if it was not connected."""
        pairs = self._pairs.pop(peer, None)
        for i, name in pairs or ():
            try:
                self.agents[i].remove_peer(name)
            except KvTransferError:
                pass                            # that rank had already dropped it
        return pairs is not None

    def take_notifications(self) -> list[tuple[str, bytes]]:
        for agent in self.agents[1:]:
            agent.keep_progressing()
        return self.agents[0].take_notifications()

    @property
    def closed(self) -> bool:
        return self.agents[0].closed

    def close(self) -> None:
        for agent in self.agents:
            agent.close()


def _overlap(a: KvLayout, b: KvLayout) -> bool:
    if not (a.num_heads and b.num_heads):
        return True                          # heads unknown (not the engine's layout): whole blocks
    return max(a.head_start, b.head_start) < min(a.head_end, b.head_end)
