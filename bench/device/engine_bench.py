"""Engine-only benchmark on the GPU with random bf16 weights of real architectures.

  python bench/device/engine_bench.py [--models llama-3.1-8b,llama-3.2-1b] [--out FILE] [--skip-hf]

Prints JSON lines (git sha, device, model, config in each): the device's ceilings measured in this
run (HBM copy bandwidth, bf16 GEMM rate); per model: batch-1 decode tok/s with CUDA graphs on and off
against the roofline (bytes a decode step must read ÷ measured bandwidth), the host time a step
spends before its launch, decode throughput at batch 8..128 with ~1k-token contexts, prefill tok/s of
4k-token prompts against the GEMM ceiling (2 × matmul params × tokens FLOPs ÷ measured rate), a
K/V-write micro-benchmark (with RoPE + K/V write: FlashInfer + index_copy_ against the fused Triton
kernel, eager and inside a CUDA graph), and HF transformers `generate` on the same architecture as
the baseline. --no-fused-rope-kv runs the model without the fused kernel (field fused_rope_kv);
--no-fused-kernels and --no-input-major-weights turn off the other two (EngineConfig fields all).
`--kv-cache-dtypes auto,fp8` repeats every section with each KV cache dtype, `--decode-kernels
flashinfer,xqa` with each decode attention kernel, `--quantizations auto,fp8` with bf16 weights and
with the same random weights quantized to FP8 at load (EngineConfig.quantization; section `fp8_gemm`:
the FP8 kernels' measured choice per shape and row count beside the bf16 GEMM's time). Not in the default --only: section
`offline`, the 1k/1k serving workload inside the engine, no HTTP — a closed loop of 128 requests
(InferenceMAX lengths: input and output uniform in [0.8 × 1024, 1024]), output tok/s, with the GPU's
time per step (and `--offline-profile N`: kernel families of N profiled steps); section
`decode_profile`, the same kernel families for steady decode batches, to compare.
`--tensor-parallel-size N` runs the model split over N GPUs (rank 0 here, the others in their own
processes; `--tp-all-reduce flashinfer` for FlashInfer's all-reduce): sizes and rooflines are then
per GPU (rank 0's share), batch 1 runs graphs + async scheduling only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time

import torch

from common import Emitter, cuda_time_ms, graph_us, measure_ceilings  # noqa: E402  (sets sys.path)
from fp8_gemms import fp8_gemm_table  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.loader import write_arch_dir  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.parallel.runner import TpRunner  # noqa: E402
from runtime.types import EngineRequest, SamplingParams  # noqa: E402
from runtime.cli_args import add_config_args, flag_values  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402

_uid = iter(range(1 << 30))
# EngineConfig fields this bench takes as flags (as the workers do): --decode-tensor-cores auto|on|off,
# --no-fused-kernels, --no-fused-rope-kv, --no-input-major-weights
ENGINE_KNOBS = ("decode_tensor_cores", "fused_kernels", "fused_rope_kv", "input_major_weights",
                "tensor_parallel_size", "tp_all_reduce")


def _req(prompt_len: int, max_tokens: int, gen: torch.Generator, vocab: int) -> EngineRequest:
    prompt = torch.randint(10, vocab - 10, (prompt_len,), generator=gen).tolist()
    return EngineRequest(f"r{next(_uid)}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True))


def _steps(engine: Engine, n: int) -> tuple[float, list[float]]:
    """Run n steps; return wall seconds and the runner's host-prepare time of each step."""
    prep = []
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
        prep.append(engine.runner.last_prepare_s)
    return time.perf_counter() - t0, prep


