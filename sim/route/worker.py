"""One simulated worker for the routing simulator (routesim.py): a queue model on the real block pool.

What is real: the KV block pool (kvstore/pools/block_pool.py), so the LRU, prefix hits, evictions and the
KV events the router ingests are the workers' own; and the step time, from the same timing model
the mock engine sleeps by (perf/profile.py). What is modelled: the scheduler, as a short copy of
engine/scheduler.py's policy without its engine plumbing (no async scheduling, no remote prefill,
no stop tokens): each step has a token budget; running requests go first (a decode is one token, an
unfinished prompt its next chunk), then waiting requests are admitted in arrival order, each
starting after its longest cached prefix (at least its last token is computed); when the pool runs
dry the most recently admitted request is preempted (its blocks freed, still cached) and requeued at
the head. Full blocks are registered as soon as a step that computes them starts, as the engine's
`commit` does, and a request's blocks are freed when it ends.

The simulator owns time: ``start_step(now)`` plans and commits a step and returns its duration;
``end_step()`` samples its tokens and returns the requests that got their first token or finished.
It knows nothing of routers or clocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvstore.pools.block_pool import BlockPool, NoFreeBlocks
from perf.profile import StepTiming

_OUTPUT_HASH_BIT = 1 << 63     # output blocks get hashes no prompt uses: (bit | request << 24 | i)


@dataclass(slots=True)
class SimRequest:
    """One request of a simulated workload: the prompt as block hashes at the workers' block size."""
    index: int                      # position in the workload; makes ids and output hashes unique
    arrival_s: float
    prompt_len: int
    output_len: int
    block_hashes: list[int]         # the prompt's full blocks
    cache_key: str | None = None    # OpenAI prompt_cache_key / user: the router's affinity hint

    @property
    def request_id(self) -> str:
        return f"r{self.index}"


@dataclass(slots=True)
class Seq:
    """A request's state on its worker (what engine/request.py keeps for the scheduler)."""
    req: SimRequest
    hashes: list[int]
    num_tokens: int                 # prompt + tokens generated so far
    computed: int = 0
    registered: int = 0
    block_ids: list[int] = field(default_factory=list)
    cached_tokens: int = -1         # prefix hit at first admission (-1: not admitted yet)
    generated: int = 0
    first_token_s: float = -1.0
    finish_s: float = -1.0


@dataclass(slots=True)
class WorkerStats:
    prompt_tokens: int = 0          # admitted (first admission), cached or not
    hit_tokens: int = 0
    computed_tokens: int = 0        # every token a step computed, recomputation included
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0


class SimWorker:
    def __init__(self, worker_id: str, num_blocks: int, block_size: int, timing: StepTiming,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 256) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.timing = timing
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.stats = WorkerStats()
        self.busy = False               # a step is in flight
        self._plan: list[tuple[Seq, int, int]] = []

    # ---- intake and status -------------------------------------------------------------------

    def add(self, req: SimRequest) -> Seq:
        seq = Seq(req, list(req.block_hashes), req.prompt_len)
        self.waiting.append(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_prefill_tokens(self) -> int:
        """What the engine reports as num_waiting_prefill_tokens (engine.Engine.stats)."""
        return sum(s.num_tokens for s in self.waiting) + sum(
            s.num_tokens - s.computed - 1 for s in self.running if s.computed < s.num_tokens - 1)

    def active_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    # ---- a step ------------------------------------------------------------------------------

    def start_step(self) -> float:
        """Plan the next step and commit it (register the blocks it computes); its duration in s."""
        assert not self.busy and self.has_work
        plan = self._schedule()
        for seq, _, n in plan:
            seq.computed += n
            self._register(seq)
        self._plan = plan
        self.busy = True
        step_s = self.timing.step_s([(start, n) for _, start, n in plan])
        st = self.stats
        st.steps += 1
        st.busy_s += step_s
        st.computed_tokens += sum(n for _, _, n in plan)
        return step_s

    def end_step(self, now: float) -> tuple[list[Seq], list[Seq]]:
        """The step is done: sample. Returns (sequences that got their first token, finished ones)."""
        first, done = [], []
        for seq, start, n in self._plan:
            if start + n != seq.num_tokens:        # a prompt chunk that does not reach the end
                continue
            seq.generated += 1
            if seq.generated == 1:
                seq.first_token_s = now
                first.append(seq)
            if seq.generated >= seq.req.output_len:
                self._finish(seq, now)
                done.append(seq)
            else:
                seq.num_tokens += 1
        self._plan = []
        self.busy = False
        return first, done

    # ---- the scheduler's policy (engine/scheduler.py) ------------------------------------------

    def _schedule(self) -> list[tuple[Seq, int, int]]:
        budget = self.budget
        plan: list[tuple[Seq, int, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.computed, budget)
            while not self._reserve(seq, seq.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                plan.append((seq, seq.computed, n))
                budget -= n
                i += 1
                continue
            break
        if not preempted:
            self._admit(budget, plan)
        return plan

    def _admit(self, budget: int, plan: list[tuple[Seq, int, int]]) -> None:
        bs = self.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self._extend_hashes(seq)
            hit = self.pool.lookup(seq.hashes)[: (seq.num_tokens - 1) // bs]
            self.pool.touch(hit)
            seq.block_ids = list(hit)
            seq.registered = len(hit)
            seq.computed = len(hit) * bs
            n = min(seq.num_tokens - seq.computed, budget)
            if not self._reserve(seq, seq.computed + n):
                self.pool.free(seq.block_ids)
                seq.block_ids, seq.computed, seq.registered = [], 0, 0
                return
            self.waiting.popleft()
            if seq.cached_tokens < 0:
                seq.cached_tokens = seq.computed
                self.stats.prompt_tokens += seq.req.prompt_len
                self.stats.hit_tokens += seq.computed
            self.running.append(seq)
            plan.append((seq, seq.computed, n))
            budget -= n

    def _reserve(self, seq: Seq, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        try:
            seq.block_ids.extend(self.pool.allocate(need))
        except NoFreeBlocks:
            return False
        return True

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids, seq.computed, seq.registered = [], 0, 0
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Seq, now: float) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.finish_s = now

    def _extend_hashes(self, seq: Seq) -> None:
        """Hashes for the full blocks of generated tokens: unique to the request, as the mock's
        tokens are, so they cost cache room and events but never hit."""
        for i in range(len(seq.hashes), seq.num_tokens // self.block_size):
            seq.hashes.append(_OUTPUT_HASH_BIT | (seq.req.index << 24) | i)

    def _register(self, seq: Seq) -> None:
        full = min(seq.computed, seq.num_tokens) // self.block_size
        if full <= seq.registered:
            return
        self._extend_hashes(seq)
        start = seq.registered
        parent = seq.hashes[start - 1] if start else None
        self.pool.register(seq.block_ids[start:full], seq.hashes[start:full], parent)
        seq.registered = full
