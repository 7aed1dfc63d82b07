"""Tensor parallelism on the CPU (gloo): a worker's model split over two rank processes computes
what the unsplit model does — greedy tokens equal HF transformers on the tiny llama and qwen2, FP8
weights quantized at load equal the unsplit FP8 model's — and a rank that dies is reported.

Each TP=2 engine is rank 0 in this process plus one spawned rank process (engine/parallel/).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine.engine import Engine
from engine.layers.linear import COLUMN, ROW, Linear, LinearMethod, Split
from engine.parallel.runner import TpRunner
from runtime.config import EngineConfig
from runtime.errors import InvalidRequest
from runtime.model_config import ModelConfig
from runtime.tensor_parallel import check_tensor_parallel, check_tp_engine, rank_share
from runtime.types import EngineRequest, SamplingParams
from splitserve.tiny_model import write_tiny_model

NEW_TOKENS = 24
LENGTHS = (1, 7, 40, 131)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {arch: write_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=0) for arch in ("llama", "qwen2")}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 4096, (n,), generator=g).tolist() for n in LENGTHS]


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True)))
    try:
        while engine.has_work:
            for o in engine.step().outputs:
                out[o.request_id] += o.new_token_ids
    finally:
        engine.close()
    return [out[str(i)] for i in range(len(prompts))]


def engine_cfg(model_dir, tp: int, **kw) -> EngineConfig:
    # chunks of 32 tokens: steps mix prefill chunks and decode rows, as a worker's do
    return EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=tp, num_blocks=96,
                        max_num_batched_tokens=32, attention_backend="torch", **kw)


@pytest.mark.parametrize("arch,scheduling", [("llama", True), ("qwen2", False)])
def test_tp2_greedy_tokens_equal_hf_transformers(tiny_dirs, arch, scheduling):
    """Column/row-parallel projections, heads and KV split per rank, vocab-parallel embedding and
    LM head (qwen2: tied, with q/k/v biases); llama with async scheduling, whose next step reads the
    sampled ids on rank 0's device (the other rank gets them by the forward pass's broadcast)."""
    transformers = pytest.importorskip("transformers")
    model_dir = tiny_dirs[arch]
    ours = generate(Engine(engine_cfg(model_dir, 2, async_scheduling=scheduling)), prompts())
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p, got in zip(prompts(), ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert got == ref[0, len(p):].tolist()


def test_tp2_fp8_weights_equal_the_unsplit_fp8_model(tiny_dirs):
    """FP8 quantized at load shards like bf16 does: the row-parallel shards take their scales from
    the whole rows, so TP=2 runs the TP=1 model's FP8 weights (dequantized on the CPU) and its tokens
    are the TP=1 FP8 tokens, which differ from the unquantized model's somewhere."""
    model_dir = tiny_dirs["llama"]
    one = generate(Engine(engine_cfg(model_dir, 1, quantization="fp8")), prompts())
    two = generate(Engine(engine_cfg(model_dir, 2, quantization="fp8")), prompts())
    assert two == one
    assert one != generate(Engine(engine_cfg(model_dir, 1)), prompts())


def test_summing_the_partial_outputs_in_the_norms_changes_no_token(tiny_dirs):
    """--tp-all-reduce flashinfer's model structure (attention and MLP return partial sums, the next
    norm adds them up: one fused kernel on GPUs, all-reduce + norm over gloo here) computes the same
    tokens as the all-reduce after each sublayer."""
    model_dir = tiny_dirs["llama"]
    want = generate(Engine(engine_cfg(model_dir, 2)), prompts())
    engine = Engine(engine_cfg(model_dir, 2, tp_all_reduce="flashinfer"))
    assert engine.runner.inner.model.fuse_reduce
    assert generate(engine, prompts()) == want


def test_the_symmetric_memory_all_reduce_falls_back_to_gloo_on_the_cpu(tiny_dirs):
    """--tp-all-reduce symm_mem is a GPU kernel: on the CPU every rank keeps the plain collective
    (no custom all-reduce is installed, no rank waits on one) and the tokens do not change."""
    model_dir = tiny_dirs["llama"]
    want = generate(Engine(engine_cfg(model_dir, 2)), prompts())
    engine = Engine(engine_cfg(model_dir, 2, tp_all_reduce="symm_mem"))
    assert engine.runner.inner.tp.custom_all_reduce is None
    assert generate(engine, prompts()) == want


def test_a_rank_that_dies_is_reported_with_why(tiny_dirs):
    """The watchdog sees a killed rank at once and says which and how (a worker then ends itself:
    collectives with a dead peer never return; here the report goes to a callback)."""
    lost = []
    runner = TpRunner(engine_cfg(tiny_dirs["llama"], 2), on_lost=lambda rank, why: lost.append((rank, why)))
    try:
        [pid] = runner.ranks.pids
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost == [(1, "was killed by SIGKILL")]
    finally:
        runner.ranks.kill()
        runner.tp.close()


