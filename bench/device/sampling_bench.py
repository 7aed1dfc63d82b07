"""The sampler's cost per step with each option on vs off (engine/sampler.py + sampling_state.py).

Per batch size and option set: the wall time of one step's sampling as the runner does it — build
the processors' inputs from the plan rows on the host, process the logits, sample, and wait for the
ids (and the logprobs) on the host — with random float32 logits of the 8B's vocabulary (128,256).
"off" is the fast path every step without options takes. Penalized rows carry a 1,024-token history
(512 prompt + 512 output), as a 1k/1k request does halfway.

GPU:  python3 bench/device/sampling_bench.py --out sampling.jsonl
CPU smoke (a small vocabulary, few iterations): python3 bench/device/sampling_bench.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import Emitter  # noqa: E402  (also puts the repository on sys.path)
from engine.plan import PlanRow  # noqa: E402
from engine.sampler import sample_on_device, sample_step  # noqa: E402
from engine.sampling_state import build_processing  # noqa: E402
from runtime.types import SamplingParams  # noqa: E402

HISTORY, PROMPT = 1024, 512
OPTIONS = {
    "off_greedy": dict(temperature=0.0),
    "off_sampled": dict(temperature=0.8, top_p=0.95),
    "logprobs_0": dict(temperature=0.8, top_p=0.95, logprobs=0),
    "logprobs_5": dict(temperature=0.8, top_p=0.95, logprobs=5),
    "logprobs_20": dict(temperature=0.8, top_p=0.95, logprobs=20),
    "logit_bias_8": dict(temperature=0.8, top_p=0.95, logit_bias=tuple((t * 97, 1.5) for t in range(8))),
    "min_p": dict(temperature=0.8, top_p=0.95, min_p=0.05),
    "min_tokens": dict(temperature=0.8, top_p=0.95, min_tokens=10 ** 6),
    "penalties": dict(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.5,
                      repetition_penalty=1.1),
    "all": dict(temperature=0.8, top_p=0.95, logprobs=5, logit_bias=((7, 1.0),), min_p=0.05,
                min_tokens=10 ** 6, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
}


def rows_for(batch: int, p: SamplingParams, vocab: int, g: torch.Generator) -> list[PlanRow]:
    rows = []
    for i in range(batch):
        hist = torch.randint(0, vocab, (HISTORY,), generator=g).tolist()
        rows.append(PlanRow(str(i), i, [hist[-1]], HISTORY - 1, [0], p, True, PROMPT,
                            hist if p.penalized else None))
    return rows


def step_once(logits, rows, params, device, vocab, fi) -> None:
    proc = build_processing(rows, vocab, frozenset({2}), device)
    gens = [None] * len(rows)
    if proc is None:
        sample_on_device(logits, params, gens, fi).tolist()
        return
    s = sample_step(logits, params, gens, fi, proc)
    s.tokens.tolist()
    if s.logprobs is not None:
        s.logprobs.tolist()
        if s.top_ids is not None:
            s.top_ids.tolist()
            s.top_logprobs.tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="CPU-sized: vocab 4096, batches 1,8, 3 iterations")
    args = ap.parse_args()
    if args.smoke:
        args.vocab, args.batches, args.iters = 4096, "1,8", 3
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fi = None
    if device.type == "cuda":
        try:
            import flashinfer as fi
        except ImportError:
            fi = None
    emit = Emitter("sampling_bench", args.out)
    g = torch.Generator().manual_seed(0)
    for batch in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(batch, args.vocab, device=device) * 3
        base = None
        for name, kw in OPTIONS.items():
            p = SamplingParams(max_tokens=10 ** 6, **kw)
            rows = rows_for(batch, p, args.vocab, g)
            params = [p] * batch
            for _ in range(2):
                step_once(logits, rows, params, device, args.vocab, fi)
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                step_once(logits, rows, params, device, args.vocab, fi)
                times.append((time.perf_counter() - t0) * 1e6)
            us = statistics.median(times)
            if name == "off_sampled":
                base = us
            emit(batch=batch, vocab=args.vocab, option=name, step_us=round(us, 1),
                 over_off_sampled_us=None if base is None or name.startswith("off") else round(us - base, 1),
                 iters=args.iters, flashinfer=fi is not None)


if __name__ == "__main__":
    main()
