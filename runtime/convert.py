"""Protobuf ⇄ engine dataclasses, in one place, for the messages that cross the worker boundary."""

from __future__ import annotations

from runtime.types import FinishReason, GrammarKind, GrammarSpec, SamplingParams, TokenLogprobs
from proto.splitserve.v1 import generation_pb2, worker_pb2

FINISH_TO_PB = {None: generation_pb2.FINISH_REASON_UNSPECIFIED,
                FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
                FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
                FinishReason.ABORT: generation_pb2.FINISH_REASON_CANCELLED,
                FinishReason.ERROR: generation_pb2.FINISH_REASON_ERROR}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


def sampling_to_pb(p: SamplingParams) -> worker_pb2.EngineSampling:
    m = worker_pb2.EngineSampling(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
        has_seed=p.seed is not None, seed=p.seed or 0, stop_token_ids=sorted(p.stop_token_ids),
        ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_p=p.min_p, min_tokens=p.min_tokens,
        logit_bias_ids=[t for t, _ in p.logit_bias], logit_bias_values=[b for _, b in p.logit_bias],
        has_logprobs=p.logprobs is not None, top_logprobs=p.logprobs or 0, n=p.n,
        has_prompt_logprobs=p.prompt_logprobs is not None, prompt_top_logprobs=p.prompt_logprobs or 0)
    if p.grammar is not None:
        m.grammar.kind, m.grammar.spec = int(p.grammar.kind), p.grammar.spec
    return m


def sampling_from_pb(m: worker_pb2.EngineSampling) -> SamplingParams:
    grammar = None
    if m.HasField("grammar") and m.grammar.kind:
        grammar = GrammarSpec(GrammarKind(m.grammar.kind), m.grammar.spec)
    return SamplingParams(temperature=m.temperature, top_p=m.top_p, top_k=m.top_k,
                          max_tokens=m.max_tokens, seed=m.seed if m.has_seed else None,
                          stop_token_ids=frozenset(m.stop_token_ids), ignore_eos=m.ignore_eos,
                          presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
                          repetition_penalty=m.repetition_penalty or 1.0, min_p=m.min_p,
                          min_tokens=m.min_tokens,
                          logit_bias=tuple(zip(m.logit_bias_ids, m.logit_bias_values)),
                          logprobs=m.top_logprobs if m.has_logprobs else None, grammar=grammar,
                          n=max(1, m.n), prompt_logprobs=m.prompt_top_logprobs if m.has_prompt_logprobs else None)


def logprob_to_pb(token_id: int, lp: TokenLogprobs) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(token_id=token_id, logprob=lp.logprob, top_token_ids=lp.top_ids,
                                       top_logprobs=lp.top_logprobs, rank=lp.rank)


def logprob_from_pb(m: generation_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(m.logprob, tuple(m.top_token_ids), tuple(m.top_logprobs), m.rank)


def prompt_logprobs_to_pb(lps: list[TokenLogprobs] | None) -> list[generation_pb2.TokenLogprob]:
    """Prompt logprobs (RequestOutput.prompt_logprobs) as the workers send them: without token ids,
    which the frontend fills in from the prompt it holds."""
    return [logprob_to_pb(0, lp) for lp in lps] if lps else []
