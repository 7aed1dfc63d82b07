"""Stored responses of the Responses API (/v1/responses), in Redis for a bounded time.

A response created with `store: true` (the default) is kept under `<namespace>:response:<id>` for
`--responses-ttl-s` seconds (SET with EX: Redis forgets it then, whatever else happens): the
response object as it was returned, and the conversation it ended (its input, earlier turns
included, and its output, as chat turns without the instructions, which OpenAI does not carry
over). `previous_response_id` continues that conversation; GET and DELETE /v1/responses/{id} read
and remove it. Any frontend of the namespace finds any response. `store: false` writes nothing.
"""

from __future__ import annotations

import json

from frontend.tokenizer import ChatTurn


class ResponseStore:
    def __init__(self, redis, namespace: str, ttl_s: int) -> None:
        if ttl_s < 1:
            raise ValueError("responses_ttl_s must be at least 1")
        self.redis, self.namespace, self.ttl_s = redis, namespace, ttl_s

    def _key(self, response_id: str) -> str:
        return f"{self.namespace}:response:{response_id}"

    async def put(self, response: dict, turns: list[ChatTurn]) -> None:
        value = json.dumps({"response": response, "turns": [_turn_to_json(t) for t in turns]},
                           ensure_ascii=False, separators=(",", ":"))
        await self.redis.set(self._key(response["id"]), value, ex=self.ttl_s)

    async def get(self, response_id: str) -> tuple[dict, list[ChatTurn]] | None:
        raw = await self.redis.get(self._key(response_id))
        if raw is None:
            return None
        stored = json.loads(raw)
        return stored["response"], [_turn_from_json(t) for t in stored["turns"]]

    async def delete(self, response_id: str) -> bool:
        return bool(await self.redis.delete(self._key(response_id)))


def _turn_to_json(t: ChatTurn) -> dict:
    return {"role": t.role, "content": t.content, "tool_calls": list(t.tool_calls), "tool_call_id": t.tool_call_id,
            "name": t.name}


def _turn_from_json(d: dict) -> ChatTurn:
    return ChatTurn(d["role"], d["content"], tuple(d.get("tool_calls") or ()), d.get("tool_call_id"), d.get("name"))
