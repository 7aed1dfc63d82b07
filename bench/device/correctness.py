"""FlashInfer backend (with fused kernels and CUDA graphs) against the torch reference backend, on the GPU.

  python bench/device/correctness.py [--out FILE] [--prompts 32] [--tokens 64] [--models ...] [--dtypes ...]

Three engines with the same weights run the same prompts in lockstep — the same schedule, so each
step's sampled rows line up: fast (FlashInfer), ref (torch backend, same dtype) and fp32 (torch
backend, a float32 copy of the weights: the precision oracle). Two passes:
  teacher-forced: after every step every engine's token is replaced by the fp32 token, so all always
    see the same context; every step's logits are comparable. Reports the token agreement (argmax
    equal) and the logits' relative error ‖a − b‖ / ‖b‖ per row.
  free-running: each engine keeps its own tokens; reports the share of 64-token continuations that
    are identical (ref_vs_fp32: the bf16 noise floor of the reference itself), and at each first
    divergence the reference's top-1/top-2 margin (a flip where the margin is below the logits'
    error is rounding, not a wrong kernel).
Every record carries `passed_issue_targets`: free-running fast_vs_ref continuations identical ≥ 99%
and teacher-forced fast_vs_ref logits relative error ≤ 1e-2 at every step.
Models: trained-hd128, a model with head_dim 128 / GQA 4 (the 8B's attention shape) trained by
train_small.py on 30M tokens of the installed Python's source (stdlib and site-packages; on first use
~3 min, then cached), prompted with spans of held-out files — random weights have near-ties at almost
every step, while a model that generalises is peaked where the text is predictable, as a real one is;
small-hd128, the same shape with seeded "decisive" random weights (engine/loader.py's dummy format)
and random-id prompts; llama-3.2-1b's shape (head_dim 64, tied embeddings), random.
Dtypes bfloat16 (serving) and float16 (3 more mantissa bits).
Also checks the FlashInfer sampling kernel (top_k=1 is argmax; frequencies match softmax).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
from pathlib import Path

import torch

from common import Emitter  # noqa: E402  (sets sys.path)
from engine.engine import Engine  # noqa: E402
from engine.loader import write_arch_dir  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from runtime.types import EngineRequest, SamplingParams  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from train_small import HD128, MAX_SECONDS, heldout_ids, train  # noqa: E402

TRAINED = "trained-hd128"               # train_small.py's model; the others have random weights
MODELS = {
    "small-hd128": ("llama-3.1-8b", dict(HD128, vocab_size=8192)),
    "llama-3.2-1b": ("llama-3.2-1b", {}),
}


def _model_dir(name: str) -> tuple[Path, str]:
    """The model's directory and load format (trained on first use)."""
    if name == TRAINED:
        return train(f"/tmp/splitserve-models/{name}", max_seconds=MAX_SECONDS), "auto"
    arch, overrides = MODELS[name]
    return write_arch_dir(arch, f"/tmp/splitserve-models/corr-{name}", **overrides), "dummy"


def _prompt_lens(n: int, g: torch.Generator) -> list[int]:
    return ([1, 15, 16, 17, 33, 200, 511, 700] + torch.randint(2, 600, (max(n - 8, 0),), generator=g).tolist())[:n]


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (n_,), generator=g).tolist() for n_ in _prompt_lens(n, g)]


def _text_prompts(n: int, ids: list[int], seed: int) -> list[list[int]]:
    """Spans of the token stream `ids` at seeded offsets, of _prompts' lengths."""
    g = torch.Generator().manual_seed(seed)
    starts = [(n_, int(torch.randint(0, len(ids) - n_ + 1, (1,), generator=g))) for n_ in _prompt_lens(n, g)]
    return [ids[s:s + n_] for n_, s in starts]


def _record_logits(runner: ModelRunner, last: dict) -> None:
    """Wrap runner.execute to keep the last step's sampled logits by request id (cloned: graph
    outputs are reused by the next replay)."""
    inner = runner.execute

    def execute(plan):
        out = inner(plan)
        reqs = [r.request_id for r in plan.rows if r.samples]
        last.clear()
        if reqs:
            last.update(zip(reqs, runner.last_logits.float().clone()))
        return out
    runner.execute = execute


