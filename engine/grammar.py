"""Structured outputs: `GrammarSpec` (runtime/types.py) compiled with xgrammar, and a per-request
matcher that fills the next token's bitmask and accepts the sampled tokens.

`Grammars` owns one xgrammar compiler for the model's tokenizer and a cache of compiled grammars
keyed by the spec (equal specs compile once; the cache is bounded by count, least recently used
out). `Grammars.matcher(spec)` gives a `RequestGrammar` per request. The bitmask is packed as
engine/sampler.py's `apply_bitmask` reads it (int32 words, bit j of word w allows token 32w+j).

The runner (engine/model_runner.py) compiles at admission (`check_grammar`) and keeps one
`RequestGrammar` per request in a `GrammarMasks`, which fills each step's masks on its own thread:
a step's masks need the previous step's sampled ids, so filling them on the step loop's thread made
it wait for those ids and then fill row after row before it could queue the sampling. Now the runner
hands the rows over and goes on (the engine applies the previous step's results and schedules the
next one) while the thread waits for the ids, advances each matcher and fills all rows in one
xgrammar `BatchGrammarMatcher` call, which runs without the GIL (and on several threads when asked);
the step's sampling is queued once the masks are there, before the next step's forward pass.
Tests: tests/unit/engine/test_grammar.py (random logits of the tiny model's vocabulary, masked, sampled and
accepted token by token, give JSON that validates; the batched fill equals the per-row one) and
tests/unit/engine/test_sampling_options.py (through the engine, sync and async).
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.plan import PENDING_TOKEN, PlanRow
from runtime.types import GrammarKind, GrammarSpec


class GrammarError(ValueError):
    """The spec does not compile (a bad schema or structural tag): the request's fault, a 4xx."""


_KIND_TEXT = {GrammarKind.JSON_OBJECT: "JSON object grammar", GrammarKind.JSON_SCHEMA: "JSON schema",
              GrammarKind.STRUCTURAL_TAG: "structural tag"}
# xgrammar prefixes its messages with the time and its C++ source file and line:
# "[01:54:54] /project/cpp/json_schema_converter.cc:4944: Unsupported type "nope""
_SOURCE_PREFIX = re.compile(r"^\s*(?:\[[0-9:.]+\]\s*)?(?:\S+\.(?:cc|cpp|h|hpp|py):\d+:\s*)?")
MAX_MESSAGE_CHARS = 300


def client_message(e: Exception) -> str:
    """What a client is told of a compile error: the library's own words for each line, without its
    timestamps and source paths (which say nothing about the schema), at most MAX_MESSAGE_CHARS."""
    lines = [_SOURCE_PREFIX.sub("", line).strip() for line in str(e).splitlines()]
    text = "; ".join(line for line in lines if line) or type(e).__name__
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."


