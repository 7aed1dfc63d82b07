"""ModelRunner on the CPU: greedy tokens match HF transformers, step inputs are built right,
the dummy load format and the architecture presets work."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from engine.engine import Engine
from engine.loader import ARCHS, write_arch_dir
from runtime.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.step_inputs import build_host_step
from runtime.types import EngineRequest, FinishReason, SamplingParams
from engine.plan import PlanRow, StepPlan
from runtime.config import EngineConfig
from splitserve.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True)))
    while engine.has_work:
        for o in engine.step().outputs:
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def test_greedy_matches_hf_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 4096, (n,), generator=g).tolist() for n in (1, 7, 40, 131)]
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", num_blocks=128, max_num_batched_tokens=64,
                       attention_backend="torch")
    ours = _generate(Engine(cfg), prompts, 24)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    for p, got in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert got == ref[0, len(p):].tolist()


def _row(rid: str, tokens: list[int], blocks: list[int], start: int, n: int, bs: int) -> PlanRow:
    """A plan row as the scheduler makes it: the chunk's ids and the pages it touches."""
    return PlanRow(rid, int(rid), tokens[start:start + n], start, blocks[:-(-(start + n) // bs)], SamplingParams(),
                   start + n == len(tokens))


def test_host_step_matches_per_token_definition():
    bs = 4
    rng = np.random.default_rng(0)
    seqs, rows = [], []
    for i, (start, n, total) in enumerate([(0, 9, 9), (5, 3, 12), (10, 1, 11), (0, 1, 2)]):
        tokens = rng.integers(0, 100, total).tolist()
        blocks = rng.permutation(50)[: (total + bs - 1) // bs].tolist()
        seqs.append((tokens, blocks))
        rows.append(_row(str(i), tokens, blocks, start, n, bs))
    s = build_host_step(rows, bs)
    ids, pos, slots = [], [], []
    for r, (tokens, blocks) in zip(rows, seqs):
        for p in range(r.start, r.start + r.num_tokens):
            ids.append(tokens[p])
            pos.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
    assert s.input_ids.tolist() == ids and s.positions.tolist() == pos and s.slots.tolist() == slots
    blocks, offs = np.array(slots) // bs, np.array(slots) % bs
    assert s.kv_rows[0].tolist() == (blocks * 2 * bs + offs).tolist()
    assert s.kv_rows[1].tolist() == (blocks * 2 * bs + bs + offs).tolist()
    assert s.qo_indptr.tolist() == [0, 9, 12, 13, 14]
    assert s.kv_last_page_len.tolist() == [1, 4, 3, 1]
    for i, (r, (tokens, blocks)) in enumerate(zip(rows, seqs)):
        pages = s.kv_indices[s.kv_indptr[i]:s.kv_indptr[i + 1]].tolist()
        assert pages == blocks[: -(-(r.start + r.num_tokens) // bs)]
    assert s.samples == [True, False, True, False]
    assert s.sample_rows.tolist() == [8, 12]
    assert not s.is_decode_only


def test_padded_page_table_from_the_host_step():
    """XQA's page table: row i holds sequence i's pages, its length is its context; cells past a
    row's pages keep what was there (the kernel reads only a sequence's own pages)."""
    from engine.attention.base import fill_page_table
    bs = 4
    rng = np.random.default_rng(1)
    rows, tables = [], []
    for i, total in enumerate([1, 4, 5, 13, 2]):
        blocks = rng.permutation(40)[: -(-total // bs)].tolist()
        tables.append(blocks)
        rows.append(_row(str(i), rng.integers(0, 100, total).tolist(), blocks, total - 1, 1, bs))
    s = build_host_step(rows, bs)
    lens, table = np.zeros(5, np.int32), np.full((5, 6), -7, np.int32)
    fill_page_table(s.kv_indptr, s.kv_indices, s.kv_last_page_len, bs, lens, table)
    assert lens.tolist() == [1, 4, 5, 13, 2]
    for i, blocks in enumerate(tables):
        n = len(blocks)
        assert table[i, :n].tolist() == blocks
        assert (table[i, n:] == -7).all()


def test_fp8_cache_writes_saturate_instead_of_nan():
    """torch's e4m3 cast on CUDA makes NaN of anything past ±448 (H100, torch 2.11: 1000 -> nan; the
    CPU build here saturates); the cache write clamps (as the fused Triton kernel does), so one large
    key cannot poison attention over its block."""
    from engine.attention.base import to_cache, write_kv_rows
    x = torch.tensor([[[1000.0, -1e4, 448.0, 0.3]]])
    assert to_cache(x, torch.float8_e4m3fn).float().tolist() == [[[448.0, -448.0, 448.0, 0.3125]]]
    e4m3 = to_cache(x, torch.float8_e4m3fn)
    assert to_cache(e4m3, torch.float8_e4m3fn) is e4m3 or torch.equal(to_cache(e4m3, e4m3.dtype).view(torch.uint8),
                                                                       e4m3.view(torch.uint8))
    cache = torch.zeros(2, 2, 2, 1, 4, dtype=torch.float8_e4m3fn)  # (blocks, k|v, bs, Hkv, D)
    write_kv_rows(cache, x, -x, torch.tensor([[1], [3]]))
    flat = cache.view(-1, 1, 4).float()
    assert flat[1].tolist() == [[448.0, -448.0, 448.0, 0.3125]] and flat[3].tolist() == [[-448.0, 448.0, -448.0, -0.3125]]
    assert not cache.float().isnan().any()


def test_xqa_decode_kernel_is_refused_off_hopper():
    from engine.model_runner import resolve_decode_kernel
    assert resolve_decode_kernel("auto", torch.device("cpu"), torch.float32) == "flashinfer"
    with pytest.raises(ValueError, match="compute capability 9.0"):
        resolve_decode_kernel("xqa", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="auto, flashinfer or xqa"):
        resolve_decode_kernel("fast", torch.device("cpu"), torch.float32)


def test_dummy_format_is_seeded_and_runs(tmp_path):
    d = write_arch_dir("llama-3.2-1b", tmp_path / "m", hidden_size=128, num_hidden_layers=2,
                       intermediate_size=256, vocab_size=512, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=512)
    cfg = EngineConfig(model=str(d), device="cpu", load_format="dummy", num_blocks=32, seed=3)
    a, b = ModelRunner(cfg), ModelRunner(cfg)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    prompts = [[1, 2, 3, 4, 5], list(range(40, 77))]
    assert _generate(Engine(cfg, a), prompts, 8) == _generate(Engine(cfg, b), prompts, 8)


def test_arch_presets_have_the_real_dimensions(tmp_path):
    big = ModelConfig.from_dir(write_arch_dir("llama-3.1-8b", tmp_path / "8b"))
    assert (big.hidden_size, big.num_layers, big.num_heads, big.num_kv_heads, big.intermediate_size,
            big.vocab_size, big.head_dim, big.tie_word_embeddings) == (4096, 32, 32, 8, 14336, 128256, 128, False)
    assert big.rope_scaling["rope_type"] == "llama3"
    small = ModelConfig.from_dir(write_arch_dir("llama-3.2-1b", tmp_path / "1b"))
    assert (small.hidden_size, small.num_layers, small.head_dim, small.tie_word_embeddings) == (2048, 16, 64, True)
    huge = ModelConfig.from_dir(write_arch_dir("llama-3.1-70b", tmp_path / "70b"))
    assert (huge.hidden_size, huge.num_layers, huge.num_heads, huge.num_kv_heads, huge.intermediate_size,
            huge.vocab_size, huge.head_dim) == (8192, 80, 64, 8, 28672, 128256, 128)
    assert set(ARCHS) == {"llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b"}
    assert json.loads((tmp_path / "8b" / "config.json").read_text())["model_type"] == "llama"


def _run_all(engine: Engine, reqs: list[EngineRequest]) -> dict[str, tuple[list[int], object]]:
    out: dict[str, tuple[list[int], object]] = {}
    for r in reqs:
        engine.add_request(r)
    while engine.has_work:
        for o in engine.step().outputs:
            toks, _ = out.get(o.request_id, ([], None))
            out[o.request_id] = (toks + o.new_token_ids, o.finish_reason)
    return out


def test_async_scheduling_gives_the_same_tokens_as_sync(tiny_dir):
    """The real model on the CPU, step N+1 launched before step N's tokens are read: greedy and
    seeded sampling, stop tokens (a discarded step each), shared prefixes, chunked prefill and
    preemption (a KV pool too small for all) all give what the synchronous engine gives."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(5, 4096, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(5, 4096, (n,), generator=g).tolist() for n in (0, 3, 17, 60)]
    prompts += [torch.randint(5, 4096, (n,), generator=g).tolist() for n in (1, 5, 90)]
    base = EngineConfig(model=str(tiny_dir), device="cpu", num_blocks=12, max_num_batched_tokens=64,
                        attention_backend="torch", async_scheduling=False)
    probe = _run_all(Engine(base), [EngineRequest(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=12))
                                    for i, p in enumerate(prompts)])

    def requests() -> list[EngineRequest]:
        reqs = []
        for i, p in enumerate(prompts):
            stop = frozenset({probe[f"p{i}"][0][5]}) if i % 3 == 0 else frozenset()
            sp = SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i if i % 2 else None,
                                max_tokens=20 + i, stop_token_ids=stop)
            reqs.append(EngineRequest(str(i), p, sp))
        return reqs

    sync_engine = Engine(base)
    async_engine = Engine(dataclasses.replace(base, async_scheduling=True))
    assert not sync_engine.async_scheduling and async_engine.async_scheduling
    sync, overlapped = _run_all(sync_engine, requests()), _run_all(async_engine, requests())
    assert overlapped == sync
    assert sum(reason == FinishReason.STOP for _, reason in sync.values()) >= 2
    assert sync_engine.scheduler.num_preemptions > 0 and async_engine.scheduler.num_preemptions > 0
    for eng in (sync_engine, async_engine):
        assert eng.pool.num_free == eng.pool.num_blocks


def test_a_seeded_request_samples_alike_whatever_ran_before_on_the_runner(tiny_dir):
    """Seeded generators belong to the runner, one per admission: the same requests (same ids)
    run twice on one runner give the same tokens, and the generators of finished requests go."""
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", num_blocks=64, attention_backend="torch")
    runner = ModelRunner(cfg)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 4096, (n,), generator=g).tolist() for n in (4, 20, 33)]

    def reqs():
        return [EngineRequest(str(i), p, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10, ignore_eos=True))
                for i, p in enumerate(prompts)]

    eng = Engine(cfg, runner)
    first, again = _run_all(eng, reqs()), _run_all(eng, reqs())          # the same ids, admitted again
    assert first == again == _run_all(Engine(cfg, runner), reqs())      # and on another engine
    _run_all(eng, [EngineRequest("later", prompts[0], SamplingParams(temperature=1.0, seed=1, max_tokens=2))])
    assert len(runner._generators) == 1 + 3      # "later"'s; the other engine's finished ones wait for its next plan


def test_input_major_weights_compute_the_same_function(tiny_dir):
    """The GPU layout (o_proj, gate|up, down, lm_head stored (in, out)) changes no result."""
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", num_blocks=64, attention_backend="torch")
    a, b = ModelRunner(cfg), ModelRunner(cfg)
    b.model.use_input_major_weights()
    down = b.model.layers[0].mlp.down_proj
    assert down.weight is None and down.weight_t.shape == (down.in_features, down.out_features)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 4096, (n,), generator=g).tolist() for n in (3, 50)]
    assert _generate(Engine(cfg, a), prompts, 12) == _generate(Engine(cfg, b), prompts, 12)
    h = torch.randn(2, a.model.cfg.hidden_size, generator=g)
    torch.testing.assert_close(a.model.compute_logits(h), b.model.compute_logits(h), rtol=1e-5, atol=1e-5)


def test_fp8_kv_cache_stores_e4m3_of_the_same_keys_and_values(tiny_dir):
    """--kv-cache-dtype fp8: a quarter of float32's bytes per block (so four times the blocks in the
    same budget); layer 0's cache is exactly the float32 run's keys and values cast to e4m3 (deeper
    layers read rounded K/V, so they drift), and the logits stay within fp8's rounding."""
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", attention_backend="torch")
    a, b = ModelRunner(cfg), ModelRunner(dataclasses.replace(cfg, kv_cache_dtype="fp8"))
    assert b.kv_cache.dtype == torch.float8_e4m3fn and 4 * b.block_bytes == a.block_bytes
    assert b.num_blocks == 4 * a.num_blocks + 3        # the same byte budget, minus the scratch block
    prompt = torch.randint(5, 4096, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    logits, blocks = [], [5, 9, 2]
    for runner in (a, b):
        runner.execute(StepPlan(1, [PlanRow("r", 1, prompt, 0, blocks, SamplingParams(temperature=0.0), True)]))
        logits.append(runner.last_logits.clone())
    assert torch.equal(b.kv_cache[0, blocks].view(torch.uint8),
                       a.kv_cache[0, blocks].to(torch.float8_e4m3fn).view(torch.uint8))
    rel = ((logits[0] - logits[1]).norm() / logits[0].norm()).item()
    assert 0 < rel < 0.1, rel


def test_torch_backend_attends_over_fp8_values_exactly():
    """The reference backend's read of an fp8 cache is its values, upcast: the same output as a
    float32 cache that holds the same (rounded) numbers."""
    from engine.attention.torch_backend import TorchAttention
    from engine.attention.base import AttentionMetadata
    g = torch.Generator().manual_seed(0)
    h, hkv, d, bs = 4, 2, 16, 4
    cache8 = (torch.randn(8, 2, bs, hkv, d, generator=g) * 3).to(torch.float8_e4m3fn)
    cache32 = cache8.float()
    q, k, v = torch.randn(3, h, d, generator=g), *torch.randn(2, 3, hkv, d, generator=g)
    md = AttentionMetadata(query_lens=[3], context_lens=[7], block_tables=[[6, 1]],
                           slot_mapping=torch.tensor([1 * bs + 0, 1 * bs + 1, 1 * bs + 2]),
                           query_start_loc=torch.tensor([0, 3]), block_size=bs, is_decode_only=False)
    outs = []
    for cache, kk, vv in ((cache8, k, v), (cache32, k.to(torch.float8_e4m3fn).float(), v.to(torch.float8_e4m3fn).float())):
        backend = TorchAttention(h, hkv, d)
        backend.plan(md)
        outs.append(backend.forward(0, q, kk, vv, cache))
    assert torch.equal(cache8.float(), cache32)         # the new K/V landed rounded in both
    assert torch.equal(outs[0], outs[1])


def _with_piece(module, piece: int, fn):
    saved = module.PIECE
    module.PIECE = piece
    try:
        return fn()
    finally:
        module.PIECE = saved


def test_the_streaming_weight_reader_matches_safetensors(tiny_dir, tmp_path):
    """engine/weights_io.py reads the same tensors as safetensors' own reader, in every dtype the
    loader meets, and refuses a truncated file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.weights_io import iter_tensors
    path = tmp_path / "mixed.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn(3, 5, generator=g).to(torch.bfloat16), "b": torch.randn(7, generator=g),
               "c": torch.arange(6, dtype=torch.int64).view(2, 3), "d": torch.tensor(2.5, dtype=torch.float16)},
              str(path))
    import engine.weights_io as weights_io
    for file, piece in [(path, 1 << 20), (path, 8), (tiny_dir / "model.safetensors", 1 << 20),
                        (tiny_dir / "model.safetensors", 4096)]:
        # small pieces: tensors span several pieces and the ring of staging buffers wraps many times
        ours = dict(_with_piece(weights_io, piece, lambda: list(iter_tensors(file, torch.device("cpu")))))
        with safe_open(str(file), framework="pt") as f:
            assert sorted(ours) == sorted(f.keys())
            for name in f.keys():
                ref = f.get_tensor(name)
                assert ours[name].dtype == ref.dtype and torch.equal(ours[name], ref), name
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(ValueError, match="truncated"):
        list(iter_tensors(path, torch.device("cpu")))
