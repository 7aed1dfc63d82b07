"""`splitserve profile --out FILE`: measure one worker's engine and write a performance profile
(format 2, perf/profile.py) that the planner sizes pools with and the mock engine replays.

It drives the real engine (`Engine.step()`, the worker's own loop without gRPC), on the GPU, the
CPU or the mock, with the engine flags of a worker (`--model`, `--device`, `--mock`, ...):

- prefill: for each prompt length T and cached fraction f, the prefix f*T (whole KV blocks) is
  first computed by a one-token request, then a request of T tokens sharing it is timed from its
  submission to its first token (a whole, chunked prefill: what the profile's prefill table holds);
  fresh random tokens for every measurement, the median of --repeats;
- decode: for each batch B and context C, B requests of C random tokens are prefilled, then
  --steps engine steps in which all B decode are timed: seconds per step = the inter-token latency
  at (B, C) (the first prompts of a large batch decode while the last ones prefill, so their
  context is C plus up to B*C/max_num_batched_tokens tokens). A cell whose B x C tokens do not fit the engine's KV cache cannot run; it is filled by
  extrapolating the context row linearly in the batch from the two largest batches that fit, and
  listed under `extrapolated` (a planner never plans a batch past the KV capacity anyway).

The file also records the engine's KV capacity in tokens, its max_num_seqs and
max_num_batched_tokens, the weights' quantization ("none" | "fp8": a planner takes the profile of
the weights its workers run) and the tensor-parallel size (`--tensor-parallel-size N`: a worker over N
GPUs; a planner takes the profile of its pools' sizes and counts N GPUs per worker); --startup-s, if given, the start-to-ready to plan with (else readers use
perf.profile.DEFAULT_STARTUP_S). Throughputs are derived by readers, never stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from runtime.cli_args import add_config_args, config_from_args
from runtime.config import EngineConfig
from runtime.config_fields import ConfigError
from runtime.errors import InvalidRequest
from runtime.model_config import ModelConfig
from runtime.quantization import quantization_name, resolve_quantization
from perf.profile import PROFILE_FORMAT, load_profile, profile_json
from splitserve.bench.records import git_sha

DEFAULTS = {"prefill_tokens": "128,512,2048,8192", "cached_fractions": "0,0.5,0.9",
            "decode_batches": "1,8,32,128", "decode_contexts": "512,2048,8192"}
MAX_STEPS_PER_REQUEST = 100_000      # a guard: a measurement never loops forever


def _ints(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not out or out[0] <= 0:
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return out


def _fractions(text: str) -> list[float]:
    try:
        out = sorted({float(x) for x in text.split(",") if x.strip()} | {0.0})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if out[-1] >= 1.0 or out[0] < 0:
        raise argparse.ArgumentTypeError(f"cached fractions must lie in [0, 1): {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--prefill-tokens", type=_ints, default=_ints(DEFAULTS["prefill_tokens"]),
                   help=f"prompt lengths (default {DEFAULTS['prefill_tokens']})")
    p.add_argument("--cached-fractions", type=_fractions, default=_fractions(DEFAULTS["cached_fractions"]),
                   help=f"cached shares of the prompt (0 always included; default {DEFAULTS['cached_fractions']})")
    p.add_argument("--decode-batches", type=_ints, default=_ints(DEFAULTS["decode_batches"]),
                   help=f"decode batch sizes (default {DEFAULTS['decode_batches']})")
    p.add_argument("--decode-contexts", type=_ints, default=_ints(DEFAULTS["decode_contexts"]),
                   help=f"decode context lengths (default {DEFAULTS['decode_contexts']})")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per (batch, context)")
    p.add_argument("--repeats", type=int, default=3, help="prefill measurements per cell (the median)")
    p.add_argument("--startup-s", type=float, default=None, help="start-to-ready to record (seconds)")
    p.add_argument("--name", default=None, help="the profile's name (default: the file's stem)")
    p.add_argument("--note", default="", help="a note stored in the file (device, command, ...)")
    add_config_args(p, EngineConfig, config_file=False)


def main(args: argparse.Namespace) -> int:
    from splitserve.models import resolve_model
    try:
        cfg = config_from_args(EngineConfig, args)
        cfg = dataclasses.replace(cfg, model=resolve_model(cfg.model))
        if args.steps < 1 or args.repeats < 1:
            raise ConfigError("--steps and --repeats must be at least 1")
    except (ConfigError, InvalidRequest) as e:
        print(f"splitserve profile: {getattr(e, 'message', e)}", file=sys.stderr)
        return 2
    from engine.engine import Engine
    t0 = time.perf_counter()
    engine = Engine(cfg)
    p = Profiler(engine, seed=cfg.seed)
    p.warm_up(min(args.prefill_tokens))
    kv_tokens = engine.pool.num_blocks * cfg.block_size
    longest = max(max(args.prefill_tokens), max(args.decode_contexts) + args.steps + 2)
    if longest >= engine.max_model_len:
        print(f"splitserve profile: {longest} tokens do not fit the engine's context of {engine.max_model_len}",
              file=sys.stderr)
        return 2
    print(f"profiling {Path(cfg.model).name} on {'mock' if cfg.mock else engine.runner.device} "
          f"(KV {kv_tokens} tokens, ready in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    prefill = [[p.prefill_s(t, f, args.repeats) for f in args.cached_fractions] for t in args.prefill_tokens]
    print("prefill done", file=sys.stderr)
    decode, extrapolated = p.decode_table(args.decode_batches, args.decode_contexts, args.steps, kv_tokens)
    spec = {
        "format": PROFILE_FORMAT,
        "name": args.name or Path(args.out).stem,
        "device": "mock (" + (cfg.mock_profile or "the H100 8B curve") + ")" if cfg.mock else _device(engine),
        "model": Path(cfg.model).name,
        "source": "splitserve profile " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["profile"] else sys.argv[1:]),
        "note": args.note,
        "git_sha": git_sha(),
        "machine": f"{platform.node()} ({platform.machine()})",
        "kv_capacity_tokens": kv_tokens,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "quantization": _quantization(cfg),
        "tensor_parallel_size": cfg.tensor_parallel_size,     # the GPUs a worker measured here holds
        "prefill": {"tokens": args.prefill_tokens, "cached_fraction": args.cached_fractions,
                    "time_s": [[round(x, 6) for x in row] for row in prefill]},
        "decode": {"batch_size": args.decode_batches, "context_len": args.decode_contexts,
                   "time_s": [[round(x, 6) for x in row] for row in decode]},
        "extrapolated": extrapolated,
        "profile_wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.startup_s is not None:
        spec["startup_s"] = args.startup_s
    Path(args.out).write_text(profile_json(spec))
    engine.close()                    # a tensor-parallel engine's other ranks
    load_profile(args.out)            # what we wrote reads back
    print(json.dumps({"profile": args.out, "wall_s": spec["profile_wall_s"], "kv_capacity_tokens": kv_tokens,
                      "extrapolated": len(extrapolated)}))
    return 0


def _quantization(cfg: EngineConfig) -> str:
    """The workers' weights this profile describes ("none" | "fp8"): the planner picks profiles by it."""
    return quantization_name(resolve_quantization(ModelConfig.from_dir(cfg.model).quantization, cfg.quantization))


