"""The sampler: greedy is argmax, top-k/top-p restrict the support, seeds are per request."""

from __future__ import annotations

import math

import pytest
from collections import Counter

import torch

from runtime.types import SamplingParams
from engine.sampler import sample

V = 32


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    p = torch.tensor(probs + [1e-12] * (V - len(probs)))
    return torch.log(p / p.sum())


def draw(logits: torch.Tensor, p: SamplingParams, n: int, seed: int = 0) -> Counter:
    gen = torch.Generator().manual_seed(seed)
    return Counter(sample(logits[None], [p], [gen])[0] for _ in range(n))


def test_greedy_is_argmax_for_every_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, V, generator=g)
    params = [SamplingParams(temperature=0.0)] * 9
    assert sample(logits, params, [None] * 9) == logits.argmax(-1).tolist()


def test_top_k_1_is_greedy_whatever_the_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)
    params = [SamplingParams(temperature=5.0, top_k=1)] * 4
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    for _ in range(20):
        assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_next_to_sampled_rows():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, V, generator=g)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, seed=1),
              SamplingParams(temperature=0.0)]
    gens = [None, torch.Generator().manual_seed(1), None]
    for _ in range(20):
        out = sample(logits, params, gens)
        assert (out[0], out[2]) == (logits[0].argmax().item(), logits[2].argmax().item())


def test_temperature_one_follows_the_distribution():
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = draw(logits_from_probs(probs), SamplingParams(temperature=1.0), 4000)
    assert set(counts) <= {0, 1, 2, 3}
    for tok, p in enumerate(probs):       # 5 standard deviations
        assert abs(counts[tok] / 4000 - p) < 5 * math.sqrt(p * (1 - p) / 4000), (tok, counts)


def test_top_k_restricts_the_support_and_renormalises():
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.06, 0.04])
    counts = draw(logits, SamplingParams(temperature=1.0, top_k=2), 3000)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 3000 - 4 / 7) < 0.05


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.7), 2000)) == {0, 1}
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.9), 2000)) == {0, 1, 2}
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.5), 500)) == {0}
    counts = draw(logits, SamplingParams(temperature=1.0, top_p=0.7), 3000)
    assert abs(counts[0] / 3000 - 0.5 / 0.8) < 0.05


def test_top_k_and_top_p_together():
    logits = logits_from_probs([0.3, 0.25, 0.2, 0.15, 0.1])
    # top_k=3 leaves 0.3/0.75, 0.25/0.75, 0.2/0.75 = 0.4, 0.33, 0.27; top_p=0.6 keeps two of them
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6), 2000)) == {0, 1}


def test_same_seed_same_tokens_whatever_else_is_in_the_batch():
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(5, V, generator=g) for _ in range(30)]
    mine = SamplingParams(temperature=1.3, top_p=0.95, seed=42)

    def run(batch_rows: list[int], my_row: int, others: list[SamplingParams]) -> list[int]:
        gens = {my_row: torch.Generator().manual_seed(42)}
        out = []
        for logits in steps:
            params, generators = [], []
            for r in batch_rows:
                params.append(mine if r == my_row else others[r % len(others)])
                generators.append(gens.get(r) if r == my_row else torch.Generator().manual_seed(r + len(out)))
            tokens = sample(logits[batch_rows], params, generators)
            out.append(tokens[batch_rows.index(my_row)])
        return out

    alone = run([0], 0, [mine])
    others = [SamplingParams(temperature=0.7, seed=9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=2.0, top_k=5)]
    # the same logits row, at different positions of bigger batches with other sampled rows
    in_batch = run([1, 2, 0, 3], 0, others)
    last = run([3, 1, 0], 0, others)
    assert alone == in_batch == last
    assert len(set(alone)) > 3           # it really sampled
    other_seed = []
    gen = torch.Generator().manual_seed(43)
    for logits in steps:
        other_seed.append(sample(logits[0:1], [mine], [gen])[0])
    assert other_seed != alone


# A tiny temperature used to overflow logits / T to inf, make softmax NaN and crash the engine step
# (failing every request on the worker). Below 1e-5 it is greedy; above, logits are shifted first.
@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 1e-6, 1e-4])
def test_a_tiny_positive_temperature_samples_like_greedy(temperature):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, V, generator=g) * 16         # the tiny model's logit scale
    params = [SamplingParams(temperature=temperature, seed=1)] * 2
    out = sample(logits, params, [torch.Generator().manual_seed(1) for _ in range(2)])
    assert out == logits.argmax(-1).tolist()

