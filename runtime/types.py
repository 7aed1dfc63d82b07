"""The value types that cross the engine boundary: what a request asks for and what a step gives back.

Plain data with no torch, so the control plane (frontend, router, planner, CLI) speaks the engine's
language without loading it: a worker turns protobuf into these (runtime/convert.py), the engine
consumes and produces them, the frontend validates into them. The engine's live request state
(engine/request.py) is built from them and never leaves the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NewType

RequestId = NewType("RequestId", str)
# Who submitted a request inside a worker process (the decode worker's Session stream, one per
# frontend); the engine only hands it back with the request's outputs.
SessionId = NewType("SessionId", int)


class GrammarKind(IntEnum):
    """What a `GrammarSpec.spec` holds (compiled worker-side by xgrammar, engine/grammar.py)."""
    JSON_OBJECT = 1         # any JSON object; spec unused
    JSON_SCHEMA = 2         # spec: the JSON schema, as JSON text
    STRUCTURAL_TAG = 3      # spec: an xgrammar structural tag, as JSON text (tool calls)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the output, as plain text: the frontend writes it, the worker compiles it.
    Equal specs share one compiled grammar (the worker's cache is keyed by this value)."""
    kind: GrammarKind
    spec: str = ""


class FinishReason(IntEnum):
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # logits processing, in this order on the device (engine/sampler.py): grammar bitmask,
    # min_tokens (stop tokens banned), logit_bias, penalties, then temperature, min_p, top-k/top-p
    presence_penalty: float = 0.0       # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0      # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0     # HF/vLLM: divides positive (multiplies negative) logits of
                                        # tokens in the prompt or the output; 1 = off
    min_p: float = 0.0                  # drop tokens below min_p times the top token's probability
    min_tokens: int = 0                 # EOS and stop_token_ids are banned before this many outputs
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs, ids sorted
    logprobs: int | None = None         # return the sampled token's logprob and this many top ones
    grammar: GrammarSpec | None = None  # structured output (xgrammar bitmask)
    n: int = 1                          # parallel samples of one prompt; sample i seeds with seed + i
    # the prompt tokens' logprobs (each under the model given the tokens before it) and this many
    # top ones per position, computed in prefill; None: not asked (the prefill computes none)
    prompt_logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        # below ~1e-5 a temperature only overflows the scaled logits; it means greedy (as in vLLM)
        return self.temperature < 1e-5 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request as a worker submits it to its engine (the engine builds its own live state)."""
    request_id: RequestId
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)   # generated elsewhere (migration)
    session: SessionId | None = None
    remote_prefill: bool = False        # decode side: the prompt's KV arrives from a prefill worker
    hold_blocks: bool = False           # prefill side: keep the blocks pinned after finishing


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token's log-probability under the model (log-softmax of the raw logits, before
    any processing), and the `len(top_ids)` most likely tokens with theirs, best first."""
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0               # its rank in the vocabulary (1 = most likely); 0 = not computed


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (new tokens, and how it ended if it did)."""
    request_id: RequestId
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_cached_tokens: int
    session: SessionId | None = None
    error: str = ""
    internal_error: bool = False          # the engine failed, not the request
    held_block_ids: list[int] | None = None   # hold_blocks requests: their blocks, still pinned
    logprobs: list[TokenLogprobs] | None = None   # one per new token, when the request asked
    # with the first token, when the request asked for prompt logprobs: one per prompt token from
    # the second on (the first token has no logprob: nothing precedes it)
    prompt_logprobs: list[TokenLogprobs] | None = None
    index: int = 0                        # which sample of the request (n > 1), 0 .. n-1
    # with the first token, where the engine tracks prefill time (a prefill worker's): seconds from
    # its arrival at the engine to the first step that computed part of its prompt, and its share
    # (by tokens) of the wall time of the steps that computed its prompt
    prefill_wait_s: float | None = None
    prefill_compute_s: float | None = None


@dataclass(slots=True)
class KvReservation:
    """Decode side: blocks reserved for a remotely prefilled prompt; those from
    `num_cached_tokens // block_size` on must be filled by the prefill worker."""
    request_id: RequestId
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_cached_tokens: int
    session: SessionId | None = None
