"""engine/grammar.py with xgrammar on the tiny model's tokenizer: with random logits (random
weights' worth of noise), every output masked by the grammar, through the sampler's bitmask, parses
as JSON and validates against its schema; specs compile once; a bad schema is a GrammarError."""

from __future__ import annotations

import json

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")

from engine.grammar import GrammarError, Grammars, allocate_bitmask  # noqa: E402
from engine.sampler import apply_bitmask  # noqa: E402
from runtime.types import GrammarKind, GrammarSpec  # noqa: E402
from splitserve.tiny_model import EOS_ID, write_tiny_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    return tok, Grammars(tok, 4096, stop_token_ids=[EOS_ID])


def _generate(grammars: Grammars, spec: GrammarSpec, seed: int, max_tokens: int = 300,
              closing: list[int] = ()) -> list[int]:
    """Sample random logits under the grammar until it terminates. `closing`: ids favoured by +3
    (a free JSON object under pure noise nests and runs on for thousands of tokens)."""
    g = torch.Generator().manual_seed(seed)
    m = grammars.matcher(spec)
    mask = allocate_bitmask(1, 4096)
    rows = torch.tensor([0])
    out = []
    for _ in range(max_tokens):
        m.fill_bitmask(mask, 0)
        logits = torch.randn(1, 4096, generator=g) * 4
        logits[0, list(closing)] += 3.0
        apply_bitmask(logits, rows, mask)
        t = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=g))
        assert m.accept(t)
        if m.terminated:
            return out
        out.append(t)
    pytest.fail("the grammar did not terminate")


def test_json_schema_outputs_validate(setup):
    tok, grammars = setup
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    for seed in range(6):
        text = tok.decode(_generate(grammars, spec, seed))
        jsonschema.validate(json.loads(text), SCHEMA)
    assert grammars.compiles == 1                     # one compile for six requests


def test_json_object_outputs_parse(setup):
    tok, grammars = setup
    closing = tok.convert_tokens_to_ids(["}", "]", '"'])
    for seed in range(4):
        ids = _generate(grammars, GrammarSpec(GrammarKind.JSON_OBJECT), seed, 2000, closing)
        assert isinstance(json.loads(tok.decode(ids)), dict)


def test_bad_schema_is_a_grammar_error(setup):
    _, grammars = setup
    for bad in ("{not json", '{"type": "no-such-type"}'):
        with pytest.raises(GrammarError):
            grammars.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, bad))
