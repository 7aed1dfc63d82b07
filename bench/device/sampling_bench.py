"""The sampler's cost per step with each option on vs off (engine/sampler.py + sampling_state.py).

Per batch size and option set: the wall time of one step's sampling as the runner does it — build
the processors' inputs from the plan rows on the host, process the logits, sample, and wait for the
ids (and the logprobs) on the host — with random float32 logits of the 8B's vocabulary (128,256).
"off" is the fast path every step without options takes. Penalized rows carry a 1,024-token history
(512 prompt + 512 output), as a 1k/1k request does halfway.

`--grammar-decode`: decode throughput of the engine (dummy weights of the 8B architecture, the
tiny model's tokenizer padded to the 8B's vocabulary for xgrammar) at batch 1 and 64 with a
JSON-schema grammar on every request vs none (ignore_eos, same max_tokens). Grammar requests may end
early on a stop token: the figure is output tokens per second of the whole run, and each record
says how many tokens each side generated.

GPU:  python3 bench/device/sampling_bench.py --out sampling.jsonl [--grammar-decode]
CPU smoke (a small vocabulary, few iterations): python3 bench/device/sampling_bench.py --smoke [--grammar-decode]
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


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def grammar_decode(emit, smoke: bool, batches: list[int], max_tokens: int) -> None:
    import dataclasses
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from engine.engine import Engine
    from engine.loader import write_arch_dir
    from engine.model_runner import ModelRunner
    from runtime.config import EngineConfig
    from runtime.types import EngineRequest, GrammarKind, GrammarSpec
    from splitserve.tiny_model import write_tiny_model
    tmp = Path(tempfile.mkdtemp())
    tiny = write_tiny_model(tmp / "tiny", "llama", seed=0)
    small = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                 intermediate_size=512) if smoke else {}
    d = write_arch_dir("llama-3.1-8b", tmp / "m", **small)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny) / f, d / f)
    cfg = EngineConfig(model=str(d), load_format="dummy", max_model_len=4096, seed=1,
                       **({"device": "cpu", "attention_backend": "torch", "num_blocks": 512} if smoke else {}))
    runner = ModelRunner(cfg)
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        prompts = [torch.randint(1000, 100000, (128,), generator=g).tolist() for _ in range(batch)]
        for grammar in (False, True, False, True):       # interleaved: drift shows as a gap between pairs
            eng = Engine(dataclasses.replace(cfg), runner)
            for i, p in enumerate(prompts):
                sp = SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=not grammar,
                                    grammar=spec if grammar else None)
                out = eng.add_request(EngineRequest(f"{batch}-{grammar}-{i}", p, sp))
                assert out is None, out.error
            while eng.stats().num_running < batch and eng.has_work:     # prefill outside the timing
                eng.step()
            tokens, t0 = 0, time.perf_counter()
            while eng.has_work:
                tokens += sum(len(o.new_token_ids) for o in eng.step().outputs)
            dt = time.perf_counter() - t0
            emit(stage="grammar_decode", batch=batch, grammar=grammar, output_tokens=tokens,
                 seconds=round(dt, 3), tok_per_s=round(tokens / dt, 1), max_tokens=max_tokens,
                 async_scheduling=eng.async_scheduling, cuda_graphs=runner.use_cuda_graphs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="CPU-sized: vocab 4096, batches 1,8, 3 iterations")
    ap.add_argument("--grammar-decode", action="store_true", help="only the engine decode with / without a grammar")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    if args.grammar_decode:
        grammar_decode(Emitter("sampling_bench", args.out), args.smoke, [1, 4] if args.smoke else [1, 64],
                       16 if args.smoke else args.max_tokens)
        return
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
