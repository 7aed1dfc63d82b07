"""prompt_cache_key / user as a routing hint: from the OpenAI body to the router's pin."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from frontend.routing import FrontendRouter
from frontend.schemas import MAX_ROUTING_KEY_CHARS, ChatCompletionRequest, CompletionRequest
from kvstore.hashing import block_hashes
from runtime.errors import InvalidRequest


def test_the_routing_key_is_prompt_cache_key_else_user_and_is_bounded():
    base = {"model": "m", "prompt": "hi"}
    assert CompletionRequest(**base).routing_key() is None
    assert CompletionRequest(**base, user="u1").routing_key() == "user:u1"
    assert CompletionRequest(**base, user="u1", prompt_cache_key="c").routing_key() == "key:c"
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], prompt_cache_key="c")
    assert chat.routing_key() == "key:c"
    # a user named like a key does not share its pin
    assert CompletionRequest(**base, user="c").routing_key() != "key:c"
    for field in ("prompt_cache_key", "user"):
        # refused when the body is parsed (the schema bounds it: a 400 naming the field) or, for a
        # body built another way, when the key is read
        try:
            CompletionRequest(**base, **{field: "x" * (MAX_ROUTING_KEY_CHARS + 1)}).routing_key()
        except InvalidRequest as e:
            assert e.param == field
        except ValidationError as e:
            assert e.errors()[0]["loc"][-1] == field
        else:
            pytest.fail(f"an over-long {field} was accepted")


def test_the_frontend_router_passes_the_hint_and_first_tokens_to_the_router():
    fr = FrontendRouter("kv")
    for i in range(4):
        fr.add_worker(f"w{i}", SimpleNamespace(block_size=16, role="decode"))
    workers = [f"w{i}" for i in range(4)]
    picks = set()
    for i in range(12):        # unrelated prompts, one at a time: only the pin keeps them together
        hashes = block_hashes([(i * 7919 + t) % 4096 for t in range(256)], 16)
        wid, _ = fr.route(f"r{i}", hashes, 256, workers, hint="key:s")
        picks.add(wid)
        fr.first_token(f"r{i}")
        fr.finished(f"r{i}")
    assert len(picks) == 1
