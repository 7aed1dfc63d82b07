"""KV blocks move between two real processes over real NIXL (UCX on loopback), bytes verified.

The pytest process is the source (prefill side); a spawned child is the target (decode side): it
reserves blocks, hands out its metadata, waits for the push notification and checks every byte.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("nixl")

from kvstore.movers.transfer import (KvTransferAgent, KvTransferError, Strategy, TransferState,  # noqa: E402
                              merge_runs, nixl_available)

NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 4, 16, 2, 32
SENTINEL = -7.0
TIMEOUT_S = 10.0


def kv_cache(num_blocks: int, fill: str) -> torch.Tensor:
    shape = (NUM_LAYERS, num_blocks, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if fill == "sentinel":
        return torch.full(shape, SENTINEL)
    # every element distinct and a function of (layer, block, offset): a misplaced byte shows
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def target_main(conn, name: str, num_blocks: int) -> None:
    """The decode side: like a worker's step loop, take notifications (which drives NIXL progress)
    between serving the source's commands, until told to exit."""
    kv = kv_cache(num_blocks, "sentinel")
    agent = KvTransferAgent(name, kv)
    conn.send(agent.metadata())
    got: list[tuple[str, bytes]] = []
    while True:
        got += agent.take_notifications()
        if not conn.poll(0.001):
            continue
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "notifs":  # wait until `count` notifications arrived
            deadline = time.monotonic() + TIMEOUT_S
            while len(got) < args[0] and time.monotonic() < deadline:
                got += agent.take_notifications()
                time.sleep(0.001)
            conn.send(got)
            got = []
        elif cmd == "verify":  # (source num_blocks, [(src block, dst block)])
            src_num_blocks, moved = args
            conn.send(verify(kv, kv_cache(src_num_blocks, "pattern"), moved))
    agent.close()


def verify(kv: torch.Tensor, src: torch.Tensor, moved: list[tuple[int, int]]) -> str:
    """'' when every moved block equals the source's in every layer and nothing else changed."""
    dst_blocks = {d for _, d in moved}
    for s, d in moved:
        if not torch.equal(kv[:, d], src[:, s]):
            return f"block {s}->{d} differs"
    for b in range(kv.shape[1]):
        if b not in dst_blocks and not bool((kv[:, b] == SENTINEL).all()):
            return f"unmoved block {b} was touched"
    return ""


class Target:
    def __init__(self, name: str, num_blocks: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target_main, args=(child, name, num_blocks), daemon=True)
        self.proc.start()
        assert self.conn.poll(30), "target did not start"
        self.metadata = self.conn.recv()

    def ask(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(TIMEOUT_S + 5), f"target did not answer {cmd[0]}"
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture
def pair(request):
    src_blocks, dst_blocks = request.param
    tag = f"{os.getpid()}-{request.node.name}"
    target = Target(f"decode-{tag}", dst_blocks)
    source = KvTransferAgent(f"prefill-{tag}", kv_cache(src_blocks, "pattern"))
    yield source, target, src_blocks
    source.close()
    target.stop()


def test_module_reports_nixl():
    assert nixl_available()


def test_module_imports_without_nixl():
    code = ("import sys; sys.modules['nixl'] = None; import kvstore.movers.transfer as t; "
            "assert not t.nixl_available()")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)


def test_merge_runs_splits_where_either_side_jumps():
    import numpy as np
    ls, rs, n = merge_runs(np.array([3, 4, 5, 9, 10, 11]), np.array([0, 1, 7, 8, 9, 20]))
    assert (ls.tolist(), rs.tolist(), n.tolist()) == ([3, 5, 9, 11], [0, 7, 8, 20], [2, 1, 2, 1])


