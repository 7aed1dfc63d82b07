"""The sampler's cost per step with each option on vs off (engine/sampler.py + sampling_state.py).

Per batch size and option set: the wall time of one step's sampling as the runner does it — build
the processors' inputs from the plan rows on the host, process the logits, sample, and wait for the
ids (and the logprobs) on the host — with random float32 logits of the 8B's vocabulary (128,256).
"off" is the fast path every step without options takes. Penalized rows have a 1,024-token sequence
(512 prompt + 512 output), as a 1k/1k request does halfway: the runner's penalty state
(`PenaltySlots`) is built from it once, before the timing, and each timed step gives every row one
new output token, as decoding does.

`--grammar-host`: the step loop's host time per step for 64 rows under a JSON-schema grammar
(tokenizer as below; an array of at least 16 of the decode stage's objects, so that no row finishes
in the steps timed), rows advanced by random allowed tokens, timed while no row has finished
(`timed_steps`; medians): "serial" accepts and fills row after
row on the step loop's thread (what the runner did before `GrammarMasks`); "thread" is what the step
loop spends handing the rows to the grammar thread (`submit`), with the fill's own time beside it
(`fill_ms`: the grammar thread's, overlapping the step loop's other work).

`--grammar-decode`: decode speed of the engine (dummy weights of the 8B architecture, the tiny
model's tokenizer padded to the 8B's vocabulary for xgrammar) at batch 1 and 64 with a JSON-schema
grammar on every request vs none (ignore_eos, same max_tokens). Grammar requests end early on a
stop token, after which the batch shrinks while the step time barely does: the like-for-like figure
is `full_step_ms`, the median time of the steps in which every request of the batch produced a token
(`full_steps` of them); `tok_per_s` is the whole run's output tokens per second.

GPU:  python3 bench/device/sampling_bench.py --out sampling.jsonl [--grammar-decode | --grammar-host]
CPU smoke (a small vocabulary, few iterations): python3 bench/device/sampling_bench.py --smoke [--grammar-decode | --grammar-host]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import Emitter  # noqa: E402  (also puts the repository on sys.path)
from engine.plan import PlanRow  # noqa: E402
from engine.sampler import sample_on_device, sample_step  # noqa: E402
from engine.sampling_state import PenaltySlots, build_processing  # noqa: E402
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


class Rows:
    """A batch's decode rows, one more output token each time `next()` is called: the first call's
    penalized rows give their whole sequence, the later ones only the new token (as the scheduler)."""

    def __init__(self, batch: int, p: SamplingParams, vocab: int, g: torch.Generator) -> None:
        self.p, self.vocab, self.g = p, vocab, g
        self.seqs = [torch.randint(0, vocab, (HISTORY,), generator=g).tolist() for _ in range(batch)]
        self.sent = [0] * batch

    def next(self) -> list[PlanRow]:
        rows = []
        for i, seq in enumerate(self.seqs):
            if self.sent[i]:
                seq.append(int(torch.randint(0, self.vocab, (), generator=self.g)))
            row = PlanRow(str(i), i, [seq[-1]], len(seq) - 1, [0], self.p, True, PROMPT)
            if self.p.penalized:
                row.unseen, row.unseen_from, self.sent[i] = seq[self.sent[i]:], self.sent[i], len(seq)
            rows.append(row)
        return rows


def step_once(logits, rows, params, device, vocab, fi, slots: PenaltySlots) -> None:
    proc = build_processing(rows, vocab, frozenset({2}), device, penalty_slots=slots)
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
            tokens, full, t0 = 0, [], time.perf_counter()
            while eng.has_work:
                t1 = time.perf_counter()
                n = sum(len(o.new_token_ids) for o in eng.step().outputs)
                if n == batch:
                    full.append(time.perf_counter() - t1)
                tokens += n
            dt = time.perf_counter() - t0
            emit(stage="grammar_decode", batch=batch, grammar=grammar, output_tokens=tokens,
                 seconds=round(dt, 3), tok_per_s=round(tokens / dt, 1), max_tokens=max_tokens,
                 full_steps=len(full), full_step_ms=round(statistics.median(full) * 1e3, 3) if full else None,
                 async_scheduling=eng.async_scheduling, cuda_graphs=runner.use_cuda_graphs)


def grammar_host(emit, smoke: bool, vocab: int, batch: int, steps: int, threads: list[int]) -> None:
    import json
    import tempfile
    from pathlib import Path

    import transformers

    from engine.grammar import GrammarMasks, Grammars, allocate_bitmask
    from engine.sampler import unpack_bitmask
    from runtime.types import GrammarKind, GrammarSpec
    from splitserve.tiny_model import BOS_ID, EOS_ID, write_tiny_model
    tok = transformers.AutoTokenizer.from_pretrained(write_tiny_model(Path(tempfile.mkdtemp()) / "t", "llama", seed=0))
    grammars = Grammars(tok, vocab, stop_token_ids=[EOS_ID])
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(
        {"type": "object", "properties": {"rows": {"type": "array", "minItems": 16, "items": SCHEMA}},
         "required": ["rows"], "additionalProperties": False}))
    p = SamplingParams(temperature=1.0, grammar=spec)
    g = torch.Generator().manual_seed(0)

    def advance(mask: torch.Tensor, seqs: list[list[int]]) -> None:
        """Each unfinished row takes a random allowed token (outside the timing)."""
        allowed = unpack_bitmask(mask, vocab)
        for m, seq in enumerate(seqs):
            if seq[-1] != EOS_ID:
                seq.append(int(torch.multinomial(allowed[m].float(), 1, generator=g)))

    for side in ["serial"] + [f"thread_{t}" for t in threads]:      # the same random walk each side
        g.manual_seed(0)
        seqs = [[BOS_ID] for _ in range(batch)]                      # a 1-token prompt each
        host, fill = [], []
        if side == "serial":
            states = [grammars.matcher(spec) for _ in range(batch)]
            for _ in range(steps):
                t0 = time.perf_counter()
                mask = allocate_bitmask(batch, vocab)
                for m, (st, seq) in enumerate(zip(states, seqs)):
                    if len(seq) > 1:
                        st.accept(seq[-1])
                    if not st.terminated:
                        st.fill_bitmask(mask, m)
                if all(seq[-1] != EOS_ID for seq in seqs):
                    host.append(time.perf_counter() - t0)
                advance(mask, seqs)
        else:
            masks, sent = GrammarMasks(grammars, int(side.split("_")[1])), [0] * batch
            for _ in range(steps):
                rows = []
                for m, seq in enumerate(seqs):
                    rows.append(PlanRow(str(m), m, [seq[-1]], len(seq) - 1, [0], p, True, 1, seq[sent[m]:], sent[m]))
                    sent[m] = len(seq)
                t0 = time.perf_counter()
                job = masks.submit(rows, None)
                t1 = time.perf_counter()
                mask = job.result()[1]
                if all(seq[-1] != EOS_ID for seq in seqs):
                    fill.append(time.perf_counter() - t1)
                    host.append(t1 - t0)
                advance(mask, seqs)
        emit(stage="grammar_host", side=side, batch=batch, vocab=vocab, steps=steps, timed_steps=len(host),
             step_loop_ms=round(statistics.median(host) * 1e3, 3),
             fill_ms=round(statistics.median(fill) * 1e3, 3) if fill else None,
             finished_rows=sum(seq[-1] == EOS_ID for seq in seqs), smoke=smoke)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="CPU-sized: vocab 4096, batches 1,8, 3 iterations")
    ap.add_argument("--grammar-decode", action="store_true", help="only the engine decode with / without a grammar")
    ap.add_argument("--grammar-host", action="store_true",
                    help="only the step loop's host time for the grammar masks of 64 rows (serial vs the grammar thread)")
    ap.add_argument("--grammar-threads", default="1,4", help="--grammar-host: xgrammar threads to try")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    if args.grammar_decode:
        grammar_decode(Emitter("sampling_bench", args.out), args.smoke, [1, 4] if args.smoke else [1, 64],
                       16 if args.smoke else args.max_tokens)
        return
    if args.grammar_host:
        grammar_host(Emitter("sampling_bench", args.out), args.smoke, 4096 if args.smoke else args.vocab, 64,
                     5 if args.smoke else 100, [int(t) for t in args.grammar_threads.split(",")])
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
            rows, slots = Rows(batch, p, args.vocab, g), PenaltySlots(args.vocab, device)
            params = [p] * batch
            for _ in range(2):                   # the first builds the penalty state from the whole sequence
                step_once(logits, rows.next(), params, device, args.vocab, fi, slots)
            times = []
            for _ in range(args.iters):
                step_rows = rows.next()          # the scheduler's work, outside the timing
                t0 = time.perf_counter()
                step_once(logits, step_rows, params, device, args.vocab, fi, slots)
                times.append((time.perf_counter() - t0) * 1e6)
            us = statistics.median(times)
            if name == "off_sampled":
                base = us
            emit(batch=batch, vocab=args.vocab, option=name, step_us=round(us, 1),
                 over_off_sampled_us=None if base is None or name.startswith("off") else round(us - base, 1),
                 iters=args.iters, flashinfer=fi is not None)


if __name__ == "__main__":
    main()
