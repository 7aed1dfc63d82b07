"""Protobuf ⇄ engine dataclasses, in one place, for the messages that cross the worker boundary."""

from __future__ import annotations

from runtime.types import FinishReason, SamplingParams
from proto.splitserve.v1 import generation_pb2, worker_pb2

FINISH_TO_PB = {None: generation_pb2.FINISH_REASON_UNSPECIFIED,
                FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
                FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
                FinishReason.ABORT: generation_pb2.FINISH_REASON_CANCELLED,
                FinishReason.ERROR: generation_pb2.FINISH_REASON_ERROR}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


def sampling_to_pb(p: SamplingParams) -> worker_pb2.EngineSampling:
    return worker_pb2.EngineSampling(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
        has_seed=p.seed is not None, seed=p.seed or 0, stop_token_ids=sorted(p.stop_token_ids),
        ignore_eos=p.ignore_eos)


def sampling_from_pb(m: worker_pb2.EngineSampling) -> SamplingParams:
    return SamplingParams(temperature=m.temperature, top_p=m.top_p, top_k=m.top_k,
                          max_tokens=m.max_tokens, seed=m.seed if m.has_seed else None,
                          stop_token_ids=frozenset(m.stop_token_ids), ignore_eos=m.ignore_eos)
