"""The workloads of `splitserve bench serve` and `bench goodput`: named scenarios, random and corpus
prompts, Mooncake-style traces rebuilt from their prefix-block hash ids (or an Azure CSV's lengths,
each request a prompt of its own), and the request specs built from them.

Pure data in, `RequestSpec`s out; it knows nothing of clients or servers.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitserve.bench.clients import RequestSpec

SCENARIOS = {"1k1k": (1024, 1024), "1k8k": (1024, 8192), "8k1k": (8192, 1024)}
DEFAULT_CONCURRENCY = "1,4,16,64,256"
TRACE_BLOCK_TOKENS = 512
DEFAULT_REQUESTS_CAP = 1024
SCENARIO_RANGE_RATIO = 0.8  # InferenceMAX's --random-range-ratio for its scenarios


class BenchInputError(ValueError):
    """Bad flags or a bad trace file; reported to the user, exit status 2."""


# ---------------------------------------------------------------------------------------------
# Workload: what to send


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One Mooncake trace line, already scaled and capped."""

    timestamp_ms: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def parse_scenario(name: str) -> tuple[int, int]:
    """'1k8k' -> (1024, 8192). Accepts the InferenceMAX names and any '<a>k<b>k'."""
    name = name.strip().lower()
    if name in SCENARIOS:
        return SCENARIOS[name]
    parts = name.split("k")
    if len(parts) == 3 and parts[2] == "" and parts[0].isdigit() and parts[1].isdigit():
        return int(parts[0]) * 1024, int(parts[1]) * 1024
    raise BenchInputError(f"unknown scenario {name!r}; use one of {', '.join(SCENARIOS)}")


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchInputError(f"--concurrency wants comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise BenchInputError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


def default_num_requests(concurrency: int) -> int:
    return min(max(4 * concurrency, 16), DEFAULT_REQUESTS_CAP)


def random_prompt(seed: Sequence[int], length: int, vocab_size: int) -> np.ndarray:
    """`length` token ids uniform in [0, vocab_size), a pure function of `seed`."""
    return np.random.default_rng(list(seed)).integers(0, vocab_size, length, dtype=np.int32)


@functools.lru_cache(maxsize=8192)
def block_tokens(seed: tuple[int, ...], hash_id: int, block_size: int, vocab_size: int) -> np.ndarray:
    """The fixed token ids of one trace prefix block; equal (seed, hash_id) give equal tokens."""
    tokens = random_prompt((*seed, hash_id), block_size, vocab_size)
    tokens.flags.writeable = False  # shared through the cache
    return tokens


def trace_prompt(hash_ids: Sequence[int], input_len: int, block_size: int, vocab_size: int,
                 seed: tuple[int, ...]) -> np.ndarray:
    """A prompt of exactly `input_len` tokens: the hash ids' blocks concatenated.

    Every block but the last is `block_size` tokens; the last is what remains
    (`input_len - block_size * (len(hash_ids) - 1)`), a prefix of that id's block, so requests that
    share leading ids share leading tokens. If the lengths disagree with the ids (scaling, capping),
    trailing blocks are dropped, or the last block is extended with tokens of its own.
    """
    if not hash_ids:
        return random_prompt((*seed, 1 << 62), input_len, vocab_size)
    parts: list[np.ndarray] = []
    remaining = input_len
    for i, hash_id in enumerate(hash_ids):
        if remaining <= 0:
            break
        block = block_tokens(seed, hash_id, block_size, vocab_size)
        if i == len(hash_ids) - 1 and remaining > block_size:
            extra = random_prompt((*seed, hash_id, 1), remaining - block_size, vocab_size)
            block = np.concatenate([block, extra])
        parts.append(block[:remaining])
        remaining -= len(parts[-1])
    return np.concatenate(parts)


def load_trace(path: str, scale: float = 1.0, max_input_len: int | None = None,
               limit: int | None = None) -> tuple[list[TraceRow], int]:
    """Read a Mooncake JSONL trace or an Azure CSV; returns the rows and the (scaled) block size in tokens.

    Lengths and the block size are multiplied by `scale` together (at least 1 token each);
    `max_input_len` then caps the input length.
    """
    if scale <= 0:
        raise BenchInputError(f"--trace-scale must be > 0, got {scale}")
    block_size = max(1, round(TRACE_BLOCK_TOKENS * scale))
    if _is_azure_csv(path):
        return _azure_rows(path, scale, max_input_len, limit, block_size), block_size
    rows: list[TraceRow] = []
    try:
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if limit is not None and len(rows) >= limit:
                    break
                try:
                    obj = json.loads(line)
                    input_len = max(1, round(obj["input_length"] * scale))
                    if max_input_len is not None:
                        input_len = min(input_len, max_input_len)
                    rows.append(TraceRow(float(obj["timestamp"]), input_len,
                                         max(1, round(obj["output_length"] * scale)),
                                         tuple(int(h) for h in obj.get("hash_ids", ()))))
                except (ValueError, KeyError, TypeError) as e:
                    raise BenchInputError(f"{path}:{line_no}: bad trace line ({e})") from None
    except OSError as e:
        raise BenchInputError(f"cannot read trace {path}: {e}") from None
    if not rows:
        raise BenchInputError(f"trace {path} has no requests")
    return rows, block_size


AZURE_BLOCK_ID_BASE = 1 << 40   # the Azure trace's own block ids, apart from any Mooncake id


def _is_azure_csv(path: str) -> bool:
    try:
        with open(path) as f:
            return f.readline().startswith("TIMESTAMP")
    except OSError as e:
        raise BenchInputError(f"cannot read trace {path}: {e}") from None


def _azure_rows(path: str, scale: float, max_input_len: int | None, limit: int | None,
                block_size: int) -> list[TraceRow]:
    """An Azure LLM inference CSV as trace rows. It records lengths, not content: each request gets
    block ids of its own (AZURE_BLOCK_ID_BASE + row * 2^20 + block), so no two share a prefix."""
    from sim.workload import WorkloadError, load_workload
    try:
        w = load_workload(path)
    except WorkloadError as e:
        raise BenchInputError(str(e)) from None
    n = len(w) if limit is None else min(limit, len(w))
    rows = []
    for i in range(n):
        input_len = max(1, round(int(w.prompt[i]) * scale))
        if max_input_len is not None:
            input_len = min(input_len, max_input_len)
        first = AZURE_BLOCK_ID_BASE + (i << 20)
        rows.append(TraceRow(float(w.arrival_s[i]) * 1000.0, input_len,
                             max(1, round(int(w.output[i]) * scale)),
                             tuple(range(first, first + -(-input_len // block_size)))))
    return rows


def random_lengths(seed: Sequence[int], isl: int, osl: int, range_ratio: float) -> tuple[int, int]:
    """(input, output) lengths drawn independently, each uniform over the integers
    [floor(range_ratio * N), N] for N = isl, osl (at least 1): vLLM benchmark_serving's random
    dataset as InferenceMAX runs it. A pure function of `seed`; ratio 1 gives exactly (isl, osl)."""
    if range_ratio == 1.0:
        return isl, osl
    rng = np.random.default_rng(list(seed))
    low_in, low_out = (max(1, math.floor(range_ratio * n)) for n in (isl, osl))
    return int(rng.integers(low_in, isl, endpoint=True)), int(rng.integers(low_out, osl, endpoint=True))


class TextCorpus:
    """Text prompts as aiperf builds them: the corpus is tokenized once with the model's tokenizer,
    and a prompt of N tokens is a window of N corpus tokens at a seeded random offset, decoded back
    to text. The server tokenizes that text again, inside the measured time."""

    SUFFIXES = (".txt", ".md", ".py", ".rst")

    def __init__(self, path: str, tokenizer: str) -> None:
        from tokenizers import Tokenizer       # the client needs no model: only its tokenizer.json
        root = Path(path)
        files = sorted(f for f in root.rglob("*") if f.suffix in self.SUFFIXES) if root.is_dir() else [root]
        texts = []
        for f in files:
            try:
                texts.append(f.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                if not root.is_dir():
                    raise BenchInputError(f"cannot read corpus {f}: {e}") from None
        if not texts:
            raise BenchInputError(f"corpus {path} holds no text ({', '.join(self.SUFFIXES)} files)")
        tok_path = Path(tokenizer)
        if tokenizer.startswith("tiny"):
            from splitserve.models import resolve_model
            tok_path = Path(resolve_model(tokenizer))
        if tok_path.is_dir():
            tok_path = tok_path / "tokenizer.json"
        if not tok_path.is_file():
            raise BenchInputError(f"--tokenizer {tokenizer}: no tokenizer.json there")
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        self.ids = np.array([t for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)
                             for t in e.ids], dtype=np.int64)
        if len(self.ids) < 16:
            raise BenchInputError(f"corpus {path} is too short ({len(self.ids)} tokens)")

    def prompt(self, seed: Sequence[int], length: int) -> str:
        rng = np.random.default_rng(list(seed))
        reps = -(-length // len(self.ids))          # a corpus shorter than the prompt wraps around
        ids = np.tile(self.ids, reps + 1) if reps else self.ids
        start = int(rng.integers(0, len(ids) - length + 1))
        return self.tokenizer.decode(ids[start:start + length].tolist(), skip_special_tokens=True)


def synthetic_specs(isl: int, osl: int, num_requests: int, vocab_size: int,
                    seed: tuple[int, ...], range_ratio: float = 1.0,
                    corpus: TextCorpus | None = None) -> list[RequestSpec]:
    """Random prompts; request i's lengths (see random_lengths) and prompt depend on (seed, i) only.
    The lengths have a seed of their own, so ratio 1 sends the same prompts as fixed lengths did.
    With a corpus the prompts are text windows of it (TextCorpus), else random token ids."""
    specs = []
    for i in range(num_requests):
        input_len, output_len = random_lengths((*seed, i, 1), isl, osl, range_ratio)
        make = functools.partial(corpus.prompt, (*seed, i), input_len) if corpus is not None else \
            functools.partial(random_prompt, (*seed, i), input_len, vocab_size)
        specs.append(RequestSpec(input_len, output_len, make))
    return specs


def trace_specs(rows: Sequence[TraceRow], block_size: int, vocab_size: int, seed: tuple[int, ...],
                speedup: float = 1.0) -> list[RequestSpec]:
    """One spec per trace row, arrival times relative to the first row and divided by `speedup`."""
    t0 = rows[0].timestamp_ms
    return [RequestSpec(r.input_len, r.output_len,
                        functools.partial(trace_prompt, r.hash_ids, r.input_len, block_size,
                                          vocab_size, seed),
                        (r.timestamp_ms - t0) / 1000.0 / speedup)
            for r in rows]


# ---------------------------------------------------------------------------------------------
# Measurement: what came back