def lockstep(runners: dict[str, ModelRunner], prompts, tokens: int, oracle: str | None,
             references: tuple[str, ...] | None = None) -> dict:
    """Run one engine per runner on the same requests, step by step (same schedule). With `oracle`,
    every other engine's sampled token is replaced by the oracle's (teacher forcing), so all see the
    same contexts; without, each runs free and a pair stops being compared once its tokens differ.
    Pairs (a, b) for a before b in `runners`' order (only b in `references`, if given); b is the
    reference of the relative error."""
    cfg = dataclasses.replace(next(iter(runners.values())).cfg, max_num_batched_tokens=1024,
                              async_scheduling=False)     # teacher forcing edits tokens between steps
    names = list(runners)
    engines = {n: Engine(cfg, r) for n, r in runners.items()}
    for i, p in enumerate(prompts):
        for e in engines.values():
            e.add_request(EngineRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)))
    last = {n: {} for n in names}
    for n, r in runners.items():
        _record_logits(r, last[n])
    seqs = {n: {str(i): [] for i in range(len(prompts))} for n in names}
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if references is None or b in references]
    st = {pr: {"agree": 0, "total": 0, "errs": [], "margins": [], "diffs": [], "diverged": set()} for pr in pairs}
    try:
        while engines[names[0]].has_work:
            outs = {n: {o.request_id: o.new_token_ids[0] for o in e.step().outputs} for n, e in engines.items()}
            assert all(outs[n].keys() == outs[names[0]].keys() for n in names), "schedules differ"
            for rid in outs[names[0]]:
                for n in names:
                    seqs[n][rid].append(outs[n][rid])
                for a, b in pairs:
                    s = st[(a, b)]
                    if rid in s["diverged"]:
                        continue
                    la, lb = last[a][rid], last[b][rid]
                    s["errs"].append(((la - lb).norm() / lb.norm()).item())
                    s["total"] += 1
                    if outs[a][rid] == outs[b][rid]:
                        s["agree"] += 1
                        continue
                    top2 = lb.topk(2).values
                    s["margins"].append(round((top2[0] - top2[1]).item(), 4))
                    s["diffs"].append(round((la - lb).abs().max().item(), 4))
                    if oracle is None:
                        s["diverged"].add(rid)
                if oracle is not None:
                    for n in names:
                        if outs[n][rid] != outs[oracle][rid]:
                            req = engines[n].scheduler.requests.get(rid)
                            if req is not None:          # finished requests are gone
                                req.token_ids[-1] = outs[oracle][rid]
                            seqs[n][rid][-1] = outs[oracle][rid]
    finally:
        for r in runners.values():
            del r.execute
    result = {"_continuations": seqs} if oracle is None else {}
    for (a, b), s in st.items():
        result[f"{a}_vs_{b}"] = {
            "token_agreement": round(s["agree"] / s["total"], 5), "tokens_compared": s["total"],
            "logits_rel_err_median": round(statistics.median(s["errs"]), 6),
            "logits_rel_err_max": round(max(s["errs"]), 6),
            "continuations_identical": None if oracle else round(
                sum(seqs[a][k] == seqs[b][k] for k in seqs[a]) / len(prompts), 4),
            "flip_ref_margins": s["margins"][:12], "flip_max_abs_logit_diff": s["diffs"][:12]}
    return result


def alone(runner: ModelRunner, prompts, tokens: int) -> dict[str, list[int]]:
    """Greedy continuations with each prompt run by itself (one sequence at a time, lockstep's other
    settings): the batch-invariance control. The same code and weights, only the batch around each
    row differs, so GEMM and attention kernels pick other tilings and reduction orders."""
    cfg = dataclasses.replace(runner.cfg, max_num_batched_tokens=1024, async_scheduling=False, max_num_seqs=1)
    engine = Engine(cfg, runner)
    seqs = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)))
    while engine.has_work:
        for o in engine.step().outputs:
            seqs[o.request_id].extend(o.new_token_ids)
    return seqs


def check_sampling(emit) -> None:
    import flashinfer
    from engine.sampler import sample
    torch.manual_seed(0)
    logits = torch.randn(64, 1000, device="cuda") * 3
    greedy = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=0.8, top_k=50)
              for i in range(64)]                    # a mixed batch: greedy rows stay argmax
    mixed = sample(logits, params, [None] * 64, flashinfer)
    ok_greedy = all(mixed[i] == greedy[i] for i in range(1, 64, 2))
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * 995, device="cuda")
    n = 20000
    p = [SamplingParams(temperature=1.0, top_k=4, top_p=1.0)] * n
    toks = torch.tensor(sample(row.expand(n, -1).contiguous(), p, [None] * n, flashinfer))
    freq = torch.bincount(toks, minlength=1000)[:5].float() / n
    expect = torch.softmax(row[:4].cpu(), -1)
    max_dev = (freq[:4] - expect).abs().max().item()
    emit(metric="sampling", greedy_rows_argmax=ok_greedy, topk4_freq=freq.tolist(),
         topk4_expected=expect.tolist(), max_abs_freq_dev=round(max_dev, 4),
         outside_top_k=int(freq[4].item() * n), passed=bool(ok_greedy and max_dev < 0.02 and freq[4] == 0))


