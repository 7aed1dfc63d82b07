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
from engine.sampler import apply_bitmask, unpack_bitmask  # noqa: E402
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


def test_a_grammar_error_says_what_is_wrong_without_the_librarys_paths_and_times(setup):
    _, grammars = setup
    bad = json.dumps({"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}})
    for _ in range(2):          # a second time too (xgrammar's message carries the first one's time)
        with pytest.raises(GrammarError) as e:
            grammars.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, bad))
        assert str(e.value) == "the JSON schema does not compile: minLength 5 is greater than maxLength 2"
    with pytest.raises(GrammarError, match=r"^the JSON schema does not compile: Regex parsing error at position 3"):
        grammars.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "string", "pattern": "(("})))


def test_grammar_thread_fills_as_row_by_row(setup):
    """GrammarMasks (the runner's grammar thread, one batched xgrammar call) gives the same masks as
    filling each row alone, over steps that give each row its unseen tokens (the whole sequence
    first, then one output), with a pending token read from the previous step's ids."""
    from engine.grammar import GrammarMasks
    from engine.plan import PENDING_TOKEN, PlanRow
    from runtime.types import SamplingParams
    _, grammars = setup
    specs = [GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)), GrammarSpec(GrammarKind.JSON_OBJECT), None]
    masks, alone = GrammarMasks(grammars, threads=2), [grammars.matcher(s) if s else None for s in specs]
    seqs, sent = [[5, 6], [7], [8, 9, 10]], [0, 0, 0]         # prompts of 2, 1 and 3 tokens
    g = torch.Generator().manual_seed(1)

    class Prev:                                               # the previous step's ids, as LaunchedStep
        rows = {"0": 0, "1": 1, "2": 2}

        def result(self):
            return {str(i): s[-1] for i, s in enumerate(seqs)}

    for step in range(12):
        rows = []
        for i, (spec, seq) in enumerate(zip(specs, seqs)):
            unseen = seq[sent[i]:]
            if step % 2 and sent[i]:
                unseen = unseen[:-1] + [PENDING_TOKEN]
            p = SamplingParams(grammar=spec)
            rows.append(PlanRow(str(i), 1000 + i, [seq[-1]], len(seq) - 1, [0], p, True, (2, 1, 3)[i], unseen, sent[i]))
            sent[i] = len(seq)
        idx, got = masks.submit(rows, Prev()).result()
        assert idx == [0, 1]
        want = allocate_bitmask(2, 4096)
        for m in range(2):
            if step:
                alone[m].accept(seqs[m][-1])
            alone[m].fill_bitmask(want, m)
        assert torch.equal(got, want), step
        allowed = unpack_bitmask(got, 4096)
        for m in range(2):
            seqs[m].append(int(torch.multinomial(allowed[m].float(), 1, generator=g)))
        seqs[2].append(int(torch.randint(10, 4000, (), generator=g)))
    assert len(masks) == 2
    masks.release(1000)
    assert len(masks) == 1