@pytest.mark.parametrize("pair", [(64, 64), (40, 96)], indirect=True, ids=["same", "uneven"])
@pytest.mark.parametrize("strategy", [Strategy.PREPPED, Strategy.MERGED], ids=lambda s: s.name)
def test_push_moves_exact_blocks_and_notifies(pair, strategy):
    source, target, src_num_blocks = pair
    source.strategy = strategy
    peer = source.add_peer(target.metadata)
    assert isinstance(peer, str)
    dst_max = 64 if src_num_blocks == 64 else 96
    pushes = [  # (source blocks, target blocks): scattered, contiguous on both, contiguous on one
        ([5, 0, 31, 17], [2, 50, 9, 33]),
        (list(range(20, 28)), list(range(dst_max - 8, dst_max))),
        (list(range(32, 40)), [10, 11, 12, 40, 41, 42, 43, 1]),
        ([], []),  # nothing to move (all blocks cached on the target): the notification still comes
    ]
    for i, (s, d) in enumerate(pushes):
        handle = source.push(peer, s, d, notif=f"req-{i}".encode())
        assert source.wait(handle, TIMEOUT_S) == TransferState.DONE
        assert handle.num_bytes == len(s) * NUM_LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4
    got = target.ask("notifs", len(pushes))
    assert sorted(got) == sorted((source.name, f"req-{i}".encode()) for i in range(len(pushes)))
    moved = [(s, d) for ss, dd in pushes for s, d in zip(ss, dd)]
    assert target.ask("verify", src_num_blocks, moved) == ""


@pytest.mark.parametrize("pair", [(16, 16)], indirect=True)
def test_bad_input_is_rejected_without_moving_anything(pair):
    source, target, _ = pair
    peer = source.add_peer(target.metadata)
    with pytest.raises(KvTransferError):
        source.push(peer, [0, 1], [0], b"x")
    with pytest.raises(KvTransferError):
        source.push(peer, [0], [16], b"x")
    with pytest.raises(KvTransferError):
        source.push("nobody", [0], [0], b"x")
    assert target.ask("verify", 16, []) == ""


@pytest.mark.parametrize("pair", [(16, 16)], indirect=True)
def test_push_to_dead_peer_fails_cleanly(pair):
    source, target, _ = pair
    peer = source.add_peer(target.metadata)
    assert source.wait(source.push(peer, [1], [1], b"warm"), TIMEOUT_S) == TransferState.DONE
    os.kill(target.proc.pid, signal.SIGKILL)
    target.proc.join(5)
    start = time.monotonic()
    states = [source.wait(source.push(peer, list(range(8)), list(range(8)), b"late"), 3.0)
              for _ in range(3)]
    assert all(s == TransferState.ERROR for s in states), states
    assert time.monotonic() - start < 15
    source.remove_peer(peer)


def test_peer_with_another_kv_dtype_is_refused():
    """fp16 and bf16 caches of one shape have equal block bytes: the layout's dtype keeps a decode
    worker from reading blocks it would misinterpret."""
    shape = (NUM_LAYERS, 8, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    a = KvTransferAgent(f"a-{os.getpid()}", torch.zeros(shape, dtype=torch.float16))
    b = KvTransferAgent(f"b-{os.getpid()}", torch.zeros(shape, dtype=torch.bfloat16))
    try:
        assert a.layout.block_bytes == b.layout.block_bytes
        with pytest.raises(KvTransferError, match="incompatible KV layouts"):
            a.add_peer(b.metadata())
    finally:
        a.close()
        b.close()


def test_a_closed_agent_has_no_notifications_and_clear_errors():
    """A decode worker closes its agent at shutdown while a handoff may still poll it (a CI run saw
    the poller's AttributeError): after close, polls find nothing, and a peer is unknown."""
    agent = KvTransferAgent("closing", kv_cache(4, "sentinel"))
    assert not agent.closed
    agent.close()
    assert agent.closed and agent.take_notifications() == []
    with pytest.raises(KvTransferError, match="unknown peer"):
        agent.remove_peer("gone")
    agent.close()                      # idempotent
