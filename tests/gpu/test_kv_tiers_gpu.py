"""G1 <-> G2 copies with the cache on a GPU and the host tier pinned (skipped without CUDA): both
movers (torch side-stream staging, NIXL UCX loopback) move the right bytes, in order with the
compute stream, and a host -> disk -> host -> device round trip is byte-identical."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kvstore.block_format import BlockFormat  # noqa: E402
from kvstore.movers.host_copy import NixlHostCopy, TorchHostCopy, wait  # noqa: E402
from kvstore.movers.host_pool import HostPool  # noqa: E402
from kvstore.movers.transfer import nixl_available  # noqa: E402

L, NB = 4, 50


def setup(dtype=torch.bfloat16):
    kv = torch.randn(L, NB, 2, 16, 8, 128, device="cuda").to(dtype)
    fmt = BlockFormat.of(kv, "gpu-test")
    return kv, HostPool(fmt, 40 * fmt.block_bytes, pin_memory=True)


def movers(kv, host):
    yield TorchHostCopy(kv, host, max_staging_blocks=3)       # chunks of 3: the chunking runs too
    if nixl_available():
        yield NixlHostCopy(kv, host)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_offload_then_onboard_moves_exact_bytes(dtype):
    kv, host = setup(dtype)
    ref = kv.clone()
    blocks = [3, 17, 18, 19, 44, 0, 7]
    slots = [10, 11, 12, 13, 2, 30, 31]
    dest = [20, 21, 22, 23, 24, 25, 26]
    for m in movers(kv, host):
        host.data[:] = 0
        wait(m, m.offload(blocks, slots))
        for b, s in zip(blocks, slots):
            got = torch.from_numpy(host.data[s].copy()).view(L, -1)
            assert torch.equal(got, ref[:, b].reshape(L, -1).view(torch.uint8).cpu()), (m.name, b)
        kv[:, dest] = 0
        wait(m, m.onboard(slots, dest))
        assert torch.equal(kv[:, dest].view(torch.uint8), ref[:, blocks].view(torch.uint8)), m.name
        kv.copy_(ref)
        m.close()


def test_an_offload_queued_behind_an_onboard_copies_what_the_onboard_wrote():
    kv, host = setup()
    ref = kv.clone()
    for m in [m for m in movers(kv, host) if m.ordered]:      # NIXL's copies are ordered by done() only
        host.data[:] = 0
        wait(m, m.offload([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]))
        kv[:, 30:35] = 0
        m.onboard([0, 1, 2, 3, 4], [30, 31, 32, 33, 34])         # not waited for: the offload is queued behind it
        wait(m, m.offload([30, 31, 32, 33, 34], [20, 21, 22, 23, 24]))
        assert torch.equal(torch.from_numpy(host.data[20:25].copy()), torch.from_numpy(host.data[0:5].copy())), m.name
        assert torch.equal(kv[:, 30:35], ref[:, 1:6]), m.name
        kv.copy_(ref)
        m.close()


def test_a_layered_onboard_moves_exact_bytes_and_signals_each_layer():
    """Strided 2D copies per layer and run of slots, staging halves of L rows (chunks of 4 of the 7
    blocks, runs straddling them): every byte lands, and a layer's event covers that layer."""
    kv, host = setup()
    ref = kv.clone()
    m = TorchHostCopy(kv, host, max_staging_blocks=2, layer_events=[torch.cuda.Event() for _ in range(L)])
    assert m._driver is not None, "the driver's calls did not load"
    blocks, slots, dest = [3, 17, 18, 19, 44, 0, 7], [10, 11, 12, 13, 2, 30, 31], [20, 21, 22, 23, 24, 25, 26]
    wait(m, m.offload(blocks, slots))
    kv[:, dest] = 0
    h, events = m.onboard_layers(slots, dest)
    assert len(events) == L
    torch.cuda.current_stream().wait_event(events[0])
    first = kv[0, dest].clone()                       # on the compute stream, after layer 0's event only
    wait(m, h)
    assert torch.equal(first, ref[0, blocks])
    assert torch.equal(kv[:, dest].view(torch.uint8), ref[:, blocks].view(torch.uint8))


def test_a_graph_captured_with_an_external_event_wait_waits_for_the_events_latest_record():
    """What a decode graph does before each layer when the KV tiers onboard layer by layer."""
    from kvstore.movers.cuda_driver import Driver
    driver = Driver.load()
    ev = torch.cuda.Event()
    ev.record()
    x, y = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        driver.wait_external(torch.cuda.current_stream().cuda_stream, ev.cuda_event)
        y.copy_(x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)         # tens of ms before the value is written ...
        x.fill_(7.0)
        ev.record(side)                        # ... and the event recorded after it
    g.replay()
    torch.cuda.synchronize()
    assert y.item() == 7.0


def test_offload_sees_what_the_compute_stream_wrote_just_before():
    kv, host = setup()
    for m in movers(kv, host):
        torch.cuda._sleep(50_000_000)          # keep the compute stream busy (~tens of ms) ...
        kv[:, 5].fill_(3.0)                    # ... then write the block on it
        wait(m, m.offload([5], [0]))           # queued right after: must copy the 3.0s
        got = torch.from_numpy(host.data[0].copy()).view(torch.bfloat16)
        assert torch.all(got == 3.0), m.name
        m.close()


def test_host_slots_survive_a_disk_round_trip_into_the_device(tmp_path):
    from kvstore.movers.disk_pool import DiskConfig, DiskPool, ReadItem, WriteItem
    kv, host = setup()
    ref = kv.clone()
    disk = DiskPool(host.fmt, DiskConfig(str(tmp_path), 8 * host.fmt.block_bytes), host)
    m = TorchHostCopy(kv, host)
    wait(m, m.offload([1, 2, 3], [0, 1, 2]))
    slots = [disk.slots.reserve(h, None) for h in (101, 102, 103)]
    assert disk.write([WriteItem(s, h, None, i) for i, (s, h) in enumerate(zip(slots, (101, 102, 103)))]) == [None] * 3
    disk.slots.commit(slots)
    host.data[:3] = 0
    assert disk.read([ReadItem(s, h, 5 + i) for i, (s, h) in enumerate(zip(slots, (101, 102, 103)))]) == [None] * 3
    wait(m, m.onboard([5, 6, 7], [40, 41, 42]))
    assert torch.equal(kv[:, 40:43], ref[:, 1:4])
    disk.close()
