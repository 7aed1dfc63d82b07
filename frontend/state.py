"""What one frontend process serves with: the objects its HTTP and gRPC APIs share.

Built once by frontend/main.py; the two API modules read it and never construct parts of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from frontend.auth import ApiKey
from frontend.generate import Generator
from frontend.response_store import ResponseStore
from frontend.tokenizer import ModelTokenizer, TokenizerPool
from runtime.metrics import FrontendMetrics


@dataclass
class FrontendState:
    generator: Generator
    tokenizer: ModelTokenizer
    metrics: FrontendMetrics
    model_name: str                          # the context limit is the generator's (`context_limit()`)
    api_key: ApiKey
    max_body_bytes: int
    tokenize: TokenizerPool                  # tokenizer work off the event loop (bounded queue)
    extra_metrics: Callable[[], Awaitable[bytes]] | None = None   # other components' samples
    responses: ResponseStore | None = None   # stored Responses API responses (None: store nothing)
