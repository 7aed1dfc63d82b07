"""Does computing prompt logprobs cost the requests that do not ask? `bench serve` against this tree
and a baseline tree (a commit before prompt logprobs), in alternating rounds in one run.

    python bench/prompt_logprobs_cost.py --base-ref a6c9c61 [--rounds 5 --isl 256 --osl 32 --concurrency 4]

Each round starts `splitserve serve` (tiny model, CPU, aggregated, one worker) from the baseline
source (a `git archive` of --base-ref) and from this tree, in turn (which goes first alternates), and drives each with the same
`splitserve bench serve` load of requests that ask for no prompt logprobs (this tree's client, so the
load is identical). A last round on this tree sends the same load with `echo` + `logprobs: 1` and
`max_tokens` as before, to show what asking costs. Then the engine alone (one process, no HTTP:
`Engine.step()` over a batch of the same requests) from each tree, in alternating rounds too: the
part the change touches, with less of the shared machine's noise. Prints one JSON line per measurement and a
summary: the median output tok/s of each side and the median of the rounds' ratios (this / base);
and, since wall time on a shared machine moves with other jobs, the CPU time each side spent: the
serve process tree's CPU milliseconds per output token during the load (/proc), and the engine
process's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splitserve.bench.records import git_sha  # noqa: E402
from tests.integration import cluster as cluster_mod  # noqa: E402


def baseline_tree(ref: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix="splitserve-base-"))
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def tree_cpu_s(root_pid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes under `root_pid` (the serve
    launcher: its frontend, workers and Redis), read from /proc."""
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        procs[int(d)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    total = 0
    for pid, (_, ticks) in procs.items():
        p = pid
        while p in procs and p != root_pid:
            p = procs[p][0]
        if p == root_pid:
            total += ticks
    return total / os.sysconf("SC_CLK_TCK")


def serve_load(root: Path, args, extra_body: dict | None = None) -> dict:
    """Start serve from `root` and run this tree's bench serve against it; the bench's summary."""
    old_root = cluster_mod.ROOT
    cluster_mod.ROOT = root                      # serve runs from that tree (its cwd is on the path)
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(root)
    try:
        with cluster_mod.own_cluster("--model", "tiny", "--prefill-workers", "0", "--decode-workers", "1") as c:
            cmd = [sys.executable, "-m", "splitserve", "bench", "serve", "--url", c.url, "--isl", str(args.isl),
                   "--osl", str(args.osl), "--concurrency", str(args.concurrency), "--num-requests",
                   str(args.num_requests), "--seed", str(args.seed), "--no-progress"]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            if extra_body:
                cmd += ["--extra-body", json.dumps(extra_body)]
            cpu0 = tree_cpu_s(c.proc.pid)
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            cpu_s = tree_cpu_s(c.proc.pid) - cpu0
            if proc.returncode:
                raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
            rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            summary = next(r for r in rows if r.get("bench") == "serve")
            summary["cluster_cpu_ms_per_tok"] = 1e3 * cpu_s / (args.num_requests * args.osl)
            return summary
    finally:
        cluster_mod.ROOT = old_root
        if env_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_path


_ENGINE_RUN = """
import json, sys, time
import torch
from engine.engine import Engine
from runtime.config import EngineConfig
from runtime.types import EngineRequest, SamplingParams
from splitserve.models import resolve_model
isl, osl, n = (int(x) for x in sys.argv[1:4])
eng = Engine(EngineConfig(model=resolve_model("tiny"), device="cpu", num_blocks=1024, attention_backend="torch",
                          max_num_batched_tokens=2048))
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(5, 4000, (isl,), generator=g).tolist() for _ in range(n + 1)]
def run(reqs):
    for rid, p in reqs:
        eng.add_request(EngineRequest(rid, p, SamplingParams(temperature=0.0, max_tokens=osl, ignore_eos=True)))
    out = 0
    while eng.has_work:
        out += sum(len(o.new_token_ids) for o in eng.step().outputs)
    return out
run([("warm", prompts[-1])])
t, cpu = time.perf_counter(), time.process_time()
out = run([(str(i), p) for i, p in enumerate(prompts[:n])])
print(json.dumps({"engine_tok_s": out / (time.perf_counter() - t), "engine_cpu_ms_per_tok": 1e3 * (time.process_time() - cpu) / out}))
"""


_LOOP_RUN = """
import json, os, random, sys, tempfile, time
from engine.engine import Engine
from runtime.config import EngineConfig
from runtime.types import EngineRequest, SamplingParams
from splitserve.models import resolve_model
isl, osl = (int(x) for x in sys.argv[1:3])
prof = os.path.join(tempfile.mkdtemp(), "zero.json")
with open(prof, "w") as f:
    json.dump({"curve": {"base_s": 0.0, "per_token_s": 0.0, "per_attn_pair_s": 0.0, "per_kv_token_s": 0.0}}, f)
eng = Engine(EngineConfig(model=resolve_model("tiny"), mock=True, mock_profile=prof, num_blocks=8192,
                          max_num_batched_tokens=2048, async_scheduling=False))
rnd = random.Random(0)
def run(k):
    for i in range(64):
        eng.add_request(EngineRequest(f"{k}-{i}", [rnd.randrange(5, 4000) for _ in range(isl)],
                                      SamplingParams(temperature=0.0, max_tokens=osl, ignore_eos=True)))
    out = 0
    while eng.has_work:
        out += sum(len(o.new_token_ids) for o in eng.step().outputs)
    return out
run("warm")
cpu = time.process_time()
out = sum(run(k) for k in range(3))
print(json.dumps({"loop_cpu_us_per_tok": 1e6 * (time.process_time() - cpu) / out}))
"""


def loop_run(root: Path, args) -> float:
    """The scheduler and engine loop alone (the mock runner at zero step time: no model), from
    `root`'s source, 64 requests at a time: CPU microseconds per output token."""
    proc = subprocess.run([sys.executable, "-c", _LOOP_RUN, str(args.isl), str(args.osl)], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=600,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["loop_cpu_us_per_tok"]


def engine_run(root: Path, args) -> dict:
    """The engine alone (no processes, no HTTP), from `root`'s source, over a batch of requests that
    ask for no prompt logprobs: output tok/s, and the process's CPU milliseconds per output token
    (what the change could add; unlike wall time, barely moved by other jobs on the machine)."""
    proc = subprocess.run([sys.executable, "-c", _ENGINE_RUN, str(args.isl), str(args.osl), str(2 * args.concurrency)],
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-ref", required=True, help="the baseline commit (before prompt logprobs)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--isl", type=int, default=256)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    base = baseline_tree(args.base_ref)
    common = {"bench": "prompt_logprobs_cost", "git_sha": git_sha(), "base_ref": args.base_ref,
              "device": f"cpu ({os.cpu_count()} cores, {platform.machine()})", "model": "tiny",
              "isl": args.isl, "osl": args.osl, "concurrency": args.concurrency, "num_requests": args.num_requests}
    tok_s: dict[str, list[float]] = {"base": [], "this": []}
    itl: dict[str, list[float]] = {"base": [], "this": []}
    cpu: dict[str, list[float]] = {"base": [], "this": []}
    for r in range(args.rounds):
        sides = (("base", base), ("this", ROOT))
        for side, root in sides if r % 2 == 0 else sides[::-1]:     # alternate which side runs first
            s = serve_load(root, args)
            tok_s[side].append(s["output_tok_s"])
            itl[side].append(s["itl_p50_s"])
            cpu[side].append(s["cluster_cpu_ms_per_tok"])
            print(json.dumps({**common, "round": r, "side": side, "output_tok_s": round(s["output_tok_s"], 1),
                              "cluster_cpu_ms_per_tok": round(s["cluster_cpu_ms_per_tok"], 3),
                              "ttft_p50_s": s["ttft_p50_s"], "itl_p50_s": s["itl_p50_s"], "errors": s["errors"]}),
                  flush=True)
    eng: dict[str, list[float]] = {"base": [], "this": []}
    for r in range(args.rounds):
        sides = (("base", base), ("this", ROOT))
        for side, root in sides if r % 2 == 0 else sides[::-1]:
            e = engine_run(root, args)
            eng[side].append(e["engine_cpu_ms_per_tok"])
            print(json.dumps({**common, "round": r, "side": side, "engine_tok_s": round(e["engine_tok_s"], 1),
                              "engine_cpu_ms_per_tok": round(e["engine_cpu_ms_per_tok"], 3)}), flush=True)
    loop: dict[str, list[float]] = {"base": [], "this": []}
    for r in range(args.rounds):
        sides = (("base", base), ("this", ROOT))
        for side, root in sides if r % 2 == 0 else sides[::-1]:
            loop[side].append(loop_run(root, args))
            print(json.dumps({**common, "round": r, "side": side, "loop_cpu_us_per_tok": round(loop[side][-1], 3)}),
                  flush=True)
    asking = serve_load(ROOT, args, {"echo": True, "logprobs": 1})
    print(json.dumps({**common, "side": "this, asking (echo + logprobs 1)", "output_tok_s": round(asking["output_tok_s"], 1),
                      "ttft_p50_s": asking["ttft_p50_s"], "itl_p50_s": asking["itl_p50_s"], "errors": asking["errors"]}),
          flush=True)
    # paired: each round's two sides ran back to back, so a round disturbed by other load on the
    # machine moves both or shows as one outlying ratio, which the median of the ratios ignores
    ratios = [t / b for b, t in zip(tok_s["base"], tok_s["this"])]
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    print(json.dumps({**common, "bench": "prompt_logprobs_cost_summary", "median_output_tok_s": med,
                      "round_ratios": [round(r, 3) for r in ratios],
                      "itl_p50_ratio_median": round(statistics.median(t / b for b, t in zip(itl["base"], itl["this"])), 3),
                      "this_over_base": round(statistics.median(ratios), 3),
                      "asking_over_this": round(asking["output_tok_s"] / med["this"], 3),
                      "cluster_cpu_ms_per_tok_median": {k: round(statistics.median(v), 3) for k, v in cpu.items()},
                      "cluster_cpu_ratio_median": round(statistics.median(t / b for b, t in zip(cpu["base"], cpu["this"])), 3),
                      "engine_cpu_ms_per_tok_median": {k: round(statistics.median(v), 3) for k, v in eng.items()},
                      "engine_cpu_ratio_median": round(statistics.median(t / b for b, t in zip(eng["base"], eng["this"])), 3),
                      "loop_cpu_us_per_tok_median": {k: round(statistics.median(v), 3) for k, v in loop.items()},
                      "loop_cpu_ratio_median": round(statistics.median(t / b for b, t in zip(loop["base"], loop["this"])), 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
