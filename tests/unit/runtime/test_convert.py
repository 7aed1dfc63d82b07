"""runtime/convert.py: every SamplingParams field survives the worker protobuf, and so do logprobs."""

from __future__ import annotations

import dataclasses

from proto.splitserve.v1 import generation_pb2, worker_pb2
from runtime.convert import logprob_from_pb, logprob_to_pb, sampling_from_pb, sampling_to_pb
from runtime.types import GrammarKind, GrammarSpec, SamplingParams, TokenLogprobs


def roundtrip(p: SamplingParams) -> SamplingParams:
    wire = sampling_to_pb(p).SerializeToString()
    return sampling_from_pb(worker_pb2.EngineSampling.FromString(wire))


def test_defaults_roundtrip():
    assert roundtrip(SamplingParams()) == SamplingParams()


def test_every_field_roundtrips():
    p = SamplingParams(temperature=0.5, top_p=0.75, top_k=7, max_tokens=33, seed=12345,
                       stop_token_ids=frozenset({2, 9}), ignore_eos=True, presence_penalty=0.5,
                       frequency_penalty=-1.25, repetition_penalty=1.5, min_p=0.125, min_tokens=4,
                       logit_bias=((3, -100.0), (17, 2.5)), logprobs=5,
                       grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "object"}'), n=3, prompt_logprobs=2)
    # every field differs from its default, so a field the conversion drops fails the test
    for f in dataclasses.fields(SamplingParams):
        assert getattr(p, f.name) != f.default, f.name
    assert roundtrip(p) == p


def test_logprobs_zero_and_none_differ():
    assert roundtrip(SamplingParams(logprobs=0)).logprobs == 0
    assert roundtrip(SamplingParams(logprobs=None)).logprobs is None
    assert roundtrip(SamplingParams(prompt_logprobs=0)).prompt_logprobs == 0
    assert roundtrip(SamplingParams(prompt_logprobs=None)).prompt_logprobs is None


def test_each_grammar_kind_roundtrips():
    for kind in GrammarKind:
        g = GrammarSpec(kind, "" if kind is GrammarKind.JSON_OBJECT else '{"x": 1}')
        assert roundtrip(SamplingParams(grammar=g)).grammar == g


def test_token_logprob_roundtrip():
    lp = TokenLogprobs(-0.5, (4, 1, 9), (-0.5, -1.5, -2.5), rank=1)
    wire = logprob_to_pb(4, lp).SerializeToString()
    m = generation_pb2.TokenLogprob.FromString(wire)
    assert m.token_id == 4 and logprob_from_pb(m) == lp