class Grammars:
    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                 cache_size: int = 256, max_threads: int = 2) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        # JSON never holds a raw control character (whitespace included: compact separators), and
        # xgrammar 0.2.8 lets one through right after a multi-byte character spelt in byte tokens
        # (seen with the tiny model's byte-level BPE): such tokens are masked out of JSON grammars
        self._json_mask = allocate_bitmask(1, vocab_size)
        for t, b in enumerate(info.decoded_vocab[:vocab_size]):
            if any(c < 0x20 for c in b):
                self._json_mask[0, t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._cache_size = cache_size
        self.compiles = 0                   # cache misses, for tests and metrics

    def compile(self, spec: GrammarSpec):
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return hit
        try:
            if spec.kind == GrammarKind.JSON_OBJECT:
                compiled = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.kind == GrammarKind.JSON_SCHEMA:
                json.loads(spec.spec)       # a clear error for text that is not JSON at all
                compiled = self._compiler.compile_json_schema(spec.spec, any_whitespace=False)
            elif spec.kind == GrammarKind.STRUCTURAL_TAG:
                compiled = self._compiler.compile_structural_tag(spec.spec)
            else:
                raise GrammarError(f"unknown grammar kind {spec.kind!r}")
        except GrammarError:
            raise
        except Exception as e:              # xgrammar raises several types for a bad spec
            raise GrammarError(f"the {_KIND_TEXT.get(spec.kind, 'grammar')} does not compile: "
                               f"{client_message(e)}") from e
        self.compiles += 1
        self._cache[spec] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> "RequestGrammar":
        mask = self._json_mask if spec.kind in (GrammarKind.JSON_OBJECT, GrammarKind.JSON_SCHEMA) else None
        return RequestGrammar(self._xgr, self._xgr.GrammarMatcher(self.compile(spec)), self.vocab_size, mask)


class RequestGrammar:
    """One request's place in its grammar."""

    def __init__(self, xgr, matcher, vocab_size: int, and_mask: torch.Tensor | None = None) -> None:
        self._xgr, self._m, self.vocab_size, self._and = xgr, matcher, vocab_size, and_mask

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of a (B, ceil(V/32)) int32 CPU tensor (one
        row; `GrammarMasks` fills a step's rows together)."""
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._and is not None:
            bitmask[row] &= self._and[0]

    @property
    def handle(self):
        """The xgrammar matcher (for `BatchGrammarMatcher`)."""
        return self._m

    @property
    def and_mask(self) -> torch.Tensor | None:
        """(1, W) packed tokens that stay allowed whatever the grammar says (None: all)."""
        return self._and

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (a bug upstream)."""
        return self._m.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The output is complete (a stop token was accepted at an accepting state)."""
        return self._m.is_terminated()


class GrammarMasks:
    """The grammar state of a runner's requests (a `RequestGrammar` each, by `PlanRow.key`) and the
    thread that fills their masks (module docstring). `threads`: xgrammar's threads for one fill
    (0: half the CPU cores, at most 8; a 64-row fill of a nested JSON schema took 37-51 ms on one
    thread of a busy 2-core CPU, `sampling_bench.py --grammar-host`)."""

    def __init__(self, grammars: Grammars, threads: int = 1, pinned: bool = False) -> None:
        if threads < 0:
            raise ValueError(f"grammar_threads must be 0 (auto) or more, got {threads}")
        self.grammars, self._pinned = grammars, pinned
        self.threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._batch = grammars._xgr.BatchGrammarMatcher(self.threads)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._state: dict[int, list] = {}        # key -> [RequestGrammar, tokens of its sequence seen]

    def __len__(self) -> int:
        return len(self._state)

    def release(self, key: int) -> None:
        self._state.pop(key, None)

    def submit(self, rows: list[PlanRow], prev) -> Future | None:
        """Start filling the masks of the grammar rows among `rows` (a step's sampling rows, in logits
        order); None if there are none. `prev`: the previous step (a LaunchedStep whose sampling is
        queued), whose ids the pending tokens are. The future's result: (the rows' places, their
        packed masks on the host)."""
        work = []
        for j, r in enumerate(rows):
            if r.sampling.grammar is None:
                continue
            if r.unseen is None:
                raise RuntimeError(f"grammar row {r.request_id} without its unseen tokens")
            st = self._state.get(r.key)
            if st is None:
                st = self._state[r.key] = [self.grammars.matcher(r.sampling.grammar), 0]
            if r.unseen_from != st[1]:
                raise RuntimeError(f"grammar of {r.request_id}: the plan gives tokens from {r.unseen_from}, "
                                   f"{st[1]} were accepted")
            outputs = r.unseen[max(0, r.num_prompt_tokens - r.unseen_from):]
            if PENDING_TOKEN in outputs and (prev is None or r.request_id not in prev.rows):
                raise RuntimeError(f"a pending token of {r.request_id} without the step that samples it")
            st[1] += len(r.unseen)
            work.append((j, r.request_id, st[0], outputs))
        if not work:
            return None
        return self._pool.submit(self._fill, work, prev)

    def _fill(self, work: list, prev) -> tuple[list[int], torch.Tensor]:
        sampled = None
        mask = allocate_bitmask(len(work), self.grammars.vocab_size, self._pinned)
        live, live_rows, and_rows, and_mask = [], [], [], None
        for m, (_, rid, g, outputs) in enumerate(work):
            for t in outputs:
                if t == PENDING_TOKEN:
                    if sampled is None:
                        sampled = prev.result()        # waits for the device, without the GIL
                    t = sampled[rid]
                g.accept(t)
            if not g.terminated:  # terminated: the stop token is pending, this step is discarded
                live.append(g.handle)
                live_rows.append(m)
                if g.and_mask is not None:
                    and_rows.append(m)
                    and_mask = g.and_mask
        if live:
            self._batch.batch_fill_next_token_bitmask(live, mask, live_rows)
        if and_rows:        # one mask for every JSON grammar (Grammars._json_mask)
            rows = torch.tensor(and_rows)
            mask[rows] = mask[rows] & and_mask
        return [w[0] for w in work], mask


def allocate_bitmask(batch: int, vocab_size: int, pinned: bool = False) -> torch.Tensor:
    return torch.full((batch, -(-vocab_size // 32)), -1, dtype=torch.int32, pin_memory=pinned)
