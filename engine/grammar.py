"""Structured outputs: `GrammarSpec` (runtime/types.py) compiled with xgrammar, and a per-request
matcher that fills the next token's bitmask and accepts the sampled tokens.

`Grammars` owns one xgrammar compiler for the model's tokenizer and a cache of compiled grammars
keyed by the spec (equal specs compile once; the cache is bounded by count, least recently used
out). `Grammars.matcher(spec)` gives a `RequestGrammar` per request. The bitmask is packed as
engine/sampler.py's `apply_bitmask` reads it (int32 words, bit j of word w allows token 32w+j).

The runner (engine/model_runner.py `check_grammar`, `_grammar_masks`) compiles at admission and
keeps one `RequestGrammar` per request. Tests: tests/unit/test_grammar.py (random logits of the tiny
model's vocabulary, masked, sampled and accepted token by token, give JSON that validates) and
tests/unit/test_sampling_options.py (through the engine, sync and async).
"""

from __future__ import annotations

import json
from collections import OrderedDict

import torch

from runtime.types import GrammarKind, GrammarSpec


class GrammarError(ValueError):
    """The spec does not compile (a bad schema or structural tag): the request's fault, a 4xx."""


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
            raise GrammarError(f"the {GrammarKind(spec.kind).name.lower()} grammar does not compile: {e}") from e
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
        """Write the allowed next tokens into row `row` of a (B, ceil(V/32)) int32 CPU tensor."""
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._and is not None:
            bitmask[row] &= self._and[0]

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (a bug upstream)."""
        return self._m.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The output is complete (a stop token was accepted at an accepting state)."""
        return self._m.is_terminated()


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    return torch.full((batch, -(-vocab_size // 32)), -1, dtype=torch.int32)
