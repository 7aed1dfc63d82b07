"""Tensor-parallel parity: the same model unsplit (TP=1) and split over N ranks (TP=N), same random
weights (each rank draws the whole tensors and keeps its share), same prompts, greedy.

  python bench/device/tp_parity.py [--arch llama-3.1-8b] [--tp 2] [--out FILE]     # GPUs
  python bench/device/tp_parity.py --model tiny --device cpu --tp 2                  # the CPU, gloo

Per prompt: the relative error of the prompt's last-token logits (||TP=N - TP=1|| / ||TP=1||, float32
logits of the bf16 model), whether the top-1 token agrees, and how many greedy tokens agree before
the first difference (bf16 sums in another order may flip a near tie after many steps). One JSON
line per run with the summary (max relative error, tokens equal), and the git sha and device.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile
from pathlib import Path

import torch

from common import Emitter  # noqa: E402  (sets sys.path)
from engine.engine import Engine  # noqa: E402
from engine.loader import write_arch_dir  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.types import EngineRequest, SamplingParams  # noqa: E402


def run(cfg: EngineConfig, prompts: list[list[int]], new_tokens: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """(each prompt's last-token logits, each prompt's greedy continuation), one prompt at a time."""
    engine = Engine(cfg)
    runner = getattr(engine.runner, "inner", engine.runner)
    logits, tokens = [], []
    try:
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                                        ignore_eos=True)))
            got: list[int] = []
            first = None
            while engine.has_work:
                outs = engine.step().outputs
                if first is None and runner.last_logits is not None and outs:
                    first = runner.last_logits[0].float().cpu().clone()
                for o in outs:
                    got += o.new_token_ids
            logits.append(first)
            tokens.append(got)
    finally:
        engine.close()
    return logits, tokens


def agree(a: list[int], b: list[int]) -> int:
    """Greedy tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--model", default=None, help="an HF directory or tiny (instead of --arch's random weights)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prompts", default="16,128,1024,4096", help="prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quantization", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--tp-all-reduce", default="nccl", choices=["nccl", "symm_mem", "flashinfer"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model:
        from splitserve.models import resolve_model
        model_dir, load_format, name = resolve_model(args.model), "auto", args.model
    else:
        model_dir = str(write_arch_dir(args.arch, Path(tempfile.mkdtemp()) / args.arch))
        load_format, name = "dummy", args.arch
    lengths = [int(x) for x in args.prompts.split(",")]
    base = EngineConfig(model=model_dir, device=args.device, load_format=load_format, seed=0,
                        num_blocks=sum(lengths) // 16 + 4 * len(lengths) + 64, max_model_len=max(lengths) + 256,
                        max_num_batched_tokens=max(2048, min(max(lengths), 8192)), quantization=args.quantization,
                        enable_prefix_caching=False, tp_all_reduce=args.tp_all_reduce,
                        async_scheduling=False)   # the first logits read are the prefill's (same context)
    vocab = 4096 if args.model else 128256
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab - 10, (n,), generator=g).tolist() for n in lengths]
    ref_logits, ref_tokens = run(base, prompts, args.new_tokens)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    tp_logits, tp_tokens = run(dataclasses.replace(base, tensor_parallel_size=args.tp), prompts, args.new_tokens)
    emit = Emitter("tp_parity", args.out)
    rel = [float((a - b).norm() / b.norm()) for a, b in zip(tp_logits, ref_logits)]
    top1 = [int(a.argmax()) == int(b.argmax()) for a, b in zip(tp_logits, ref_logits)]
    agreed = [agree(a, b) for a, b in zip(tp_tokens, ref_tokens)]
    for n, r, t, k in zip(lengths, rel, top1, agreed):
        emit(metric="tp_parity_prompt", model=name, tensor_parallel_size=args.tp, quantization=args.quantization,
             tp_all_reduce=args.tp_all_reduce, prompt_tokens=n, logits_rel_err=float(f"{r:.3g}"), top1_equal=t,
             greedy_tokens_equal=k, new_tokens=args.new_tokens)
    emit(metric="tp_parity", model=name, tensor_parallel_size=args.tp, quantization=args.quantization,
         tp_all_reduce=args.tp_all_reduce, max_logits_rel_err=float(f"{max(rel):.3g}"), top1_equal=all(top1),
         tokens_equal=tp_tokens == ref_tokens, min_greedy_tokens_equal=min(agreed), new_tokens=args.new_tokens,
         prompts=lengths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