def compare(emit, name: str, model_dir: Path, load_format: str, dtype: str, num_prompts: int, tokens: int,
            fp8_kv: bool = False, xqa: bool = False, attention_only: bool = False,
            batch_control: bool = False) -> None:
    """Both passes for one model and dtype; emits a record for each. Optional runners, compared
    against the same references: fp8_kv adds fast_fp8, the fast path with an fp8 KV cache; xqa adds
    fast_xqa (and fast_fp8_xqa), the fast path with the XQA decode kernel; attention_only adds
    fi_attn, FlashInfer attention in an otherwise torch model (no fused kernels, no graphs), which
    splits fast_vs_ref into the attention kernels' share and the rest's. batch_control reruns fast
    and ref with each prompt alone and reports how many continuations match the same engine's
    batched ones: the identity that an implementation reaches against itself."""
    base = EngineConfig(model=str(model_dir), load_format=load_format, dtype=dtype, num_blocks=2048,
                        max_model_len=4096, enable_prefix_caching=False, seed=7, cuda_graph_max_batch=64)
    fast = ModelRunner(dataclasses.replace(base, attention_backend="flashinfer", cuda_graphs=True))
    ref = ModelRunner(dataclasses.replace(base, attention_backend="torch", cuda_graphs=False))
    fp32 = ModelRunner(dataclasses.replace(base, attention_backend="torch", cuda_graphs=False, dtype="float32"))
    with torch.no_grad():                    # the same weights, upcast (dummy ones are drawn per dtype)
        for p32, p in zip(fp32.model.parameters(), ref.model.parameters()):
            p32.copy_(p.float())
    same_w = all(torch.equal(a, b) for a, b in zip(ref.model.parameters(), fast.model.parameters()))
    if name == TRAINED:
        prompts = _text_prompts(num_prompts, heldout_ids(model_dir), 11)
        info = json.loads((model_dir / "train_info.json").read_text())
        training = {k: info[k] for k in ("steps", "final_loss", "heldout_loss", "seconds")}
        training.update(corpus=info["recipe"]["corpus"], corpus_train_tokens=info["corpus"]["train_tokens"])
    else:
        prompts, training = _prompts(num_prompts, ref.model_config.vocab_size, 11), None
    common = dict(metric="backend_parity", model=name, dtype=dtype, prompts=len(prompts), new_tokens=tokens,
                  identical_weights=same_w, training=training, fast="flashinfer+fused kernels+cuda graphs",
                  ref="torch backend, same dtype", fp32="torch backend, float32 copy of the same weights")
    fi = dataclasses.replace(base, attention_backend="flashinfer", cuda_graphs=True)
    extra = {}
    if attention_only:
        extra["fi_attn"] = ModelRunner(dataclasses.replace(fi, cuda_graphs=False, fused_kernels=False))
    if xqa:
        extra["fast_xqa"] = ModelRunner(dataclasses.replace(fi, decode_kernel="xqa"))
    if fp8_kv:
        extra["fast_fp8"] = ModelRunner(dataclasses.replace(fi, kv_cache_dtype="fp8"))
    if fp8_kv and xqa:
        extra["fast_fp8_xqa"] = ModelRunner(dataclasses.replace(fi, kv_cache_dtype="fp8", decode_kernel="xqa"))
    runners = {"fast": fast, **extra, "ref": ref, "fp32": fp32}   # pair (a, b): b is the reference
    forced = lockstep(runners, prompts, tokens, oracle="fp32", references=("ref", "fp32"))
    free = lockstep(runners, prompts, tokens, oracle=None, references=("ref", "fp32"))
    batched = free.pop("_continuations")
    if batch_control:
        for n in ("fast", "ref"):
            solo = alone(runners[n], prompts, tokens)
            free[f"{n}_alone_vs_{n}_batched"] = {"continuations_identical": round(
                sum(solo[k] == batched[n][k] for k in solo) / len(prompts), 4)}
            free[f"{n}_alone_vs_fp32_batched"] = {"continuations_identical": round(
                sum(solo[k] == batched["fp32"][k] for k in solo) / len(prompts), 4)}
    f, r, fr = forced["fast_vs_fp32"], forced["ref_vs_fp32"], forced["fast_vs_ref"]
    passed = free["fast_vs_ref"]["continuations_identical"] >= 0.99 and fr["logits_rel_err_max"] <= 1e-2
    emit(**common, mode="teacher_forced_on_fp32", **forced, passed_issue_targets=passed,
         passed_fast_vs_ref=fr["token_agreement"] >= 0.99 and fr["logits_rel_err_max"] <= 1e-2,
         fast_as_accurate_as_ref=f["token_agreement"] >= r["token_agreement"] - 0.005
         and f["logits_rel_err_median"] <= 1.25 * r["logits_rel_err_median"])
    emit(**common, mode="free_running", **free, passed_issue_targets=passed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--models", default=f"{TRAINED},small-hd128,llama-3.2-1b")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--fp8-kv", action="store_true", help="also the fast path with an fp8 KV cache")
    ap.add_argument("--xqa", action="store_true", help="also the fast path with the XQA decode kernel")
    ap.add_argument("--batch-control", action="store_true",
                    help="also fast and ref with each prompt alone, against their own batched continuations")
    ap.add_argument("--attention-only", action="store_true",
                    help="also FlashInfer attention alone in the torch model (no fused kernels, no graphs)")
    args = ap.parse_args()
    emit = Emitter("correctness", args.out)
    for name in args.models.split(","):
        model_dir, load_format = _model_dir(name)
        for dtype in args.dtypes.split(","):
            compare(emit, name, model_dir, load_format, dtype, args.prompts, args.tokens, args.fp8_kv, args.xqa,
                    args.attention_only, args.batch_control)
            gc.collect()
            torch.cuda.empty_cache()
    if "small-hd128" in args.models:
        check_sampling(emit)


if __name__ == "__main__":
    main()
