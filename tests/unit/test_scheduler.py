"""Scheduler + BlockPool driven by a fake model step, with a fake KV cache that checks contents.

The fake step writes each computed token id into its KV slot and, before "attending", checks that
every earlier position of the request holds the right token: so a prefix-cache hit that handed out
the wrong block, or a preempted request resumed over stale blocks, fails loudly. The next token is
a pure function of the sequence so far, so a request yields the same tokens however it was batched,
chunked or preempted.
"""

from __future__ import annotations

import random

from engine.request import FinishReason, Request, SamplingParams
from engine.scheduler import Scheduler
from kvstore.block_pool import BlockPool

BS = 4
VOCAB = 1000
EOS = 999


def next_token(seq: list[int]) -> int:
    h = 17
    for t in seq[-8:]:
        h = (h * 1_000_003 + t) % (1 << 31)
    return h % (VOCAB - 10) + 5      # never EOS or the small ids tests use as stop tokens


class FakeModel:
    def __init__(self, num_blocks: int, budget: int) -> None:
        self.kv: dict[int, int] = {}         # slot → token id written there
        self.budget = budget
        self.steps: list[list[tuple[str, int, int]]] = []
        self.eos_at: dict[str, int] = {}     # request id → output index that is EOS

    def execute(self, chunks) -> dict[str, int]:
        assert sum(c.num_tokens for c in chunks) <= self.budget
        assert len({c.request.request_id for c in chunks}) == len(chunks)
        self.steps.append([(c.request.request_id, c.start, c.num_tokens) for c in chunks])
        out = {}
        for c in chunks:
            req = c.request
            assert c.num_tokens > 0 and c.start == req.num_computed_tokens
            table = req.block_ids
            assert len(table) * BS >= c.start + c.num_tokens
            for p in range(c.start):                      # the context it attends to
                assert self.kv.get(table[p // BS] * BS + p % BS) == req.token_ids[p], (req.request_id, p)
            for p in range(c.start, c.start + c.num_tokens):
                self.kv[table[p // BS] * BS + p % BS] = req.token_ids[p]
            if c.samples:
                n_out = req.num_output_tokens
                out[req.request_id] = EOS if self.eos_at.get(req.request_id) == n_out else \
                    next_token(req.token_ids)
        return out


def make(num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 16, max_model_len: int = 256,
         caching: bool = True):
    pool = BlockPool(num_blocks, enable_caching=caching)
    sched = Scheduler(pool, BS, max_model_len, max_num_seqs, budget, eos_token_ids=(EOS,))
    return sched, FakeModel(num_blocks, budget)


def run(sched: Scheduler, model: FakeModel, max_steps: int = 10_000):
    """Step until idle; return each request's outputs (token ids, finish reason, cached tokens)."""
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not sched.has_work:
            break
        chunks = sched.schedule()
        assert chunks, "work is queued but nothing was scheduled"
        for o in sched.update(chunks, model.execute(chunks)):
            r = results.setdefault(o.request_id, {"tokens": [], "reason": None, "cached": None})
            assert r["reason"] is None, "output after finishing"
            r["tokens"] += o.new_token_ids
            r["reason"] = o.finish_reason
            if o.num_cached_tokens >= 0:
                assert r["cached"] is None
                r["cached"] = o.num_cached_tokens
        sched.pool.check_invariants()
    assert not sched.has_work
    return results


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def req(rid: str, prompt: list[int], max_tokens: int = 8, **kw) -> Request:
    return Request.new(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB - 10) for _ in range(n)]


def test_chunked_prefill_respects_the_budget_and_decodes_join_the_batch():
    sched, model = make(budget=16)
    rng = random.Random(0)
    prompts = {"long": rand_prompt(rng, 50), "short": rand_prompt(rng, 3)}
    sched.add(req("long", prompts["long"], max_tokens=5))
    sched.add(req("short", prompts["short"], max_tokens=20))
    out = run(sched, model)
    long_chunks = [(s, n) for step in model.steps for rid, s, n in step if rid == "long"]
    assert long_chunks[:4] == [(0, 16), (16, 16), (32, 16), (48, 2)]
    assert all(n == 1 for _, n in long_chunks[4:])
    assert any(len(step) == 2 for step in model.steps)          # prefill and decode shared steps
    for rid, p in prompts.items():
        assert out[rid]["tokens"] == expected_tokens(p, len(out[rid]["tokens"]))
    assert out["long"]["reason"] == out["short"]["reason"] == FinishReason.LENGTH
    assert sched.pool.num_free == sched.pool.num_blocks


def test_prefix_hit_skips_cached_blocks_but_always_computes_the_last_token():
    sched, model = make(budget=64)
    rng = random.Random(1)
    shared = rand_prompt(rng, 4 * BS)
    sched.add(req("a", shared + rand_prompt(rng, 5)))
    out = run(sched, model)
    assert out["a"]["cached"] == 0
    # same 4 full blocks then a different tail: 4 blocks (16 tokens) are reused
    b_prompt = shared + rand_prompt(rng, 3)
    sched.add(req("b", b_prompt))
    # exactly the cached prompt: its last block must be recomputed to get logits for the last token
    sched.add(req("c", list(shared)))
    model.steps.clear()
    out = run(sched, model)
    first = {rid: (s, n) for rid, s, n in model.steps[0]}
    assert out["b"]["cached"] == 16 and first["b"] == (16, 3)
    assert out["c"]["cached"] == 12 and first["c"] == (12, 4)
    assert out["b"]["tokens"] == expected_tokens(b_prompt, 8)
    assert out["c"]["tokens"] == expected_tokens(shared, 8)
    assert sched.num_prefix_hit_tokens == 28
    assert sched.pool.num_free == sched.pool.num_blocks


def test_no_prefix_hits_without_caching():
    sched, model = make(caching=False)
    p = rand_prompt(random.Random(2), 20)
    sched.add(req("a", p))
    run(sched, model)
    sched.add(req("b", p))
    out = run(sched, model)
    assert out["b"]["cached"] == 0 and out["b"]["tokens"] == expected_tokens(p, 8)


def test_preemption_when_blocks_run_out_and_every_request_still_completes():
    # 12 blocks of 4 tokens; each request grows to 8 + 16 = 24 tokens = 6 blocks; three don't fit
    sched, model = make(num_blocks=12, budget=64)
    rng = random.Random(3)
    prompts = {f"r{i}": rand_prompt(rng, 8) for i in range(3)}
    for rid, p in prompts.items():
        sched.add(req(rid, p, max_tokens=16))
    out = run(sched, model)
    assert sched.num_preemptions > 0
    for rid, p in prompts.items():
        assert out[rid]["tokens"] == expected_tokens(p, 16), rid
        assert out[rid]["reason"] == FinishReason.LENGTH
    assert sched.pool.num_free == sched.pool.num_blocks


def test_random_workload_matches_the_reference_under_pressure():
    rng = random.Random(4)
    sched, model = make(num_blocks=40, budget=24, max_num_seqs=6)
    bases = [rand_prompt(rng, rng.randint(4, 40)) for _ in range(4)]
    expect = {}
    pending = []
    for i in range(40):
        p = rng.choice(bases)[: rng.randint(1, 40)] + rand_prompt(rng, rng.randint(0, 12))
        n = rng.randint(1, 24)
        expect[f"q{i}"] = (p, n)
        pending.append(req(f"q{i}", p, max_tokens=n))
    results: dict[str, list[int]] = {}
    while pending or sched.has_work:             # arrivals interleaved with steps
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add(pending.pop(0))
        if not sched.has_work:
            continue
        chunks = sched.schedule()
        assert chunks
        for o in sched.update(chunks, model.execute(chunks)):
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
        sched.pool.check_invariants()
    for rid, (p, n) in expect.items():
        assert results[rid] == expected_tokens(p, n), rid
    assert sched.num_preemptions > 0 and sched.num_prefix_hit_tokens > 0
    assert sched.pool.num_free == sched.pool.num_blocks


def test_finish_reasons_eos_stop_token_ignore_eos_and_max_tokens():
    sched, model = make()
    rng = random.Random(5)
    p = rand_prompt(rng, 6)
    ref = expected_tokens(p, 10)
    model.eos_at = {"eos": 3, "ignored": 3}
    sched.add(req("eos", p, max_tokens=10))
    sched.add(req("ignored", p, max_tokens=10, ignore_eos=True))
    sched.add(req("stop_id", p, max_tokens=10, stop_token_ids=frozenset({ref[4]})))
    sched.add(req("length", p, max_tokens=7))
    out = run(sched, model)
    assert out["eos"]["tokens"] == ref[:3] + [EOS] and out["eos"]["reason"] == FinishReason.STOP
    ignored = out["ignored"]["tokens"]
    assert len(ignored) == 10 and ignored[3] == EOS and out["ignored"]["reason"] == FinishReason.LENGTH
    assert out["stop_id"]["tokens"] == ref[:5] and out["stop_id"]["reason"] == FinishReason.STOP
    assert out["length"]["tokens"] == ref[:7] and out["length"]["reason"] == FinishReason.LENGTH


def test_stop_token_ids_apply_even_with_ignore_eos():
    sched, model = make()
    p = rand_prompt(random.Random(6), 5)
    ref = expected_tokens(p, 10)
    sched.add(req("a", p, max_tokens=10, ignore_eos=True, stop_token_ids=frozenset({ref[2]})))
    out = run(sched, model)
    assert out["a"]["tokens"] == ref[:3] and out["a"]["reason"] == FinishReason.STOP


def test_the_context_limit_ends_a_request_with_length():
    sched, model = make(max_model_len=20)
    p = rand_prompt(random.Random(7), 15)
    sched.add(req("a", p, max_tokens=100))
    out = run(sched, model)
    assert len(out["a"]["tokens"]) == 5 and out["a"]["reason"] == FinishReason.LENGTH


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched, model = make(budget=8, max_num_seqs=1)
    rng = random.Random(8)
    sched.add(req("running", rand_prompt(rng, 30), max_tokens=50))
    sched.add(req("waiting", rand_prompt(rng, 30), max_tokens=50))
    for _ in range(3):
        chunks = sched.schedule()
        sched.update(chunks, model.execute(chunks))
    assert sched.pool.num_free < sched.pool.num_blocks
    assert sched.abort("waiting") is not None
    aborted = sched.abort("running")
    assert aborted.finished
    assert sched.abort("running") is None and sched.abort("never-existed") is None
    assert not sched.has_work
    assert sched.pool.num_free == sched.pool.num_blocks
    sched.pool.check_invariants()


def test_abort_while_the_step_runs_drops_its_output():
    sched, model = make()
    sched.add(req("a", rand_prompt(random.Random(9), 10)))
    chunks = sched.schedule()
    sampled = model.execute(chunks)
    sched.abort("a")
    assert sched.update(chunks, sampled) == []
    assert sched.pool.num_free == sched.pool.num_blocks
    sched.pool.check_invariants()


def test_max_num_seqs_limits_the_running_set():
    sched, model = make(max_num_seqs=2)
    rng = random.Random(10)
    for i in range(5):
        sched.add(req(f"r{i}", rand_prompt(rng, 5), max_tokens=4))
    out = run(sched, model)
    assert max(len(step) for step in model.steps) == 2
    assert len(out) == 5 and all(o["reason"] == FinishReason.LENGTH for o in out.values())
