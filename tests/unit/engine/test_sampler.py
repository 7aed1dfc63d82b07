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



# ---- logits processors and logprobs (engine/sampling_state.py builds their inputs) -------------

from engine.plan import PENDING_TOKEN, PlanRow  # noqa: E402
from engine.sampler import process_logits, sample_step, unpack_bitmask  # noqa: E402
from engine.sampling_state import PenaltySlots, build_processing  # noqa: E402


def _rows(params: list[SamplingParams], histories: list[list[int]], prompt_len: int = 3) -> list[PlanRow]:
    """Decode rows whose sequences are `histories` (prompt_len prompt tokens, then the output)."""
    return [PlanRow(str(i), i, [h[-1]], len(h) - 1, [0], p, True, prompt_len, list(h) if p.penalized else None)
            for i, (p, h) in enumerate(zip(params, histories))]


def _step(logits, params, histories, eos=frozenset(), prev_tokens=None, prev_rows=None, gens=None):
    rows = _rows(params, histories)
    proc = build_processing(rows, logits.shape[-1], eos, logits.device, prev_tokens, prev_rows,
                            penalty_slots=PenaltySlots(logits.shape[-1], logits.device))
    return sample_step(logits, params, gens or [None] * len(params), None, proc), proc


def test_no_options_builds_nothing():
    rows = _rows([SamplingParams(), SamplingParams(temperature=0.0)], [[1, 2, 3], [4, 5, 6, 7]])
    assert build_processing(rows, V, frozenset({0}), torch.device("cpu")) is None


def test_logprobs_are_the_raw_log_softmax_whatever_the_processors():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, logprobs=5, logit_bias=((7, 50.0),)),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, logprobs=0, seed=1)]
    s, _ = _step(logits, params, [[1, 2, 3]] * 3, gens=[None, None, torch.Generator().manual_seed(1)])
    assert torch.equal(logits, before)               # the caller's logits are left alone
    ref = torch.log_softmax(before, dim=-1)
    assert s.tokens[0].item() == 7                   # the bias decided the sample ...
    assert s.logprobs[0].item() == pytest.approx(ref[0, 7].item(), abs=1e-6)   # ... not the logprob
    top = ref[0].topk(5)
    assert s.top_ids[0].tolist() == top.indices.tolist()
    assert torch.allclose(s.top_logprobs[0], top.values)
    assert s.logprobs[1].item() == pytest.approx(ref[2, s.tokens[2]].item(), abs=1e-6)


def test_logit_bias_forces_and_bans():
    logits = torch.zeros(2, V)
    params = [SamplingParams(temperature=1.0, logit_bias=((5, 100.0),)),
              SamplingParams(temperature=1.0, logit_bias=tuple((t, -100.0) for t in range(V - 1)))]
    for _ in range(20):
        s, _ = _step(logits, params, [[1, 2, 3]] * 2)
        assert s.tokens.tolist() == [5, V - 1]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 0] = 10.0          # EOS is the argmax
    logits[0, 9] = 9.0           # then a stop token
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=frozenset({9}))
    assert _step(logits, [p], [[1, 2, 3]], eos=frozenset({0}))[0].tokens.tolist() != [0]   # 0 outputs so far
    assert _step(logits, [p], [[1, 2, 3, 4]], eos=frozenset({0}))[0].tokens.tolist() not in ([0], [9])
    assert _step(logits, [p], [[1, 2, 3, 4, 5]], eos=frozenset({0}))[0].tokens.tolist() == [0]   # 2 done
    ig = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert _step(logits, [ig], [[1, 2, 3]], eos=frozenset({0}))[0].tokens.tolist() == [0]   # EOS no stop


def _penalized_reference(logits: torch.Tensor, p: SamplingParams, hist: list[int], prompt_len: int) -> torch.Tensor:
    """One row, token by token, as vLLM defines the three penalties."""
    x = logits.clone()
    out = Counter(hist[prompt_len:])
    for t in set(hist):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in out.items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def test_penalties_match_a_per_token_reference_with_a_pending_token():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, V, generator=g) * 3
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.75, repetition_penalty=1.3),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, repetition_penalty=0.5, frequency_penalty=-1.0)]
    hists = [[1, 2, 3, 4, 4, 4, 5, PENDING_TOKEN], [6, 7, 8], [2, 2, 9, 9, 10, PENDING_TOKEN]]
    prev_tokens = torch.tensor([11, 4, 10])           # the previous step sampled 4 for row 0, 10 for row 2
    s, proc = _step(logits, params, hists, prev_tokens=prev_tokens, prev_rows={"0": 1, "2": 2})
    real = [[1, 2, 3, 4, 4, 4, 5, 4], None, [2, 2, 9, 9, 10, 10]]
    for i in (0, 2):
        want = _penalized_reference(logits[i], params[i], real[i], 3)
        assert s.tokens[i].item() == want.argmax().item()
    got = process_logits(logits.clone(), proc)
    for i in (0, 2):
        assert torch.allclose(got[i], _penalized_reference(logits[i], params[i], real[i], 3))
    assert torch.equal(got[1], logits[1])             # an unpenalized row is untouched


