"""The pushed SSE path's events are byte for byte what the general path builds with json.dumps."""

from __future__ import annotations

import json

import pytest

from frontend.generation import Delta
from frontend.sse import ChunkEncoder, event
from runtime.types import FinishReason

TEXTS = ["", "hello", " wörld ✓", 'quote " back\\slash', "tab\tnew\nline\r\x00\x1f", "emoji 🚀 \ud7ff",
         "</script>"]
REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def general(rid, created, model, chat, ids, d: Delta) -> bytes:
    """What frontend/openai_api.py's `_sse` sends for this delta (one choice, no logprobs)."""
    reason = REASONS.get(d.finish_reason)
    if chat:
        choice = {"index": 0, "delta": {"content": d.text} if d.text else {}, "finish_reason": reason,
                  "logprobs": None}
    else:
        choice = {"index": 0, "text": d.text, "finish_reason": reason, "logprobs": None}
    if ids:
        choice["token_ids"] = d.token_ids
    obj = "chat.completion.chunk" if chat else "text_completion"
    return event({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("ids", [False, True])
@pytest.mark.parametrize("reason", [None, FinishReason.STOP, FinishReason.LENGTH])
def test_template_events_equal_the_json_ones(chat, ids, reason):
    rid, created, model = "cmpl-0123abc", 1767225600, 'my "model" ✓'
    enc = ChunkEncoder(rid, created, model, chat, ids)
    for text in TEXTS:
        d = Delta([7, 12, 4095][: len(text) % 3 + 1], text, reason, 5, 9, 0)
        got = enc.encode(d, REASONS.get(reason))
        assert got == general(rid, created, model, chat, ids, d)
        assert json.loads(got[len(b"data: "):])      # one JSON object per event