class Profiler:
    """Timed requests on one engine, run to completion one measurement at a time."""

    def __init__(self, engine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = max(int(engine.runner.model_config.vocab_size) - 1, 2)
        self._n = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(n)]

    def _submit(self, prompt: list[int], max_tokens: int) -> str:
        from runtime.types import EngineRequest, SamplingParams
        self._n += 1
        rid = f"profile-{self._n}"
        err = self.engine.add_request(EngineRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                                ignore_eos=True)))
        if err is not None:
            raise RuntimeError(f"the engine refused a profiling request: {err.error}")
        return rid

    def _run(self, until) -> None:
        """Step until `until(outputs so far)` holds (each step's outputs are fed to it)."""
        for _ in range(MAX_STEPS_PER_REQUEST):
            if until(self.engine.step().outputs):
                return
        raise RuntimeError("a profiling measurement did not finish")

    def warm_up(self, tokens: int) -> None:
        """One untimed request (first-call costs: allocations, kernels' first launch, JIT)."""
        self._submit(self._tokens(tokens), 4)
        self._finish_all()

    def _finish_all(self) -> None:
        while self.engine.has_work:
            self.engine.step()

    def prefill_s(self, tokens: int, fraction: float, repeats: int) -> float:
        block = self.engine.cfg.block_size
        cached = int(tokens * fraction) // block * block
        times = []
        for _ in range(repeats):
            prompt = self._tokens(tokens)
            if cached:
                rid = self._submit(prompt[:cached], 1)
                self._run(lambda outs, rid=rid: any(o.request_id == rid and o.finish_reason for o in outs))
                self._finish_all()
            t0 = time.perf_counter()
            rid = self._submit(prompt, 1)
            self._run(lambda outs, rid=rid: any(o.request_id == rid and o.new_token_ids for o in outs))
            times.append(time.perf_counter() - t0)
            self._finish_all()
        return statistics.median(times)

    def decode_len(self, batch: int, context: int, steps: int) -> int:
        """Tokens each decode request generates: the timed steps, plus the steps in which the
        batch's later prompts still prefill (the first ones decode meanwhile and must not finish)."""
        cfg = self.engine.cfg
        return -(-batch * context // cfg.max_num_batched_tokens) + steps + 8

    def decode_s(self, batch: int, context: int, steps: int) -> float:
        n = self.decode_len(batch, context, steps)
        ids = {self._submit(self._tokens(context), n) for _ in range(batch)}
        started: set[str] = set()

        def all_decoding(outs) -> bool:
            started.update(o.request_id for o in outs if o.request_id in ids and o.new_token_ids)
            return started == ids
        self._run(all_decoding)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        dt = (time.perf_counter() - t0) / steps
        self._finish_all()
        return dt

    def decode_table(self, batches: list[int], contexts: list[int], steps: int,
                     kv_tokens: int) -> tuple[list[list[float]], list[list[int]]]:
        block = self.engine.cfg.block_size
        max_seqs = self.engine.cfg.max_num_seqs
        table = {}
        for c in contexts:
            for b in batches:
                need = b * (-(-(c + self.decode_len(b, c, steps)) // block)) * block
                if need <= kv_tokens and b <= max_seqs:
                    table[b, c] = self.decode_s(b, c, steps)
            print(f"decode context {c} done", file=sys.stderr)
        extrapolated = []
        for c in contexts:
            fit = [b for b in batches if (b, c) in table]
            if not fit:
                raise RuntimeError(f"no decode batch of context {c} fits the KV cache ({kv_tokens} tokens): "
                                   "lower --decode-contexts")
            for b in batches:
                if (b, c) in table:
                    continue
                if len(fit) == 1:
                    table[b, c] = table[fit[0], c] * b / fit[0]
                else:
                    b1, b2 = fit[-2], fit[-1]
                    slope = (table[b2, c] - table[b1, c]) / (b2 - b1)
                    table[b, c] = table[b2, c] + slope * (b - b2)
                extrapolated.append([b, c])
        return [[table[b, c] for c in contexts] for b in batches], extrapolated


def _device(engine) -> str:
    dev = engine.runner.device
    if dev.type == "cuda":
        import torch
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()})"

