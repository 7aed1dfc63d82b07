"""The fused RoPE + K/V-write Triton kernel against FlashInfer's RoPE followed by write_kv_rows (the
unfused path the model takes with EngineConfig.fused_rope_kv off), eagerly and replayed from a CUDA
graph whose inputs change between replays (skipped without CUDA, FlashInfer or Triton).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
flashinfer = pytest.importorskip("flashinfer")

from engine.attention.base import to_cache, write_kv_rows  # noqa: E402
from engine.kernels import rope_kv  # noqa: E402
from engine.rope import RotaryEmbedding  # noqa: E402

if not rope_kv.available():
    pytest.skip("needs Triton", allow_module_level=True)

DEV = torch.device("cuda")
NUM_BLOCKS, BLOCK_SIZE, MAX_POS = 64, 16, 4096


def _cos_sin_cache(head_dim: int) -> torch.Tensor:
    """(P, D) float32 [cos | sin], built as CausalLM.setup_rope builds it (llama3 scaling)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(head_dim, 500000.0, scaling, MAX_POS, DEV)
    return torch.cat((rope.cos, rope.sin), dim=-1).contiguous()


def _inputs(t, h, hkv, d, dtype, gen, cache_dtype=None):
    """Random qkv (T, (H+2Hkv)D), positions < 4000, a random cache and distinct random K/V rows.
    For an fp8 cache each head's vector gets a scale in 1e-3..1e3, so that the cache sees subnormals
    and saturation at ±448 (per head, not per element: RoPE mixes a head's elements, and a rounding
    difference of a 1e3 element would swamp a 1e-3 one's tolerance)."""
    qkv = torch.randn(t, h + 2 * hkv, d, generator=gen, device=DEV)
    if cache_dtype == torch.float8_e4m3fn:
        qkv *= 10 ** (torch.rand(t, h + 2 * hkv, 1, generator=gen, device=DEV) * 6 - 3)
    qkv = qkv.view(t, -1).to(dtype)
    positions = torch.randint(0, 4000, (t,), generator=gen, device=DEV)
    cache = torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, hkv, d, generator=gen, device=DEV).to(cache_dtype or dtype)
    rows = torch.randperm(NUM_BLOCKS * 2 * BLOCK_SIZE, generator=gen, device=DEV)[: 2 * t].view(2, t)
    return qkv, positions, cache, rows


def _reference(qkv, positions, cs, cache, rows, h, hkv, d):
    """FlashInfer's RoPE in place on views of qkv, then write_kv_rows: what Attention.forward did."""
    t = qkv.shape[0]
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, d, cs, is_neox=True)
    write_kv_rows(cache, k.view(t, hkv, d), v.view(t, hkv, d), rows)


def _assert_matches(qkv, cache, ref_qkv, ref_cache, before, rows, h, hkv, d):
    t = qkv.shape[0]
    tol = dict(atol=1e-2, rtol=1e-2)                    # bf16: 1 ulp of O(1) values is 2^-7..2^-5
    torch.testing.assert_close(qkv[:, : (h + hkv) * d].float(), ref_qkv[:, : (h + hkv) * d].float(), **tol)
    assert torch.equal(qkv[:, (h + hkv) * d:], before[0][:, (h + hkv) * d:])      # v untouched
    flat, ref_flat, old = (c.view(-1, hkv, d) for c in (cache, ref_cache, before[1]))
    if cache.dtype == torch.float8_e4m3fn:            # 1 bf16 ulp of k can move it 1 fp8 ulp (2^-3)
        torch.testing.assert_close(flat[rows[0]].float(), ref_flat[rows[0]].float(), atol=2e-3, rtol=0.13)
    else:
        torch.testing.assert_close(flat[rows[0]].float(), ref_flat[rows[0]].float(), **tol)

    def same(a, b):                                   # bitwise, fp8 included
        return torch.equal(a.view(torch.uint8), to_cache(b, a.dtype).view(torch.uint8))
    assert same(flat[rows[0]], qkv[:, h * d:(h + hkv) * d].view(t, hkv, d))  # the roped k itself, cast
    assert same(flat[rows[1]], before[0][:, (h + hkv) * d:].view(t, hkv, d))  # v, exactly (cast)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEV)
    untouched[rows.reshape(-1)] = False
    assert same(flat[untouched], old[untouched])


@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (8, 2)])
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_matches_flashinfer_rope_and_write_kv_rows(t, dtype, head_dim, heads, fp8_cache):
    h, hkv = heads
    gen = torch.Generator(device=DEV).manual_seed(t * 1000 + head_dim + h)
    cs = _cos_sin_cache(head_dim)
    qkv, positions, cache, rows = _inputs(t, h, hkv, head_dim, dtype, gen,
                                          torch.float8_e4m3fn if fp8_cache else None)
    before = (qkv.clone(), cache.clone())
    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    _reference(ref_qkv, positions, cs, ref_cache, rows, h, hkv, head_dim)
    rope_kv.rope_and_write_kv(qkv, positions, cs, cache, rows, h, hkv, head_dim)
    torch.cuda.synchronize()
    _assert_matches(qkv, cache, ref_qkv, ref_cache, before, rows, h, hkv, head_dim)


def test_cuda_graph_replay_follows_changed_inputs():
    """Captured once, replayed with new qkv, positions, rows and cache contents copied into the
    captured buffers; rows are a column slice of a larger buffer, as in DecodeGraphs."""
    h, hkv, d, t, dtype = 32, 8, 128, 4, torch.bfloat16
    gen = torch.Generator(device=DEV).manual_seed(11)
    cs = _cos_sin_cache(d)
    qkv, positions, cache, _ = _inputs(t, h, hkv, d, dtype, gen)
    static_rows = torch.zeros(4, 16, dtype=torch.int64, device=DEV)
    rows = static_rows[2:4, :t]
    rows.copy_(torch.arange(2 * t, device=DEV).view(2, t))

    def call():
        rope_kv.rope_and_write_kv(qkv, positions, cs, cache, rows, h, hkv, d)

    call()                                              # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        new_qkv, new_pos, new_cache, new_rows = _inputs(t, h, hkv, d, dtype, gen)
        qkv.copy_(new_qkv)
        positions.copy_(new_pos)
        cache.copy_(new_cache)
        rows.copy_(new_rows)
        ref_qkv, ref_cache = new_qkv.clone(), new_cache.clone()
        _reference(ref_qkv, new_pos, cs, ref_cache, new_rows, h, hkv, d)
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(qkv, cache, ref_qkv, ref_cache, (new_qkv, new_cache), new_rows, h, hkv, d)
