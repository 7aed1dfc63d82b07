"""Scheduler + BlockPool driven by a fake model step, with a fake KV cache that checks contents.

The fake step writes each computed token id into its KV slot and, before "attending", checks that
every earlier position of the request holds the right token: so a prefix-cache hit that handed out
the wrong block, or a preempted request resumed over stale blocks, fails loudly. The next token is
a pure function of the sequence so far, so a request yields the same tokens however it was batched,
chunked or preempted.

Every workload runs twice: synchronously, and with async scheduling as the engine does it (step N+1
scheduled and "launched" before step N's tokens are read back; the fake model reads a pending
token from the previous step's samples, as the GPU reads it from device memory).
"""

from __future__ import annotations

import random

import pytest

from engine.request import PENDING_TOKEN, Request
from runtime.types import FinishReason, SamplingParams
from engine.scheduler import Scheduler
from kvstore.pools.block_pool import BlockPool

BS = 4
VOCAB = 1000
EOS = 999


def next_token(seq: list[int]) -> int:
    h = 17
    for t in seq[-8:]:
        h = (h * 1_000_003 + t) % (1 << 31)
    return h % (VOCAB - 10) + 5      # never EOS or the small ids tests use as stop tokens


class FakeModel:
    """Reads only the step plan, as a runner does; checks the plan against the scheduler's own
    requests (`truth`), which a real runner never sees."""

    def __init__(self, num_blocks: int, budget: int) -> None:
        self.kv: dict[int, int] = {}         # slot → token id written there
        self.budget = budget
        self.steps: list[list[tuple[str, int, int]]] = []
        self.eos_at: dict[str, int] = {}     # request id → output index that is EOS
        self.truth: dict[str, Request] = {}  # the scheduler's requests (set by make())

    def execute(self, plan, prev: dict[str, int] | None = None) -> dict[str, int]:
        """One step; `prev`: the previous step's samples, where pending input tokens are read."""
        rows = plan.rows
        assert sum(r.num_tokens for r in rows) <= self.budget
        assert len({r.request_id for r in rows}) == len(rows)
        self.steps.append([(r.request_id, r.start, r.num_tokens) for r in rows])
        out = {}
        for row in rows:
            req = self.truth[row.request_id]
            assert row.num_tokens > 0 and row.start == req.num_computed_tokens
            assert row.token_ids == req.token_ids[row.start:row.start + row.num_tokens]
            seq = list(req.token_ids)
            if seq[-1] == PENDING_TOKEN:                  # only ever the one token this step computes
                assert row.start == len(seq) - 1 and row.num_tokens == 1 and row.token_ids == [PENDING_TOKEN]
                seq[-1] = prev[row.request_id]
            assert PENDING_TOKEN not in seq
            table = row.block_table
            assert table == req.block_ids[:len(table)] and len(table) * BS >= row.start + row.num_tokens > (len(table) - 1) * BS
            for p in range(row.start):                      # the context it attends to
                assert self.kv.get(table[p // BS] * BS + p % BS) == seq[p], (row.request_id, p)
            for p in range(row.start, row.start + row.num_tokens):
                self.kv[table[p // BS] * BS + p % BS] = seq[p]
            if row.samples:
                n_out = len(seq) - req.num_prompt_tokens
                out[row.request_id] = EOS if self.eos_at.get(row.request_id) == n_out else next_token(seq)
        return out


class Driver:
    """Steps the scheduler and the fake model the way Engine.step does, sync or async."""

    def __init__(self, sched: Scheduler, model: FakeModel, overlap: bool) -> None:
        self.sched, self.model, self.overlap = sched, model, overlap
        self.in_flight = None

    @property
    def busy(self) -> bool:
        return self.sched.has_work or self.in_flight is not None

    def step(self):
        plan = self.sched.schedule()
        assert plan or self.in_flight, "work is queued but nothing was scheduled"
        sampled = self.model.execute(plan, self.in_flight[1] if self.in_flight else None) if plan else {}
        self.sched.commit(plan)
        if not self.overlap:
            return self.sched.update(plan, sampled)
        prev, self.in_flight = self.in_flight, ((plan, sampled) if plan else None)
        return self.sched.update(*prev) if prev else []


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def overlap(request) -> bool:
    return request.param


def make(num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 16, max_model_len: int = 256,
         caching: bool = True):
    pool = BlockPool(num_blocks, enable_caching=caching)
    sched = Scheduler(pool, BS, max_model_len, max_num_seqs, budget, eos_token_ids=(EOS,))
    model = FakeModel(num_blocks, budget)
    model.truth = sched.requests
    return sched, model


def run(sched: Scheduler, model: FakeModel, overlap: bool = False, max_steps: int = 10_000):
    """Step until idle; return each request's outputs (token ids, finish reason, cached tokens)."""
    results: dict[str, dict] = {}
    driver = Driver(sched, model, overlap)
    for _ in range(max_steps):
        if not driver.busy:
            break
        for o in driver.step():
            r = results.setdefault(o.request_id, {"tokens": [], "reason": None, "cached": None})
            assert r["reason"] is None, "output after finishing"
            r["tokens"] += o.new_token_ids
            r["reason"] = o.finish_reason
            if o.num_cached_tokens >= 0:
                assert r["cached"] is None
                r["cached"] = o.num_cached_tokens
        sched.pool.check_invariants()
    assert not driver.busy
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


def test_chunked_prefill_respects_the_budget_and_decodes_join_the_batch(overlap):
    sched, model = make(budget=16)
    rng = random.Random(0)
    prompts = {"long": rand_prompt(rng, 50), "short": rand_prompt(rng, 3)}
    sched.add(req("long", prompts["long"], max_tokens=5))
    sched.add(req("short", prompts["short"], max_tokens=20))
    out = run(sched, model, overlap)
    long_chunks = [(s, n) for step in model.steps for rid, s, n in step if rid == "long"]
    assert long_chunks[:4] == [(0, 16), (16, 16), (32, 16), (48, 2)]
    assert all(n == 1 for _, n in long_chunks[4:])
    assert any(len(step) == 2 for step in model.steps)          # prefill and decode shared steps
    for rid, p in prompts.items():
        assert out[rid]["tokens"] == expected_tokens(p, len(out[rid]["tokens"]))
    assert out["long"]["reason"] == out["short"]["reason"] == FinishReason.LENGTH
    assert sched.pool.num_free == sched.pool.num_blocks


def test_prefix_hit_skips_cached_blocks_but_always_computes_the_last_token(overlap):
    sched, model = make(budget=64)
    rng = random.Random(1)
    shared = rand_prompt(rng, 4 * BS)
    sched.add(req("a", shared + rand_prompt(rng, 5)))
    out = run(sched, model, overlap)
    assert out["a"]["cached"] == 0
    # same 4 full blocks then a different tail: 4 blocks (16 tokens) are reused
    b_prompt = shared + rand_prompt(rng, 3)
    sched.add(req("b", b_prompt))
    # exactly the cached prompt: its last block must be recomputed to get logits for the last token
    sched.add(req("c", list(shared)))
    model.steps.clear()
    out = run(sched, model, overlap)
    first = {rid: (s, n) for rid, s, n in model.steps[0]}
    assert out["b"]["cached"] == 16 and first["b"] == (16, 3)
    assert out["c"]["cached"] == 12 and first["c"] == (12, 4)
    assert out["b"]["tokens"] == expected_tokens(b_prompt, 8)
    assert out["c"]["tokens"] == expected_tokens(shared, 8)
    assert sched.num_prefix_hit_tokens == 28
    assert sched.pool.num_free == sched.pool.num_blocks


def test_no_prefix_hits_without_caching(overlap):
    sched, model = make(caching=False)
    p = rand_prompt(random.Random(2), 20)
    sched.add(req("a", p))
    run(sched, model, overlap)
    sched.add(req("b", p))
    out = run(sched, model, overlap)
    assert out["b"]["cached"] == 0 and out["b"]["tokens"] == expected_tokens(p, 8)


def test_preemption_when_blocks_run_out_and_every_request_still_completes(overlap):
    # 12 blocks of 4 tokens; each request grows to 8 + 16 = 24 tokens = 6 blocks; three don't fit
    sched, model = make(num_blocks=12, budget=64)
    rng = random.Random(3)
    prompts = {f"r{i}": rand_prompt(rng, 8) for i in range(3)}
    for rid, p in prompts.items():
        sched.add(req(rid, p, max_tokens=16))
    out = run(sched, model, overlap)
    assert sched.num_preemptions > 0
    for rid, p in prompts.items():
        assert out[rid]["tokens"] == expected_tokens(p, 16), rid
        assert out[rid]["reason"] == FinishReason.LENGTH
    assert sched.pool.num_free == sched.pool.num_blocks


def test_random_workload_matches_the_reference_under_pressure(overlap):
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
    driver = Driver(sched, model, overlap)
    while pending or driver.busy:                # arrivals interleaved with steps
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add(pending.pop(0))
        if not driver.busy:
            continue
        for o in driver.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
        sched.pool.check_invariants()
    for rid, (p, n) in expect.items():
        assert results[rid] == expected_tokens(p, n), rid
    assert sched.num_preemptions > 0 and sched.num_prefix_hit_tokens > 0
    assert sched.pool.num_free == sched.pool.num_blocks


def test_finish_reasons_eos_stop_token_ignore_eos_and_max_tokens(overlap):
    sched, model = make()
    rng = random.Random(5)
    p = rand_prompt(rng, 6)
    ref = expected_tokens(p, 10)
    model.eos_at = {"eos": 3, "ignored": 3}
    sched.add(req("eos", p, max_tokens=10))
    sched.add(req("ignored", p, max_tokens=10, ignore_eos=True))
    sched.add(req("stop_id", p, max_tokens=10, stop_token_ids=frozenset({ref[4]})))
    sched.add(req("length", p, max_tokens=7))
    out = run(sched, model, overlap)
    assert out["eos"]["tokens"] == ref[:3] + [EOS] and out["eos"]["reason"] == FinishReason.STOP
    ignored = out["ignored"]["tokens"]
    assert len(ignored) == 10 and ignored[3] == EOS and out["ignored"]["reason"] == FinishReason.LENGTH
    assert out["stop_id"]["tokens"] == ref[:5] and out["stop_id"]["reason"] == FinishReason.STOP
    assert out["length"]["tokens"] == ref[:7] and out["length"]["reason"] == FinishReason.LENGTH


def test_stop_token_ids_apply_even_with_ignore_eos(overlap):
    sched, model = make()
    p = rand_prompt(random.Random(6), 5)
    ref = expected_tokens(p, 10)
    sched.add(req("a", p, max_tokens=10, ignore_eos=True, stop_token_ids=frozenset({ref[2]})))
    out = run(sched, model, overlap)
    assert out["a"]["tokens"] == ref[:3] and out["a"]["reason"] == FinishReason.STOP


def test_the_context_limit_ends_a_request_with_length(overlap):
    sched, model = make(max_model_len=20)
    p = rand_prompt(random.Random(7), 15)
    sched.add(req("a", p, max_tokens=100))
    out = run(sched, model, overlap)
    assert len(out["a"]["tokens"]) == 5 and out["a"]["reason"] == FinishReason.LENGTH


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched, model = make(budget=8, max_num_seqs=1)
    rng = random.Random(8)
    sched.add(req("running", rand_prompt(rng, 30), max_tokens=50))
    sched.add(req("waiting", rand_prompt(rng, 30), max_tokens=50))
    driver = Driver(sched, model, overlap=False)
    for _ in range(3):
        driver.step()
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
    plan = sched.schedule()
    sampled = model.execute(plan)
    sched.commit(plan)
    sched.abort("a")
    assert sched.update(plan, sampled) == []
    assert sched.pool.num_free == sched.pool.num_blocks
    sched.pool.check_invariants()


def test_async_eos_costs_one_discarded_step_and_frees_blocks_only_after_it():
    """A request that stops on EOS was already scheduled on its pending token: that step's output
    is dropped, and its blocks stay allocated until the step is known to be done."""
    sched, model = make()
    p = rand_prompt(random.Random(11), 6)
    model.eos_at = {"a": 2}
    sched.add(req("a", p, max_tokens=10))
    driver = Driver(sched, model, overlap=True)
    outs = []
    while not any(o.finish_reason for o in outs):
        outs += driver.step()
    assert [t for o in outs for t in o.new_token_ids] == expected_tokens(p, 2) + [EOS]
    assert driver.in_flight is not None and driver.in_flight[0].rows[0].request_id == "a"
    assert sched.pool.num_free < sched.pool.num_blocks      # the discarded step may still write
    assert driver.step() == [] and driver.in_flight is None
    assert sched.pool.num_free == sched.pool.num_blocks
    sched.pool.check_invariants()


def test_async_max_tokens_is_known_ahead_so_no_step_is_wasted():
    sched, model = make()
    sched.add(req("a", rand_prompt(random.Random(12), 6), max_tokens=3))
    out = run(sched, model, overlap=True)
    assert len(out["a"]["tokens"]) == 3 and out["a"]["reason"] == FinishReason.LENGTH
    assert [n for step in model.steps for _, _, n in step] == [6, 1, 1]     # prefill, 2 decodes


def test_abort_while_a_step_is_in_flight_defers_the_free():
    sched, model = make()
    sched.add(req("a", rand_prompt(random.Random(13), 6), max_tokens=10))
    driver = Driver(sched, model, overlap=True)
    for _ in range(3):
        driver.step()
    assert sched.abort("a") is not None
    assert sched.pool.num_free < sched.pool.num_blocks
    assert driver.step() == [] and not driver.busy
    assert sched.pool.num_free == sched.pool.num_blocks


def test_max_num_seqs_limits_the_running_set(overlap):
    sched, model = make(max_num_seqs=2)
    rng = random.Random(10)
    for i in range(5):
        sched.add(req(f"r{i}", rand_prompt(rng, 5), max_tokens=4))
    out = run(sched, model, overlap)
    assert max(len(step) for step in model.steps) == 2
    assert len(out) == 5 and all(o["reason"] == FinishReason.LENGTH for o in out.values())
