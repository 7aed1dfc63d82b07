"""What reaches the chat template: a message's `name`, `chat_template_kwargs` and `reasoning_effort`
as variables (never replacing the server's own), and /tokenizer_info's view of the tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from frontend.schemas import template_kwargs
from frontend.tokenizer import ChatTurn, ModelTokenizer
from runtime.errors import InvalidRequest
from splitserve.models import resolve_model

TEMPLATE = ("{% for m in messages %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}] {{ m.content }}\n"
            "{% endfor %}effort={{ reasoning_effort | default('unset') }} think={{ enable_thinking | default('unset') }}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> ModelTokenizer:
    d = tmp_path_factory.mktemp("tok")
    src = resolve_model("tiny")
    shutil.copy(f"{src}/tokenizer.json", d)
    cfg = json.loads(open(f"{src}/tokenizer_config.json").read())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return ModelTokenizer(d)


def test_names_and_template_variables_reach_the_template(tok):
    turns = [ChatTurn("user", "hi", name="alice"), ChatTurn("assistant", "yo")]
    text = tok.apply_chat_template(turns, template_kwargs=template_kwargs({"enable_thinking": False}, "low"))
    assert text == "[user:alice] hi\n[assistant] yo\neffort=low think=False"
    assert tok.apply_chat_template(turns).endswith("effort=unset think=unset")


@pytest.mark.parametrize("name", ["messages", "tools", "add_generation_prompt", "bos_token"])
def test_template_kwargs_may_not_replace_the_servers_variables(name):
    with pytest.raises(InvalidRequest) as e:
        template_kwargs({name: 1}, None)
    assert e.value.param == f"chat_template_kwargs.{name}"


def test_tokenizer_info_names_the_special_tokens_and_template():
    info = ModelTokenizer(resolve_model("tiny")).info()
    assert info["eos_token"] == "<|end_of_text|>" and info["bos_token"] == "<|begin_of_text|>"
    assert "<|im_start|>" in info["chat_template"] and info["vocab_size"] == 4096
    assert info["added_tokens_decoder"]["0"]["content"] == "<|begin_of_text|>"
