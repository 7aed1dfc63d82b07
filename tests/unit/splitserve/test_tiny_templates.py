"""tiny-qwen2's chat template renders tools as Qwen2.5's does (the Hermes-style reference template of
tests/unit/frontend/chat_templates.py, given a system message: ours adds no default persona), and
renders chats without tools exactly as the ChatML template did; a cached tiny model gets the current
tokenizer_config.json."""

from __future__ import annotations

import json

from jinja2.sandbox import ImmutableSandboxedEnvironment

from splitserve import models
from splitserve.tiny_model import CHAT_TEMPLATE, QWEN2_CHAT_TEMPLATE, tokenizer_config
from tests.unit.frontend.chat_templates import HERMES

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}, {"role": "tool", "content": "22C", "tool_call_id": "c1"}]


def _render(template: str, **kw) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template).render(add_generation_prompt=True, bos_token="", eos_token="", **kw)


def test_tools_render_as_qwen25_does():
    assert _render(QWEN2_CHAT_TEMPLATE, messages=CHAT, tools=TOOLS) == _render(HERMES, messages=CHAT, tools=TOOLS)


def test_without_tools_the_chatml_rendering_is_unchanged():
    plain = [m for m in CHAT[:2]] + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
    assert _render(QWEN2_CHAT_TEMPLATE, messages=plain) == _render(CHAT_TEMPLATE, messages=plain)
    assert tokenizer_config("llama")["chat_template"] == CHAT_TEMPLATE


def test_a_cached_tiny_model_gets_the_current_tokenizer_config(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    d = tmp_path / "models" / "tiny-qwen2-seed0"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"")                    # "already written"
    (d / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config("qwen2"), "chat_template": "old"}))
    assert models.resolve_model("tiny-qwen2") == str(d)
    assert json.loads((d / "tokenizer_config.json").read_text()) == tokenizer_config("qwen2")
