"""Host time per engine step that the scheduler costs, at two commits in the same run (a ratio).

The scheduler runs on the GPU worker's hot path: one `schedule()`, `commit()` and `update()` per
step. This drives the real `Scheduler` with the mock runner (engine/mock_runner.py, its sleep a
no-op, so a step is host work only) in the engine's async order (schedule and launch step N+1,
then read and update step N), and times the scheduler's calls apart from the runner's.

  PYTHONPATH=$PWD python bench/scheduler_step_cost.py --baseline e949668 [--repeats 7] [--steps 300]

The parent exports the baseline commit with `git archive`, then runs one child process per tree
and repeat, alternating which tree goes first, each importing its own tree's engine. Scenarios:

- ``decode256``: 256 running decodes (128-token prompts), the steps after all of them prefilled.
- ``mixed``: chunked prefill beside decodes: a 1,024-token prompt arrives every step (its first
  256 tokens one of 8 shared system prompts, so prefix hits), each generating 64 tokens, besides
  32 long decodes; about 80 requests running.
- ``deadline``: a prefill worker with a TTFT target of 50 ms and a budget of 512 tokens: 128
  prompts of 256 tokens queued (64 of them past saving), two arriving and two admitted per step,
  one output token each, the queue in deadline order.
- ``engine_decode256``: decode256 through `Engine.step` (the step loop around the scheduler).
- ``engine_tiers``: `Engine.step` with the mock's KV tiers (a host tier, G1 under pressure): 24
  conversations of 1,024-token prefixes take turns, so their prefixes go to G2 and come back.

Per scenario and tree: the median over repeats of each repeat's median step, in µs of thread CPU
time (`sched_us`: schedule + commit + update; `runner_us`: launch + result; `step_us`: an
`Engine.step`). Where the scenario is deterministic (no wall-clock decisions) `digest` hashes
every plan's rows and copies, every output and every KV event, so the two trees' digests agree
exactly when they made the same plans, tokens and events in the same order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SCENARIOS = ("decode256", "mixed", "deadline", "engine_decode256", "engine_tiers")


# ---- child: one tree, every scenario, one repeat ----------------------------------------------

def _engine_cfg(**kw):
    from runtime.config import EngineConfig
    from splitserve.models import resolve_model
    base = dict(model=resolve_model("tiny"), mock=True, num_blocks=32768, max_model_len=4096,
                max_num_batched_tokens=2048, max_num_seqs=256)
    return EngineConfig(**{**base, **kw})


def _prompt(rng, n: int, prefix: list[int] | None = None) -> list[int]:
    head = list(prefix or [])
    return head + [rng.randrange(1, 30000) for _ in range(n - len(head))]


class _Digest:
    def __init__(self) -> None:
        self.h = hashlib.blake2b(digest_size=12)

    def plan(self, plan) -> None:
        self.h.update(repr([(r.request_id, r.start, r.token_ids, r.block_table, r.samples, r.unseen)
                            for r in plan.rows]).encode())
        self.h.update(repr([(c.src_tier, c.src_block, c.dst_tier, c.dst_block) for c in plan.copies]).encode())
        self.h.update(repr((plan.finished, plan.wait_onboard)).encode())

    def outputs(self, outs) -> None:
        self.h.update(repr(outs).encode())

    def events(self, events) -> None:
        self.h.update(repr(events).encode())


def _set_deadline(sched, deadline_s: float) -> None:
    """The prefill deadline, where this tree keeps it (before and after the scheduler's split)."""
    if hasattr(sched, "order"):
        sched.order.deadline_s = deadline_s
    else:
        sched.prefill_deadline_s = deadline_s


def _drive(sched, runner, pool, steps: int, warm: int, feed, digest: _Digest | None) -> dict:
    """Run warm + steps steps in the engine's async order; time the measured ones."""
    clock = time.thread_time_ns
    sched_ns, runner_ns = [], []
    prev = None
    for i in range(warm + steps):
        feed(i)
        t0 = clock()
        plan = sched.schedule()
        t1 = clock()
        launched = runner.launch(plan, prev[1] if prev else None) if plan else None
        t2 = clock()
        if plan:
            sched.commit(plan)
        t3 = clock()
        sampled = prev[1].result() if prev else None
        t4 = clock()
        outs = sched.update(prev[0], sampled) if prev else []
        t5 = clock()
        prev = (plan, launched) if plan else None
        if i >= warm:
            sched_ns.append((t1 - t0) + (t3 - t2) + (t5 - t4))
            runner_ns.append((t2 - t1) + (t4 - t3))
        if digest is not None:
            digest.plan(plan)
            digest.outputs(outs)
            digest.events(pool.take_events())
    return {"sched_us": statistics.median(sched_ns) / 1e3, "runner_us": statistics.median(runner_ns) / 1e3}


def _scheduler(cfg):
    from engine.engine import Engine
    from engine.mock_runner import MockModelRunner
    eng = Engine(cfg, runner=MockModelRunner(cfg, sleep=lambda s: None))
    return eng, eng.scheduler, eng.runner


def _add(eng, rid: str, prompt: list[int], max_tokens: int) -> None:
    from runtime.types import EngineRequest, RequestId, SamplingParams
    out = eng.add_request(EngineRequest(RequestId(rid), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    assert out is None, out.error


def scenario_decode256(steps: int, seed: int) -> dict:
    import random
    rng = random.Random(seed)
    eng, sched, runner = _scheduler(_engine_cfg())
    for i in range(256):
        _add(eng, f"d{i}", _prompt(rng, 128), 4000 - 128)
    digest = _Digest()
    out = _drive(sched, runner, eng.pool, steps, warm=40, feed=lambda i: None, digest=digest)
    assert len(sched.running) == 256
    return {**out, "digest": digest.h.hexdigest()}


def scenario_mixed(steps: int, seed: int) -> dict:
    import random
    rng = random.Random(seed)
    eng, sched, runner = _scheduler(_engine_cfg(num_blocks=8192))
    systems = [_prompt(rng, 256) for _ in range(8)]
    for i in range(32):
        _add(eng, f"long{i}", _prompt(rng, 200), 4000 - 200)

    def feed(i: int) -> None:
        _add(eng, f"m{i}", _prompt(rng, 1024, systems[rng.randrange(8)]), 64)

    digest = _Digest()
    out = _drive(sched, runner, eng.pool, steps, warm=120, feed=feed, digest=digest)
    return {**out, "digest": digest.h.hexdigest(), "running": len(sched.running)}


def scenario_deadline(steps: int, seed: int) -> dict:
    import random
    rng = random.Random(seed)
    eng, sched, runner = _scheduler(_engine_cfg(num_blocks=16384, max_num_batched_tokens=512))
    sched.track_prefill_time = True
    _set_deadline(sched, 0.05)
    for i in range(64):
        _add(eng, f"late{i}", _prompt(rng, 256), 1)
    time.sleep(0.06)                       # these 64 are past a 50 ms target now

    def feed(i: int) -> None:              # two prompts a step arrive, two are admitted
        _add(eng, f"p{i}", _prompt(rng, 256), 1)
        _add(eng, f"q{i}", _prompt(rng, 256), 1)
        if i == 0:
            for j in range(64):
                _add(eng, f"fresh{j}", _prompt(rng, 256), 1)

    out = _drive(sched, runner, eng.pool, steps, warm=10, feed=feed, digest=None)
    return {**out, "waiting": len(sched.waiting)}


def scenario_engine_decode256(steps: int, seed: int) -> dict:
    import random
    from engine.engine import Engine
    from engine.mock_runner import MockModelRunner
    rng = random.Random(seed)
    cfg = _engine_cfg()
    eng = Engine(cfg, runner=MockModelRunner(cfg, sleep=lambda s: None))
    for i in range(256):
        _add(eng, f"d{i}", _prompt(rng, 128), 4000 - 128)
    digest, times = _Digest(), []
    for i in range(40 + steps):
        t0 = time.thread_time_ns()
        res = eng.step()
        if i >= 40:
            times.append(time.thread_time_ns() - t0)
        digest.outputs(res.outputs)
        digest.events(res.events)
    return {"step_us": statistics.median(times) / 1e3, "digest": digest.h.hexdigest()}


def scenario_engine_tiers(steps: int, seed: int) -> dict:
    import random
    from engine.engine import Engine
    from engine.mock_runner import MockModelRunner
    rng = random.Random(seed)
    cfg = _engine_cfg(num_blocks=1024, kv_host_gib=12.0, kv_onboard="always")
    eng = Engine(cfg, runner=MockModelRunner(cfg, sleep=lambda s: None))
    convs = [_prompt(rng, 1024) for _ in range(24)]
    times = []
    try:
        for i in range(60 + steps):
            if i % 2 == 0:
                c = convs[rng.randrange(len(convs))]
                _add(eng, f"t{i}", c + _prompt(rng, 64), 32)
            t0 = time.thread_time_ns()
            eng.step()
            if i >= 60:
                times.append(time.thread_time_ns() - t0)
        running = len(eng.scheduler.running)
    finally:
        eng.close()
    return {"step_us": statistics.median(times) / 1e3, "running": running}


def child(args) -> None:
    for name in args.scenarios.split(","):
        row = globals()[f"scenario_{name}"](args.steps, args.seed)
        print(json.dumps({"scenario": name, **row}), flush=True)


# ---- parent: both trees, interleaved ----------------------------------------------------------

def _git(*a: str, cwd: str) -> str:
    return subprocess.run(["git", *a], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _run_child(tree: str, args) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--steps", str(args.steps),
           "--seed", str(args.seed), "--scenarios", args.scenarios]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"child in {tree} failed:\n{p.stderr[-4000:]}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def parent(args) -> None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    head = _git("rev-parse", "--short", "HEAD", cwd=repo)
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", cwd=repo))
    base_sha = _git("rev-parse", "--short", args.baseline, cwd=repo)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", base_sha], cwd=repo, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        trees = {"baseline": tmp, "new": repo}
        runs: dict[str, list[list[dict]]] = {"baseline": [], "new": []}
        for r in range(args.repeats):
            for name in (("baseline", "new") if r % 2 == 0 else ("new", "baseline")):
                runs[name].append(_run_child(trees[name], args))
    shas = {"baseline": base_sha, "new": head + ("+dirty" if dirty else "")}
    for i, scen in enumerate(args.scenarios.split(",")):
        row = {"bench": "scheduler_step_cost", "scenario": scen, "device": "cpu", "steps": args.steps,
               "repeats": args.repeats, "seed": args.seed}
        for name in ("baseline", "new"):
            rows = [run[i] for run in runs[name]]
            for key in ("sched_us", "runner_us", "step_us"):
                if key in rows[0]:
                    row[f"{name}_{key}"] = round(statistics.median(x[key] for x in rows), 2)
                    row[f"{name}_{key}_all"] = [round(x[key], 2) for x in rows]
            digests = {x.get("digest") for x in rows}
            row[f"{name}_git_sha"] = shas[name]
            if None not in digests:
                row[f"{name}_digest"] = digests.pop() if len(digests) == 1 else sorted(digests)
        for key in ("sched_us", "step_us"):
            if f"new_{key}" in row:
                row[f"ratio_{key}"] = round(row[f"new_{key}"] / row[f"baseline_{key}"], 4)
        if "new_digest" in row:
            row["same_digest"] = row["new_digest"] == row["baseline_digest"]
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="HEAD", help="the commit to compare the working tree with")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
