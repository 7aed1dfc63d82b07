"""What other threads ask of the engine thread: one small typed message per kind of request.

`EngineLoop` (engine/engine.py) takes these from its inbox between steps, in arrival order, and
turns each into one call on the `Engine`. Plain data; the workers build them through the loop's
methods (submit, abort, kv_arrived, ...) and never touch the engine from their own threads.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from runtime.types import EngineRequest, RequestId, TokenLogprobs


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class KvArrived:
    """Decode side: a prefill worker pushed the prompt's KV; continue from its first token."""
    request_id: RequestId
    first_token: int
    first_logprob: TokenLogprobs | None = None    # when the request asked for logprobs
    prompt_lps: list[TokenLogprobs] | None = None   # when it asked for prompt logprobs


@dataclass(frozen=True, slots=True)
class KvFailed:
    """Decode side: the remote prefill failed; compute the prompt here."""
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class ReleaseHeld:
    """Prefill side: the decode side has the KV (or gave up); unpin the blocks."""
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class RunOnEngine:
    """Run `fn(engine)` between steps and put its result (or exception) in `future`."""
    fn: Callable[[Any], Any]
    future: Future


@dataclass(frozen=True, slots=True)
class Wake:
    """No-op: wakes a loop blocked on an empty inbox (to stop it)."""


Command = AddRequest | Abort | KvArrived | KvFailed | ReleaseHeld | RunOnEngine | Wake