def model_sizes(runner: ModelRunner) -> dict:
    """Parameter counts, and the bytes a decode step reads: every weight as stored (bf16, or e4m3 and
    its scales), the embedding table only when it is also the lm_head (a lookup reads one row)."""
    m, mc = runner.model, runner.model_config
    unique = {id(p): p for p in m.parameters()}
    total = sum(p.numel() for p in unique.values())
    embed = m.embed_tokens.weight
    layer = sum(p.numel() for p in m.layers.parameters() if p.dtype != torch.float32 or p.dim() > 1)
    stored = sum(p.numel() * p.element_size() for p in unique.values())
    decode_bytes = stored - (0 if mc.tie_word_embeddings else embed.numel() * embed.element_size())
    return {"params": total, "layer_params": layer, "decode_weight_bytes": decode_bytes,
            "kv_bytes_per_token": runner.block_bytes // runner.cfg.block_size}


def bench_decode_b1(emit, runner, sizes, ceil, common, steps=128, prompt_len=128) -> None:
    g = torch.Generator().manual_seed(1)
    vocab = runner.model_config.vocab_size
    can_reuse = getattr(runner.backend, "reuse_decode_plans", False)
    modes = [(True, can_reuse, True), (True, can_reuse, False), (True, False, True), (False, False, True)] \
        if runner.graphs else [(False, False, True)]
    split = runner.cfg.tensor_parallel_size > 1
    if split:                       # the other ranks run as they were built: graphs, reused plans
        modes = modes[:1]
    modes = list(dict.fromkeys(modes))
    for graphs, reuse, overlap in modes:
        runner.use_cuda_graphs = graphs
        if hasattr(runner.backend, "reuse_decode_plans"):
            runner.backend.reuse_decode_plans = reuse
        eng = Engine(dataclasses.replace(runner.cfg, async_scheduling=overlap), runner)
        eng.add_request(_req(prompt_len, steps + 16, g, vocab))
        _steps(eng, 9)                                          # prefill + warm-up decodes
        wall, prep = _steps(eng, steps)
        ctx = prompt_len + 9 + steps / 2
        read = sizes["decode_weight_bytes"] + ctx * sizes["kv_bytes_per_token"]
        roof = ceil["hbm_copy_GBps"] * 1e9 / read
        rec = dict(common, metric="decode_batch1", cuda_graphs=graphs, reuse_decode_plans=reuse,
                   async_scheduling=overlap,
                   tok_s=round(steps / wall, 1),
                   step_ms=round(wall / steps * 1e3, 3), host_prepare_ms=round(statistics.mean(prep) * 1e3, 3),
                   bytes_per_step=int(read), roofline_tok_s=round(roof, 1),
                   frac_of_roofline=round(steps / wall / roof, 3))
        if graphs and reuse == can_reuse and overlap and not split:   # a lone rank's replay would wait for the others
            gpu_ms = cuda_time_ms(lambda: runner.graphs.graphs[1].replay(), iters=50)
            rec.update(graph_replay_ms=round(gpu_ms, 3), gpu_only_tok_s=round(1e3 / gpu_ms, 1),
                       gpu_frac_of_roofline=round(1e3 / gpu_ms / roof, 3))
        emit(**rec)
        eng.scheduler.abort(next(iter(eng.scheduler.requests)))
    runner.use_cuda_graphs = runner.graphs is not None
    if hasattr(runner.backend, "reuse_decode_plans"):
        runner.backend.reuse_decode_plans = can_reuse


def bench_decode_batches(emit, runner, common, batches=(8, 16, 32, 64, 128), ctx=1000, steps=24,
                         modes=(True, False)) -> None:
    g = torch.Generator().manual_seed(2)
    vocab = runner.model_config.vocab_size
    # each batch sync and async at ~1k context; batch 128 also at 1,536, the mean context of 1k/1k serving
    for b, overlap, c in [(b, o, ctx) for b in batches for o in modes] + [(128, True, 1536)]:
        eng = Engine(dataclasses.replace(runner.cfg, async_scheduling=overlap), runner)
        reqs = _steady_batch(eng, b, c, steps, g, vocab)
        before = sum(r.num_output_tokens for r in reqs)
        wall, prep = _steps(eng, steps)
        made = sum(r.num_output_tokens for r in reqs) - before
        emit(**common, metric="decode_throughput", batch=b, context_tokens=c, async_scheduling=overlap,
             cuda_graphs=runner.use_cuda_graphs, tok_s=round(made / wall, 1), tokens_per_step=made / steps,
             step_ms=round(wall / steps * 1e3, 3), host_prepare_ms=round(statistics.mean(prep) * 1e3, 3))
        _drain(eng)


def _steady_batch(eng: Engine, b: int, c: int, steps: int, g, vocab: int) -> list:
    """b requests of c-token prompts, all decoding, none finishing within the next 2 x steps steps;
    returns the engine's live requests (to count their tokens). Chunked prefill lets the first
    requests decode while the last ones prefill, so by the time every request has a few tokens the
    first have one per prefill step: max_tokens covers that."""
    prefill_steps = -(-b * c // eng.scheduler.budget) + 2
    specs = [_req(c, prefill_steps + 4 + 2 * steps + 8, g, vocab) for _ in range(b)]
    for r in specs:
        eng.add_request(r)
    reqs = [eng.scheduler.requests[r.request_id] for r in specs]
    while min(r.num_output_tokens for r in reqs) < 4:
        eng.step()
    torch.cuda.synchronize()
    return reqs


def _drain(eng: Engine) -> None:
    """Abort every request the engine holds and run it until nothing is in flight."""
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)
    while eng.has_work:
        eng.step()


class StepClock:
    """Wraps runner.launch with two CUDA events per step: one recorded before the step queues any
    work, one after its last work (sampling, the tokens' copy to the host). On the GPU's clock, the
    gap from step i-1's end to step i's start is time the GPU sat idle waiting for the host to begin
    step i; start to end is the step itself (its kernels, and any wait for the host inside it)."""

    def __init__(self, runner, kv_bytes_per_token: int) -> None:
        self.runner, self.kv_bytes = runner, kv_bytes_per_token
        self.rows: list[tuple] = []       # (rows, prefill tokens, context tokens, start, end, host s, prepare s)
        runner.launch = self

    def __call__(self, plan, prev=None):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        out = type(self.runner).launch(self.runner, plan, prev)
        host = time.perf_counter() - t
        end.record()
        rows = plan.rows
        self.rows.append((len(rows), sum(r.num_tokens for r in rows if r.num_tokens > 1),
                          sum(r.start + r.num_tokens for r in rows), start, end, host, self.runner.last_prepare_s))
        return out

    def close(self) -> None:
        del self.runner.launch

    def summary(self, weight_bytes: int) -> dict:
        """Per kind of step (decode-only; with prefill tokens): count, GPU ms in steps and in gaps
        before them, host ms in launch, and for decode steps the bytes read per GPU ms."""
        torch.cuda.synchronize()
        out = {}
        steps = [(r, self.rows[i - 1][4].elapsed_time(r[3]), r[3].elapsed_time(r[4]))
                 for i, r in enumerate(self.rows) if i]
        for kind, sel in (("decode", [s for s in steps if not s[0][1]]), ("mixed", [s for s in steps if s[0][1]])):
            if not sel:
                continue
            gap, inner = [g for _, g, _ in sel], [x for *_, x in sel]
            rec = {"steps": len(sel), "gpu_step_ms_sum": round(sum(inner), 1), "gap_ms_sum": round(sum(gap), 1),
                   "gpu_step_ms_mean": round(statistics.mean(inner), 3),
                   "gpu_step_ms_p10_p50_p90": [round(q, 3) for q in _quantiles(inner)],
                   "gap_ms_mean": round(statistics.mean(gap), 3),
                   "gaps_over_0.5ms": sum(g > 0.5 for g in gap),
                   "host_launch_ms_mean": round(statistics.mean(r[5] for r, *_ in sel) * 1e3, 3),
                   "host_prepare_ms_p10_p50_p90": [round(q * 1e3, 3) for q in _quantiles([r[6] for r, *_ in sel])],
                   "mean_rows": round(statistics.mean(r[0] for r, *_ in sel), 1)}
            if kind == "decode":
                read = [weight_bytes + r[2] * self.kv_bytes for r, *_ in sel]
                rec["mean_context_tokens"] = round(statistics.mean(r[2] / r[0] for r, *_ in sel))
                rec["GBps_in_steps"] = round(sum(read) / sum(inner) / 1e6, 1)
                rec["GBps_with_gaps"] = round(sum(read) / (sum(inner) + sum(gap)) / 1e6, 1)
                after_mixed = [s for s, p in zip(steps[1:], steps) if not s[0][1] and p[0][1]]
                if after_mixed:
                    rec["after_mixed"] = {"steps": len(after_mixed),
                                          "gpu_step_ms_mean": round(statistics.mean(x for *_, x in after_mixed), 3),
                                          "gap_ms_mean": round(statistics.mean(g for _, g, _ in after_mixed), 3)}
            else:
                rec["mean_prefill_tokens"] = round(statistics.mean(r[1] for r, *_ in sel))
            out[kind] = rec
        return out


def _quantiles(xs: list[float]) -> list[float]:
    s = sorted(xs)
    return [s[int(q * (len(s) - 1))] for q in (0.1, 0.5, 0.9)]


def _kernel_profile(p, steps: int) -> dict:
    """GPU time of a profiled window by kernel family, busy time (the union of kernel and copy
    intervals) against the window, and the idle gaps between them."""
    fams = (("attention", ("prefill", "decode", "xqa", "mha", "attention", "merge_state")),
            ("gemm", ("gemm", "nvjet", "cutlass", "xmma")),
            ("norm", ("norm",)), ("rope_kv", ("rope", "triton")), ("act", ("silu", "act_and_mul")),
            ("sampling", ("sampl", "argmax", "topk", "softmax")), ("copy", ("memcpy", "memset", "copy")))
    ivs, by, names = [], {}, {}
    for e in p.events():
        if e.device_type.name != "CUDA":
            continue
        a, b = e.time_range.start, e.time_range.end
        ivs.append((a, b))
        name = e.name.lower()
        fam = next((f for f, keys in fams if any(k in name for k in keys)), "other")
        by[fam] = by.get(fam, 0.0) + (b - a)
        t, n = names.get(e.name[:90], (0.0, 0))
        names[e.name[:90]] = (t + b - a, n + 1)
    if not ivs:
        return {}
    ivs.sort()
    busy, gaps, (cs, ce) = 0.0, [], ivs[0]
    for a, b in ivs[1:]:
        if a > ce:
            busy += ce - cs
            gaps.append(a - ce)
            cs, ce = a, b
        else:
            ce = max(ce, b)
    busy += ce - cs
    window = ce - ivs[0][0]
    return {"window_ms": round(window / 1e3, 1), "busy_ms": round(busy / 1e3, 1), "steps": steps,
            "gpu_events_per_step": round(len(ivs) / steps, 1),
            "idle_ms": round((window - busy) / 1e3, 1), "gaps_over_50us": sum(g > 50 for g in gaps),
            "idle_in_gaps_over_50us_ms": round(sum(g for g in gaps if g > 50) / 1e3, 1),
            "kernel_ms_per_step": {f: round(t / 1e3 / steps, 3) for f, t in sorted(by.items(), key=lambda kv: -kv[1])},
            "top_kernels": [[k, round(t / 1e3 / steps, 3), round(n / steps, 1)]
                            for k, (t, n) in sorted(names.items(), key=lambda kv: -kv[1][0])[:12]],
            "top_columns": "kernel, ms/step, launches/step"}


def bench_decode_profile(emit, runner, common, cases=((128, 1536), (117, 1423)), steps=20) -> None:
    """The torch profiler over decode steps of a steady batch (every row the same context): kernel
    families against the offline loop's (bench_offline's profile_steps), same graphs."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(6)
    vocab = runner.model_config.vocab_size
    sizes = model_sizes(runner)
    for b, c in cases:
        eng = Engine(runner.cfg, runner)
        reqs = _steady_batch(eng, b, c, steps, g, vocab)
        before = sum(r.num_output_tokens for r in reqs)
        wall, _ = _steps(eng, steps)
        made = sum(r.num_output_tokens for r in reqs) - before
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            _steps(eng, steps)
            torch.cuda.synchronize()
        read = sizes["decode_weight_bytes"] + b * (c + 4 + steps // 2) * sizes["kv_bytes_per_token"]
        emit(**common, metric="decode_kernel_profile", batch=b, context_tokens=c, step_ms=round(wall / steps * 1e3, 3),
             tokens_per_step=made / steps, GBps=round(read / (wall / steps) / 1e9, 1), **_kernel_profile(p, steps))
        _drain(eng)


def bench_offline(emit, runner, common, concurrency=128, num_requests=384, isl=1024, osl=1024,
                  ratio=0.8, budget=2048, profile_steps=0, profile_start=1200) -> None:
    """Closed loop in the engine: `concurrency` requests in flight, each finished one replaced; the
    serve default token budget per step. Also where the time went: steps with prefill tokens in them
    (eager) against decode-only steps (CUDA graphs), by the wall time of each step() call (with async
    scheduling a call ends when the previous step's tokens are read, so it is that step's time), and
    on the GPU's clock (StepClock: the GPU's time in steps and idle between them). `profile_steps`:
    the torch profiler over that many steps from the middle of the run (kernel families, idle gaps;
    its overhead slows those steps, so the run's figures come from a separate unprofiled run)."""
    g = torch.Generator().manual_seed(4)
    vocab = runner.model_config.vocab_size
    lens = [(int(torch.randint(int(ratio * isl), isl + 1, (1,), generator=g)),
             int(torch.randint(int(ratio * osl), osl + 1, (1,), generator=g))) for _ in range(num_requests)]
    eng = Engine(dataclasses.replace(runner.cfg, max_num_batched_tokens=budget), runner)
    schedule, kinds = eng.scheduler.schedule, []

    def recording_schedule():
        plan = schedule()
        prefill = sum(r.num_tokens for r in plan.rows if r.num_tokens > 1)
        kinds.append((len(plan.rows), prefill))
        return plan
    # warm-up, untimed: a prefill-only step, then a step mixing a decode row into a prefill (each
    # attention kernel's first use JIT-compiles on a fresh machine: ~110 s, once polluting the wall)
    eng.add_request(_req(64, 8, g, vocab))
    eng.step()
    eng.add_request(_req(64, 2, g, vocab))
    while eng.has_work:
        eng.step()
    eng.scheduler.schedule = recording_schedule
    prof, begin = None, profile_start
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile
        prof = profile(activities=[ProfilerActivity.CUDA])
    else:
        clock = StepClock(runner, runner.block_bytes // runner.cfg.block_size)
    queue, live, tokens, times = list(lens), 0, 0, []
    t0 = time.perf_counter()
    try:
        while queue or eng.has_work:
            if prof is not None and len(times) == begin:
                prof.__enter__()
            while queue and live < concurrency:
                eng.add_request(_req(*queue.pop(), g, vocab))
                live += 1
            t = time.perf_counter()
            for o in eng.step().outputs:
                tokens += len(o.new_token_ids)
                live -= o.finish_reason is not None
            times.append(time.perf_counter() - t)
            if prof is not None and len(times) == begin + profile_steps:
                torch.cuda.synchronize()
                prof.__exit__(None, None, None)
                window = kinds[begin:begin + profile_steps]
                emit(**common, metric="offline_kernel_profile", first_step=begin,
                     decode_steps=sum(not k[1] for k in window), mixed_steps=sum(bool(k[1]) for k in window),
                     **_kernel_profile(prof, profile_steps))
                _drain(eng)
                return
    finally:
        if prof is None:
            clock.close()
    wall = time.perf_counter() - t0
    emit(**common, metric="offline_gpu_clock", concurrency=concurrency,
         **clock.summary(model_sizes(runner)["decode_weight_bytes"]))
    lag = 1 if eng.async_scheduling else 0          # step i's time is call i + lag's
    steps = [(k, times[i + lag]) for i, k in enumerate(kinds) if i + lag < len(times) and k[0]]
    mixed = [(k, dt) for k, dt in steps if k[1]]
    decode = [(k, dt) for k, dt in steps if not k[1]]
    emit(**common, metric="offline_throughput", concurrency=concurrency, requests=num_requests, isl=isl, osl=osl,
         random_range_ratio=ratio, max_num_batched_tokens=budget, output_tokens=tokens, steps=len(times),
         wall_s=round(wall, 2), tok_s=round(tokens / wall, 1),
         decode_steps=len(decode), decode_s=round(sum(dt for _, dt in decode), 2),
         decode_mean_batch=round(statistics.mean(k[0] for k, _ in decode), 1) if decode else None,
         mixed_steps=len(mixed), mixed_s=round(sum(dt for _, dt in mixed), 2),
         mixed_mean_prefill_tokens=round(statistics.mean(k[1] for k, _ in mixed)) if mixed else None,
         mixed_mean_rows=round(statistics.mean(k[0] for k, _ in mixed), 1) if mixed else None)


def bench_prefill(emit, runner, sizes, ceil, common, prompt_len=4096, n=4) -> None:
    g = torch.Generator().manual_seed(3)
    vocab = runner.model_config.vocab_size
    eng = Engine(dataclasses.replace(runner.cfg, max_num_batched_tokens=prompt_len), runner)
    eng.add_request(_req(prompt_len, 1, g, vocab))
    while eng.has_work:                                          # warm-up (and JIT)
        eng.step()
    for _ in range(n):
        eng.add_request(_req(prompt_len, 1, g, vocab))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 0
    while eng.has_work:
        eng.step()
        steps += 1
    wall = time.perf_counter() - t0
    tok_s = n * prompt_len / wall
    ceiling = ceil["gemm_8192_TFLOPs"] * 1e12 / (2 * sizes["layer_params"])
    emit(**common, metric="prefill", prompt_tokens=prompt_len, prompts=n, steps=steps,
         tok_s=round(tok_s, 1), gemm_ceiling_tok_s=round(ceiling, 1), frac_of_ceiling=round(tok_s / ceiling, 3),
         note="ceiling counts 2*layer_params FLOPs per token (no attention FLOPs, no lm_head: one row)")


def bench_kv_write(emit, runner, common) -> None:
    from engine.attention.base import write_kv, write_kv_rows
    from engine.kernels import rope_kv
    import flashinfer
    bs = runner.cfg.block_size
    layer = runner.kv_cache[0]
    nb, _, _, hkv, d = layer.shape
    h, cs = runner.model_config.num_heads, runner.model.cos_sin_cache
    for t in (1, 128, 4096):
        pages = torch.randperm(nb - 1, device="cuda")[: (t + bs - 1) // bs].int()
        pos = torch.arange(t, device="cuda")
        slots = pages.long()[pos // bs] * bs + pos % bs
        rows = torch.stack([slots + (slots // bs) * bs, slots + (slots // bs) * bs + bs])
        k = torch.randn(t, hkv, d, dtype=runner.dtype, device="cuda")
        v = torch.randn_like(k)
        indptr = torch.tensor([0, len(pages)], dtype=torch.int32, device="cuda")
        last = torch.tensor([t - (len(pages) - 1) * bs], dtype=torch.int32, device="cuda")
        zeros = torch.zeros(t, dtype=torch.int32, device="cuda")
        res = {
            "write_kv_us": cuda_time_ms(lambda: write_kv(layer, k, v, slots, bs), 50) * 1e3,
            "write_kv_rows_us": cuda_time_ms(lambda: write_kv_rows(layer, k, v, rows), 50) * 1e3,
            "flashinfer_append_us": cuda_time_ms(lambda: flashinfer.append_paged_kv_cache(
                k, v, zeros, pos.int(), layer, pages, indptr, last, "NHD"), 50) * 1e3}
        # RoPE + K/V write, as Attention.forward does it: FlashInfer's RoPE then write_kv_rows (3
        # kernels), against the fused Triton kernel (1); eager, and per call in a graph of 32 calls
        qkv = torch.randn(t, (h + 2 * hkv) * d, dtype=runner.dtype, device="cuda")
        q, kk, vv = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        rope_pos = torch.randint(0, cs.shape[0], (t,), device="cuda")

        def unfused():
            flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(rope_pos, q, kk, d, cs, is_neox=True)
            write_kv_rows(layer, kk.view(t, hkv, d), vv.view(t, hkv, d), rows)

        res["rope_write_kv_rows_us"] = cuda_time_ms(unfused, 50) * 1e3
        res["graph32_rope_write_kv_rows_us"] = graph_us(unfused)
        if rope_kv.available() and rope_kv.supports(d):
            def fused():
                rope_kv.rope_and_write_kv(qkv, rope_pos, cs, layer, rows, h, hkv, d)

            res["fused_rope_kv_us"] = cuda_time_ms(fused, 50) * 1e3
            res["graph32_fused_rope_kv_us"] = graph_us(fused)
        emit(**common, metric="kv_write_one_layer", tokens=t, **{a: round(b, 2) for a, b in res.items()})


def bench_profile(emit, runner, common, steps=200) -> None:
    """Where a batch-1 decode step's time goes: host functions (cProfile over graph steps), kernels of
    one eager step (torch profiler), and batch-1 GEMM bandwidth per weight matrix by BLAS library."""
    import cProfile
    import pstats
    g = torch.Generator().manual_seed(5)
    vocab = runner.model_config.vocab_size
    eng = Engine(runner.cfg, runner)
    eng.add_request(_req(128, steps + 64, g, vocab))
    _steps(eng, 9)
    prof = cProfile.Profile()
    prof.enable()
    _steps(eng, steps)
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(((v[2] / steps * 1e6, v[3] / steps * 1e6, f"{k[0].split('/')[-1]}:{k[2]}")
                   for k, v in st.stats.items()), reverse=True)[:15]
    emit(**common, metric="host_profile_decode_b1", per_step_us=[[n, round(t, 1), round(c, 1)] for t, c, n in rows],
         columns="function, self us/step, cumulative us/step")
    runner.use_cuda_graphs = False
    from torch.profiler import ProfilerActivity, profile
    _steps(eng, 3)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        _steps(eng, 5)
    runner.use_cuda_graphs = runner.graphs is not None
    kernels: dict[str, list[float]] = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            kernels.setdefault(e.name[:80], []).append(getattr(e, "device_time", None) or e.cuda_time)
    total = sum(sum(v) for v in kernels.values()) / 5
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:14]
    emit(**common, metric="kernel_profile_decode_b1_eager", kernel_us_per_step=round(total, 1),
         kernels_per_step=sum(len(v) for v in kernels.values()) / 5,
         top=[[k, round(sum(v) / 5, 1), len(v) / 5] for k, v in top], columns="kernel, us/step, launches/step")
    eng.abort_request(next(iter(eng.scheduler.requests)))
    mc, dev = runner.model_config, "cuda"
    shapes = {"qkv": ((mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim, mc.hidden_size),
              "o": (mc.hidden_size, mc.num_heads * mc.head_dim), "gate_up": (2 * mc.intermediate_size, mc.hidden_size),
              "down": (mc.hidden_size, mc.intermediate_size), "lm_head": (mc.vocab_size, mc.hidden_size)}
    res = {}
    default_lib = torch.backends.cuda.preferred_blas_library()
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, (n, k) in shapes.items():
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(4)]   # rotate: no L2 hits
            x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
            it = iter(range(1 << 30))
            ms = cuda_time_ms(lambda: torch.nn.functional.linear(x, ws[next(it) % 4]), 40)
            res[f"{lib}:{name}_GBps"] = round(n * k * 2 / ms / 1e6, 1)
            if name == "lm_head" and lib == "cublas":
                ms2 = cuda_time_ms(lambda: torch.mm(x, ws[next(it) % 4].t(), out_dtype=torch.float32), 40)
                res["lm_head_mm_out_fp32_GBps"] = round(n * k * 2 / ms2 / 1e6, 1)
            del ws
    torch.backends.cuda.preferred_blas_library(default_lib)
    emit(**common, metric="gemm_batch1_bandwidth", **res)


def bench_hf(emit, model_dir, common, decode_tokens=32, prompt_len=128, prefill_len=4096) -> None:
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(4)

    def gen(n_prompt: int, n_new: int) -> float:
        ids = torch.randint(10, cfg.vocab_size - 10, (1, n_prompt), generator=g).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.inference_mode():
        gen(prompt_len, 4)
        t1 = statistics.median(gen(prompt_len, 1) for _ in range(3))
        tn = gen(prompt_len, decode_tokens)
        emit(**common, metric="hf_decode_batch1", tok_s=round((decode_tokens - 1) / (tn - t1), 1),
             prompt_tokens=prompt_len, new_tokens=decode_tokens, attn=cfg._attn_implementation)
        gen(prefill_len, 1)
        tp = statistics.median(gen(prefill_len, 1) for _ in range(3))
        emit(**common, metric="hf_prefill", prompt_tokens=prefill_len, tok_s=round(prefill_len / tp, 1))
    del model
    gc.collect()
    torch.cuda.empty_cache()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.1-8b,llama-3.2-1b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--only", default="b1,batches,prefill,kv,profile,hf")
    ap.add_argument("--num-blocks", type=int, default=16000)   # 32 GB for the 8B: batch 128 at 1.5k context
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma list of auto|fp8: each runs every section")
    ap.add_argument("--decode-kernels", default="auto", help="comma list of auto|flashinfer|xqa: each runs every section")
    ap.add_argument("--quantizations", default="auto", help="comma list of auto|fp8 (the weights: bf16, or FP8 "
                    "quantized at load): each runs every section")
    ap.add_argument("--batches", default="8,16,32,64,128", help="section batches: the decode batch sizes")
    ap.add_argument("--async-only", action="store_true", help="section batches: async scheduling only")
    ap.add_argument("--offline-budget", type=int, default=2048, help="offline: max_num_batched_tokens per step")
    ap.add_argument("--offline-profile", type=int, default=0,
                    help="offline: then rerun with the torch profiler over this many steps (kernel families, GPU idle)")
    ap.add_argument("--offline-profile-start", type=int, default=1200,
                    help="offline: the first profiled step (~950: the first wave's requests finish, mixed steps)")
    add_config_args(ap, EngineConfig, only=ENGINE_KNOBS, config_file=False)
    args = ap.parse_args()
    knobs = {k: v for k, v in flag_values(EngineConfig, args).items() if k in ENGINE_KNOBS}
    emit = Emitter("engine_bench", args.out)
    ceil = measure_ceilings()
    emit(metric="ceilings", **ceil)
    only = set(args.only.split(","))
    cases = [(a, k, d, q) for a in args.models.split(",") for k in args.kv_cache_dtypes.split(",")
             for d in args.decode_kernels.split(",") for q in args.quantizations.split(",")]
    for arch, kv_dtype, decode_kernel, quant in cases:
        model_dir = write_arch_dir(arch, f"/tmp/splitserve-models/{arch}")
        cfg = EngineConfig(model=str(model_dir), load_format="dummy", num_blocks=args.num_blocks,
                           max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=8192,
                           enable_prefix_caching=False, kv_cache_dtype=kv_dtype, decode_kernel=decode_kernel,
                           quantization=quant, **knobs)
        t0 = time.perf_counter()
        runner = TpRunner(cfg) if cfg.tensor_parallel_size > 1 else ModelRunner(cfg)
        sizes = model_sizes(runner)
        common = {"model": arch, "weights": "dummy-fp8-online" if runner.quantization else "dummy-bf16",
                  "quantization": quant, "attention": runner.backend.name,
                  "decode_tensor_cores": getattr(runner.backend, "decode_tensor_cores", None),
                  "decode_kernel": getattr(runner.backend, "decode_kernel", None),
                  "fused_rope_kv": runner.model.layers[0].self_attn.rope_kv is not None,
                  "fused_kernels": cfg.fused_kernels, "input_major_weights": cfg.input_major_weights,
                  "kv_cache_dtype": str(runner.kv_cache.dtype).removeprefix("torch."),
                  "block_size": cfg.block_size, "num_blocks": cfg.num_blocks,
                  "tensor_parallel_size": cfg.tensor_parallel_size, "tp_all_reduce": cfg.tp_all_reduce,
                  "custom_all_reduce": getattr(runner, "tp", None) is not None and runner.tp.custom_all_reduce is not None}
        emit(**common, metric="model", load_and_capture_s=round(time.perf_counter() - t0, 2),
             startup_s=runner.startup_s,
             graph_capture_s=round(runner.graphs.capture_s, 2) if runner.graphs else None,
             graph_sizes=runner.graphs.sizes if runner.graphs else None, **sizes)
        steps = [("b1", lambda: bench_decode_b1(emit, runner, sizes, ceil, common)),
                 ("batches", lambda: bench_decode_batches(emit, runner, common, _ints(args.batches),
                                                          modes=(True,) if args.async_only else (True, False))),
                 ("fp8_gemm", lambda: fp8_gemm_table(emit, runner, common)),
                 ("prefill", lambda: bench_prefill(emit, runner, sizes, ceil, common)),
                 ("kv", lambda: bench_kv_write(emit, runner, common)),
                 ("profile", lambda: bench_profile(emit, runner, common)),
                 ("decode_profile", lambda: bench_decode_profile(emit, runner, common)),
                 ("offline", lambda: bench_offline(emit, runner, common, budget=args.offline_budget)),
                 ("offline", lambda: args.offline_profile and bench_offline(
                     emit, runner, common, budget=args.offline_budget, profile_steps=args.offline_profile,
                     profile_start=args.offline_profile_start))]
        for name, fn in steps:
            if name in only:
                try:
                    fn()
                except Exception as e:  # one failed section must not lose the others
                    emit(**common, metric=name, error=repr(e)[:500])
        if hasattr(runner, "close"):
            runner.close()              # the other ranks
        del runner
        gc.collect()
        torch.cuda.empty_cache()
        if "hf" in only and not args.skip_hf and (kv_dtype, decode_kernel, quant) == cases[0][1:]:
            try:
                bench_hf(emit, str(model_dir), {"model": arch, "weights": "dummy-bf16", "impl": "hf-transformers"})
            except Exception as e:
                emit(model=arch, metric="hf", error=repr(e)[:500])


if __name__ == "__main__":
    main()