def test_a_step_that_fails_on_a_dead_rank_reports_the_loss_before_the_watchdog_looks(tiny_dirs, monkeypatch):
    """A killed rank breaks the next step (its plan's send or a collective) often before the
    watchdog's next look; the engine loop then asks the runner, which finds the exited rank and
    reports it (a worker ends: its requests migrate instead of failing). A failure with every rank
    alive is not a loss."""
    import engine.parallel.ranks as ranks_mod
    import engine.parallel.runner as runner_mod
    lost = []
    runner = TpRunner(engine_cfg(tiny_dirs["llama"], 2), on_lost=lambda rank, why: lost.append((rank, why)))
    try:
        engine = Engine(engine_cfg(tiny_dirs["llama"], 2), runner=runner)
        monkeypatch.setattr(runner_mod, "STEP_FAILURE_GRACE_S", 0.3)
        runner.step_failed(RuntimeError("not a lost rank"))
        assert lost == []
        monkeypatch.setattr(ranks_mod, "WATCH_INTERVAL_S", 3600.0)     # the watchdog looks no more
        time.sleep(3 * 0.1)
        [pid] = runner.ranks.pids
        os.kill(pid, signal.SIGKILL)
        engine.add_request(EngineRequest("0", prompts()[2], SamplingParams(temperature=0.0, max_tokens=4)))
        with pytest.raises(Exception) as failed:
            while engine.has_work:
                engine.step()
        assert lost == []
        runner.step_failed(failed.value)
        assert lost == [(1, "was killed by SIGKILL")]
        runner.step_failed(failed.value)
        assert len(lost) == 1
    finally:
        runner.ranks.kill()
        runner.tp.close()


# ---- the split itself, without processes -------------------------------------------------------

def test_a_model_that_does_not_split_evenly_is_refused_with_its_numbers(tiny_dirs):
    cfg = ModelConfig.from_dir(tiny_dirs["llama"])             # 8 heads, 2 KV heads, 704 MLP features
    check_tensor_parallel(cfg, 2)
    with pytest.raises(InvalidRequest, match=r"num_key_value_heads \(2\) is not divisible by --tensor-parallel-size 4"):
        check_tensor_parallel(cfg, 4)
    with pytest.raises(InvalidRequest, match="between 1 and 64"):
        check_tensor_parallel(cfg, 0)
    with pytest.raises(InvalidRequest, match="KV tiers"):
        check_tp_engine(EngineConfig(model="m", tensor_parallel_size=2, kv_host_gib=1.0))
    share = rank_share(cfg, 1, 2)
    assert (share.num_heads, share.num_kv_heads, share.intermediate_size, share.vocab_start,
            share.head_start, share.kv_head_start) == (4, 1, 352, 2048, 4, 1)


def test_linear_shards_are_slices_of_the_whole_layer():
    """Column-parallel: a rank's rows of every fused part (and its bias rows); row-parallel: its input
    columns, the bias on rank 0 only. The sum over ranks of the row-parallel products, and the
    concatenation of the column-parallel ones, are the whole layer's."""
    g = torch.Generator().manual_seed(0)
    w_q, w_k, b_q, b_k = (torch.randn(shape, generator=g) for shape in ((4, 6), (2, 6), (4,), (2,)))
    x = torch.randn(3, 6, generator=g)
    cols = []
    for rank in range(2):
        lin = Linear(6, 3, True, LinearMethod(), torch.float32, parts=(2, 1), split=Split(COLUMN, rank, 2))
        for part, (w, b) in enumerate(((w_q, b_q), (w_k, b_k))):
            lin.load("weight", w, part)
            lin.load("bias", b, part)
        cols.append(lin(x))
    full = x @ torch.cat([w_q, w_k]).T + torch.cat([b_q, b_k])
    q_then_k = torch.cat([cols[0][:, :2], cols[1][:, :2], cols[0][:, 2:], cols[1][:, 2:]], 1)
    assert torch.allclose(q_then_k, full, atol=1e-6)
    w_o, b_o = torch.randn(5, 6, generator=g), torch.randn(5, generator=g)
    rows = []
    for rank in range(2):
        lin = Linear(3, 5, True, LinearMethod(), torch.float32, split=Split(ROW, rank, 2))
        lin.load("weight", w_o)
        lin.load("bias", b_o)
        rows.append(lin(x[:, rank * 3:(rank + 1) * 3]))
    assert torch.allclose(rows[0] + rows[1], x @ w_o.T + b_o, atol=1e-6)


def test_the_last_rank_of_a_vocabulary_that_does_not_divide_is_zero_padded():
    t = torch.arange(10.0).reshape(5, 2)
    assert Split(COLUMN, 1, 2).rows(t, 3).tolist() == [[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]