def test_penalty_slots_count_incrementally_grow_and_are_reused():
    """The runner's penalty state over many steps: each step gives only the unseen tokens (the whole
    sequence at first sight, then one output, some pending on the device); three requests come and
    go through two slots' capacity, so the tensors grow and a freed slot is reused and zeroed."""
    g = torch.Generator().manual_seed(8)
    slots = PenaltySlots(V, torch.device("cpu"), capacity=2)
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.75, repetition_penalty=1.3)
    seqs = {0: [1, 2, 3, 4, 4], 1: [6, 6, 7], 2: [2, 2, 9]}      # prompt 3, then outputs
    sent = {0: 0, 1: 0, 2: 0}
    live = [0, 1, 2]
    for step in range(12):
        if step == 6:                               # request 1 ends; request 3 takes its slot
            slots.release(1)
            live, seqs[3], sent[3] = [0, 2, 3], [5, 5, 5], 0
        rows, pend = [], {}
        for j, k in enumerate(live):
            h = seqs[k]
            unseen = h[sent[k]:]
            if step % 3 == 2 and sent[k]:           # the newest output still on the device
                unseen, pend[str(k)] = unseen[:-1] + [PENDING_TOKEN], j
            rows.append(PlanRow(str(k), k, [h[-1]], len(h) - 1, [0], p, True, 3, unseen, sent[k]))
            sent[k] = len(h)
        prev = torch.tensor([seqs[k][-1] for k in live])
        logits = torch.randn(len(live), V, generator=g) * 3
        proc = build_processing(rows, V, frozenset(), logits.device, prev, pend, penalty_slots=slots)
        got = process_logits(logits.clone(), proc)
        for j, k in enumerate(live):
            assert torch.allclose(got[j], _penalized_reference(logits[j], p, seqs[k], 3)), (step, k)
            seqs[k].append(int(torch.randint(0, V, (), generator=g)))
    assert slots.counts.shape[0] == 4 and len(slots) == 3
    bad = PlanRow("0", 0, [1], 9, [0], p, True, 3, [1], 2)       # tokens from 2, but more were counted
    with pytest.raises(RuntimeError, match="counted"):
        build_processing([bad], V, frozenset(), torch.device("cpu"), penalty_slots=slots)


def test_min_p_drops_tokens_below_the_fraction_of_the_top():
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    p = SamplingParams(temperature=1.0, min_p=0.35)   # keeps p >= 0.175: tokens 0 and 1
    gen = torch.Generator().manual_seed(0)
    seen = Counter()
    for _ in range(400):
        s, _ = _step(logits[None], [p], [[1, 2, 3]], gens=[gen])
        seen[s.tokens[0].item()] += 1
    assert set(seen) == {0, 1}
    assert seen[0] / 400 == pytest.approx(0.5 / 0.8, abs=0.08)


def test_bitmask_unpacks_as_xgrammar_packs():
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[0, [0, 31, 32, 69]] = True
    allowed[1, 5] = True
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    packed = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)   # int32 bit pattern
    assert torch.equal(unpack_bitmask(packed, 70), allowed)


def test_a_grammar_that_only_allows_stopping_wins_over_min_tokens():
    """Row 0's grammar allows only token 2 (a stop token, its JSON value complete) while min_tokens
    bans it: the row keeps token 2 instead of becoming all -inf (NaN probabilities, a failed step).
    Row 1 has other allowed tokens, so its ban holds."""
    import torch

    from engine.sampler import LogitsProcessing, process_logits
    vocab = 40
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    words = (vocab + 31) // 32
    bitmask = torch.zeros(2, words, dtype=torch.int32)
    bitmask[0, 0] = 1 << 2                      # row 0: token 2 only
    bitmask[1, 0] = (1 << 2) | (1 << 5)         # row 1: tokens 2 and 5
    proc = LogitsProcessing(bitmask_rows=torch.tensor([0, 1]), bitmask=bitmask,
                            banned_rows=torch.tensor([0, 1]), banned_ids=torch.tensor([2, 2]))
    out = process_logits(logits.clone(), proc)
    assert torch.isfinite(out[0, 2]) and torch.isneginf(out[0, torch.arange(vocab) != 2]).all()
    assert torch.isneginf(out[1, 2]) and torch.isfinite(out[1, 5])
    assert out[1].argmax() == 5
