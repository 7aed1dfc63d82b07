"""The frontend tier on mock workers: tokens/s relayed, frontend CPU per token, ITL over the mock step.

    python bench/frontend_bench.py [--frontends 1,2,4,8] [--api http,grpc] [--workers 1]
        [--isl 128 --osl 256 --concurrency 32] [--repeats 3] [--processes 1]
        [--baseline COMMIT] [--output FILE]

For each (api, frontends) and each repeat it starts `splitserve serve --mock --prefill-workers 0`
from a tree, warms it up, reads the CPU time of every frontend process (utime + stime of all its
threads, /proc/PID/stat), runs one closed-loop level of `splitserve bench serve` (always this
tree's load generator, with --processes), and reads the CPU time again. A record says:

- `frontend_cpu_us_per_token`: frontend CPU-seconds over the level / output tokens relayed (the
  figure a 2-core VM can measure under noise: CPU time, not wall time);
- `output_tok_s`, `itl_p50_s`, and `itl_added_ms`: ITL p50 minus the mock step (the timing model's
  decode step for the level's batch per worker, at the mean context);
- `client_lag_p99_s`: the load generator's own lag (a warning when it would distort ITL).

`--baseline COMMIT` measures that commit's tree in the same run: `git archive` of it into a
temporary directory, run there with its own PYTHONPATH, alternating baseline and this tree in every
repeat, so that results are ratios (`summary` lines: medians and baseline/new). A baseline runs
one frontend only (older trees have no --frontends). Prints JSON lines; the last is the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from perf.profile import load_timing  # noqa: E402
from runtime.redis_embedded import free_port  # noqa: E402
from splitserve.bench.records import cpu_model, git_sha  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT_S = 180.0


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) of every thread of the process so far, seconds (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK       # fields 14 and 15 of stat(5)


def cpu_of(pids: list[int]) -> tuple[float, float]:
    times = [cpu_seconds(p) for p in pids]
    return sum(u for u, _ in times), sum(s for _, s in times)


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(d.name))
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


class Tree:
    """A source tree to run `serve` from: this checkout, or a commit unpacked by `git archive`."""

    def __init__(self, commit: str | None, tmp: Path) -> None:
        self.commit = commit
        if commit is None:
            self.path, self.sha = ROOT, git_sha()
            return
        self.path = tmp / f"tree-{commit}"
        self.path.mkdir()
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(self.path)], input=archive, check=True)
        self.sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout.strip()

    def env(self) -> dict[str, str]:
        """This tree first on the path, then what the caller's path adds besides the checkout (a GPU
        host's wheels installed into a directory of their own)."""
        return dict(os.environ, PYTHONPATH=os.pathsep.join([str(self.path), *_extra_path()]), PYTHONUNBUFFERED="1",
                    OMP_NUM_THREADS="1")


def _extra_path() -> list[str]:
    """The caller's PYTHONPATH less this checkout: what it adds besides the code (a GPU host's wheels,
    installed into a directory of their own)."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT.resolve()]


def cpu_list(text: str | None) -> set[int] | None:
    """A CPU list as taskset writes it ("0-11,16"), or None for no pinning."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    usable = os.sched_getaffinity(0)
    if not cpus <= usable:
        raise ValueError(f"CPUs {sorted(cpus - usable)} are not usable here (this process may use {len(usable)})")
    return cpus


def pinned(cpus: set[int] | None):
    """A preexec_fn that pins a child (and everything it starts) to `cpus`."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


class Cluster:
    """`serve --mock` from a tree, on free ports; `frontend_pids` once it is healthy."""

    def __init__(self, tree: Tree, args: argparse.Namespace, frontends: int, log_path: Path) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "splitserve", "serve", "--mock", "--prefill-workers", "0",
                "--decode-workers", str(args.workers), "--http-port", str(self.http_port),
                "--grpc-port", str(self.grpc_port), "--admin-port", "0"]
        if frontends > 1:
            argv += ["--frontends", str(frontends)]
        if args.mock_profile:
            argv += ["--mock-profile", str(Path(args.mock_profile).resolve())]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=tree.path, env=tree.env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=pinned(args.server_cpus))
        self.frontends = frontends
        self.url = f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, workers: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited ({self.proc.returncode}); see {self.log.name}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200 and r.json().get("decode", 0) >= workers and \
                        len(self.frontend_pids()) >= self.frontends:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"serve was not healthy in {START_TIMEOUT_S} s; see {self.log.name}")

    def frontend_pids(self) -> list[int]:
        return [p for p in children(self.proc.pid) if "frontend" in cmdline(p)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def bench_serve(url: str, args: argparse.Namespace, num_requests: int, seed: int) -> dict:
    """One closed-loop level of this tree's `bench serve`; its level record."""
    argv = [sys.executable, "-m", "splitserve", "bench", "serve", "--url", url, "--isl", str(args.isl),
            "--osl", str(args.osl), "--concurrency", str(args.concurrency), "--num-requests", str(num_requests),
            "--warmup", "0", "--seed", str(seed), "--no-progress", "--processes", str(args.processes)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *_extra_path()]), OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.level_timeout_s,
                          preexec_fn=pinned(args.client_cpus))
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    level = next((r for r in records if r.get("bench") == "serve"), None)
    if proc.returncode or level is None:
        raise RuntimeError(f"bench serve failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return level


def mock_step_s(args: argparse.Namespace) -> float:
    """The mock worker's decode step for this level: batch = concurrency / workers, mean context."""
    batch = max(1, round(args.concurrency / args.workers))
    context = args.isl + args.osl // 2
    return load_timing(args.mock_profile).step_s([(context, 1)] * batch)


def measure(tree: Tree, args: argparse.Namespace, api: str, frontends: int, repeat: int, tmp: Path) -> dict:
    cluster = Cluster(tree, args, frontends, tmp / f"serve-{tree.sha}-{api}-{frontends}-{repeat}.log")
    try:
        cluster.wait_ready(args.workers)
        url = cluster.url if api == "http" else f"grpc://127.0.0.1:{cluster.grpc_port}"
        bench_serve(url, args, max(args.concurrency, 2 * frontends), seed=1000 + repeat)     # warm-up
        pids = cluster.frontend_pids()
        frontend_cpus = sorted({len(os.sched_getaffinity(p)) for p in pids})   # what pinning they got
        user0, sys0 = cpu_of(pids)
        level = bench_serve(url, args, args.num_requests or 4 * args.concurrency, seed=repeat)
        user1, sys1 = cpu_of(pids)
        user_s, sys_s = user1 - user0, sys1 - sys0
        cpu_s = user_s + sys_s
    finally:
        cluster.stop()
    tokens = level["output_tokens"]
    step_s = mock_step_s(args)
    itl = level["itl_p50_s"]
    return {"bench": "frontend", "tree": tree.sha, "baseline": tree.commit is not None, "api": api,
            "frontends": frontends, "repeat": repeat, "output_tokens": tokens,
            "frontend_cpus_allowed": frontend_cpus,
            "frontend_cpu_s": round(cpu_s, 3), "frontend_user_s": round(user_s, 3), "frontend_sys_s": round(sys_s, 3),
            "frontend_cpu_us_per_token": round(cpu_s / tokens * 1e6, 2) if tokens else None,
            "frontend_cpu_s_per_1k_tokens": round(cpu_s / tokens * 1e3, 5) if tokens else None,
            "output_tok_s": level["output_tok_s"], "itl_p50_s": itl, "itl_p99_s": level["itl_p99_s"],
            "mock_step_s": round(step_s, 6), "itl_added_ms": round((itl - step_s) * 1e3, 3) if itl else None,
            "ttft_p50_s": level["ttft_p50_s"], "errors": level["errors"],
            "client_lag_p99_s": level.get("client_lag_p99_s"), "load_avg_1m": round(os.getloadavg()[0], 2)}


def summarize(rows: list[dict], common: dict) -> list[dict]:
    out = []
    for key in sorted({(r["api"], r["frontends"]) for r in rows}):
        new = [r for r in rows if (r["api"], r["frontends"]) == key and not r["baseline"]]
        base = [r for r in rows if (r["api"], r["frontends"]) == key and r["baseline"]]

        def med(rs, k):
            vals = [r[k] for r in rs if r.get(k) is not None]
            return round(statistics.median(vals), 4) if vals else None
        s = {**common, "bench": "frontend_summary", "api": key[0], "frontends": key[1], "repeats": len(new),
             **{f"{k}_median": med(new, k) for k in ("frontend_cpu_us_per_token", "output_tok_s", "itl_p50_s",
                                                      "itl_added_ms", "client_lag_p99_s")}}
        if base:
            s["baseline_cpu_us_per_token_median"] = med(base, "frontend_cpu_us_per_token")
            s["baseline_output_tok_s_median"] = med(base, "output_tok_s")
            if s["frontend_cpu_us_per_token_median"]:
                s["cpu_per_token_new_over_baseline"] = round(
                    s["frontend_cpu_us_per_token_median"] / s["baseline_cpu_us_per_token_median"], 3)
        out.append(s)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frontends", default="1", help="comma list of frontend process counts")
    ap.add_argument("--api", default="http,grpc", help="http, grpc or both")
    ap.add_argument("--workers", type=int, default=1, help="mock decode workers")
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=None, help="per level (default 4 x concurrency)")
    ap.add_argument("--processes", type=int, default=1, help="bench serve --processes")
    ap.add_argument("--mock-profile", default=None,
                    help="the mock workers' timing profile (serve --mock-profile; default: the H100 8B curve, "
                         "whose 10.6 ms step at batch 64 caps 512 streams on 8 workers at ~48k tok/s); "
                         "bench/mock-short-step.json leaves the frontends the limit")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="also measure this commit's tree (one frontend)")
    ap.add_argument("--level-timeout-s", type=float, default=600.0)
    ap.add_argument("--output", default=None, help="append the JSON lines to this file")
    ap.add_argument("--label", default="")
    ap.add_argument("--server-cpus", default=None,
                    help="pin the cluster (workers and frontends) to these CPUs, e.g. 0-15 (default: unpinned)")
    ap.add_argument("--client-cpus", default=None,
                    help="pin the load generator to these CPUs, e.g. 16-31, so that its lag does not shape the ITL")
    args = ap.parse_args()
    try:
        server_cpus, client_cpus = cpu_list(args.server_cpus), cpu_list(args.client_cpus)
    except ValueError as e:
        ap.error(str(e))
    args.server_cpus, args.client_cpus = server_cpus, client_cpus
    counts = [int(x) for x in args.frontends.split(",")]
    apis = [a.strip() for a in args.api.split(",")]
    if any(n < 1 for n in counts) or not set(apis) <= {"http", "grpc"} or args.repeats < 1:
        ap.error("--frontends takes counts >= 1, --api http and/or grpc, --repeats >= 1")
    common = {"git_sha": git_sha(), "label": args.label, "device": f"cpu ({os.cpu_count()} cores, "
              f"{platform.machine()})", "cpu_model": cpu_model(), "workers": args.workers, "isl": args.isl,
              "osl": args.osl, "concurrency": args.concurrency, "processes": args.processes,
              "server_cpus": len(server_cpus) if server_cpus else None,
              "client_cpus": len(client_cpus) if client_cpus else None}
    rows = []
    with tempfile.TemporaryDirectory(prefix="frontend-bench-") as tmp_name, \
            open(args.output, "a") if args.output else contextlib.nullcontext() as out:
        tmp = Path(tmp_name)
        trees = [Tree(None, tmp)] + ([Tree(args.baseline, tmp)] if args.baseline else [])

        def emit(rec: dict) -> None:
            print(json.dumps(rec), flush=True)
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
        for repeat in range(args.repeats):
            for api in apis:
                for n in counts:
                    order = trees if repeat % 2 == 0 else trees[::-1]      # alternate who goes first
                    for tree in order:
                        if tree.commit is not None and n != 1:
                            continue
                        row = {**common, **measure(tree, args, api, n, repeat, tmp)}
                        rows.append(row)
                        emit(row)
        for s in summarize(rows, common):
            emit(s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
