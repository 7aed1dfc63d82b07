"""The SLA planner live on a GPU host: `splitserve serve --planner` replays a public trace's arrivals
and lengths (time-compressed) over HTTP, and a static configuration replays the same requests.

    python bench/device/planner_live.py --config planner --out $OUT     # the planner, --gpus 4 GPUs
    python bench/device/planner_live.py --config 2p2d --out $OUT        # a static split (or agg4, 3p1d, ...)
    python bench/device/planner_live.py --mock --gpus 2 --config planner --trace-seconds 120 --speedup 1 \\
        --out /tmp/pl                                                    # CPU smoke: mock workers

Per run:

1. The slice: the trace's requests in [--start-s, --start-s + --trace-seconds), arrival times divided
   by --speedup (which multiplies the request rate by it), prompts clipped to [16, --max-input-len]
   and outputs to [1, --max-output]. It is written to OUT/slice.csv (Azure format), so that `splitserve
   bench plan --trace OUT/slice.csv --warm-start-s 0` simulates exactly these requests.
2. `splitserve serve` on this host: the 8B architecture with random weights (`--load-format dummy`),
   one worker per GPU (serve's placement), the embedded Redis. `planner`: `--planner` with the
   profile, the targets, `--gpu-budget` = --gpus, pools starting at --initial; static: fixed pools,
   the frontend given the same ITL and TTFT targets and decode profile `serve --planner` gives it.
3. A few warm-up requests, then the slice, open loop at its arrival times, token-id prompts with
   max_tokens = the output length (ignore_eos). Meanwhile the admin API's GetStatus is read every
   second: each worker's GPUs (starting and draining ones hold theirs too), the pools' sizes and
   the planner's last decision.
4. One JSON line: SLA attainment (a request meets both TTFT <= target and mean ITL <= target; a
   failed or truncated request misses), GPU-seconds held over the replay, the mean GPUs, worker
   starts, the pools' timeline, errors; OUT/timeline_CONFIG.jsonl and OUT/requests_CONFIG.npz keep the
   samples and each request's TTFT and ITL.

The simulator's forecast for the same slice, settings and configurations, on any machine (no GPU):

    python bench/device/planner_live.py --simulate planner,2p2d,2p1d,agg4 --out DIR   # one line each

runs `splitserve bench plan`'s simulator (its planner settings from the same flags, the pools starting
at --initial, no warm-start history, as the live run has none) on the slice; `splitserve bench plan
--trace DIR/slice.csv --warm-start-s 0 ...` gives the same planner figures and searches the cheapest
static configuration besides (docs/planner.md, "The planner on GPUs").
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sim.workload import Workload, load_workload  # noqa: E402
from splitserve.bench.clients import RequestSpec  # noqa: E402
from splitserve.bench.goodput import request_latencies  # noqa: E402
from splitserve.bench.records import git_sha  # noqa: E402

TRACE = os.path.join(os.environ.get("SPLITSERVE_TRACES", "/work/shared/data/traces"), "azure_llm_2023_conv.csv")
PROFILE = "perf/profiles/h200-llama-3.1-8b-fp8kv.json"
EPOCH = datetime.datetime(2023, 11, 16, 18, 0, 0)      # any date: the CSV's times are relative


def trace_slice(path: str, start_s: float, seconds: float | None, speedup: float, max_input: int,
                max_output: int) -> Workload:
    w = load_workload(path)
    end = np.inf if seconds is None else start_s + seconds
    w = w.take(np.flatnonzero((w.arrival_s >= start_s) & (w.arrival_s < end)))
    if not len(w):
        raise SystemExit(f"planner_live: no request of {path} in [{start_s}, {end}) s")
    w.arrival_s = (w.arrival_s - start_s) / speedup
    w.prompt = np.clip(w.prompt, 16, max_input)
    w.output = np.clip(w.output, 1, max_output)
    return w


def write_azure_csv(w: Workload, path: Path) -> None:
    with open(path, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for t, p, o in zip(w.arrival_s, w.prompt, w.output):
            stamp = (EPOCH + datetime.timedelta(seconds=float(t))).strftime("%Y-%m-%d %H:%M:%S.%f")
            f.write(f"{stamp},{int(p)},{int(o)}\n")


def parse_config(text: str) -> tuple[int, int] | None:
    """planner -> None; aggN -> (0, N); XpYd -> (X, Y)."""
    t = text.lower()
    if t == "planner":
        return None
    try:
        if t.startswith("agg"):
            return 0, int(t[3:])
        p, d = t.rstrip("d").split("p")
        return int(p), int(d)
    except ValueError:
        raise SystemExit(f"--config: planner, aggN or XpYd, not {text!r}") from None


def serve_argv(args, model: str, ports: dict, token: str) -> list[str]:
    t_ms, i_ms = args.targets
    argv = ["serve", "--model", model, "--model-name", args.arch, "--http-port", str(ports["http"]),
            "--grpc-port", str(ports["grpc"]), "--admin-port", str(ports["admin"]), "--admin-token", token]
    if args.mock:
        argv += ["--mock", "--mock-profile", args.profile, "--gpus-per-worker", "0"]
    else:
        argv += ["--load-format", "dummy", "--device", "cuda", "--gpus", ",".join(map(str, range(args.gpus)))]
    pools = parse_config(args.config)
    if pools is None:
        p0, d0 = args.initial
        argv += ["--planner", "--planner-profile", args.profile, "--ttft-ms", str(t_ms), "--itl-ms", str(i_ms),
                 "--gpu-budget", str(args.gpus), "--prefill-workers", str(p0), "--decode-workers", str(d0),
                 "--planner-interval-s", str(args.interval_s), "--planner-startup-s", str(args.startup_s),
                 "--planner-mode", args.planner_mode]
    else:
        argv += ["--prefill-workers", str(pools[0]), "--decode-workers", str(pools[1]),
                 "--itl-target-ms", str(i_ms), "--ttft-target-ms", str(t_ms), "--decode-profile", args.profile]
    return argv + shlex.split(args.serve_args)


def free_port() -> int:
    from runtime.net import free_port as fp
    return fp()


class StatusPoller(threading.Thread):
    """GetStatus once a second: GPUs held (each worker's, starting and draining included) and pools."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(daemon=True)
        from splitserve.admin_cli import AdminClient
        self.client = AdminClient(url, token)
        self.samples: list[dict] = []
        self.errors = 0
        self._halt = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        from proto.splitserve.v1 import admin_pb2

        while not self._halt.is_set():
            t = time.perf_counter() - self.t0
            try:
                st = self.client.call("GetStatus", admin_pb2.GetStatusRequest())
            except Exception:   # noqa: BLE001 - a missed sample is counted, the run goes on
                self.errors += 1
            else:
                held = 0
                for w in st.workers:
                    if w.state in (admin_pb2.WORKER_STATE_STARTING, admin_pb2.WORKER_STATE_READY,
                                   admin_pb2.WORKER_STATE_DRAINING):
                        held += len(w.gpus.split(",")) if w.gpus else max(w.tensor_parallel_size, 1)
                self.samples.append({"t_s": round(t, 2), "gpus_held": held, "pools": {
                    p.pool: {"desired": p.desired, "ready": p.ready, "starting": p.starting,
                             "draining": p.draining, "decision": p.last_decision} for p in st.pools}})
            self._halt.wait(1.0)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)



def held_seconds(samples: list[dict], t_start: float, t_end: float) -> float:
    """∫ GPUs held dt over [t_start, t_end]: each sample's count holds until the next sample."""
    pts = [(s["t_s"], s["gpus_held"]) for s in samples]
    total = 0.0
    for (t, g), (t_next, _) in zip(pts, pts[1:] + [(t_end, 0)]):
        a, b = max(t, t_start), min(t_next, t_end)
        if b > a:
            total += g * (b - a)
    return total


def attainment(results, targets_s: tuple[float, float]) -> dict:
    ttft, itl = request_latencies(results)
    truncated = np.array([r.error is None and bool(r.chunk_times) and r.num_output_tokens < r.expected_tokens
                          for r in results], dtype=bool)
    ok_t = ttft <= targets_s[0]
    ok_i = np.isnan(itl) | (itl <= targets_s[1])
    ok = ok_t & ok_i & ~truncated
    errors = int(np.isinf(ttft).sum())
    fin_t, fin_i = ttft[np.isfinite(ttft)], itl[np.isfinite(itl)]

    def q(x, p, nd):
        return round(float(np.percentile(x, p)), nd) if len(x) else None
    return {"sla_attainment": round(float(ok.mean()), 5), "ttft_attainment": round(float(ok_t.mean()), 5),
            "itl_attainment": round(float(ok_i.mean()), 5), "errors": errors, "truncated": int(truncated.sum()),
            "ttft_p50_s": q(fin_t, 50, 3), "ttft_p90_s": q(fin_t, 90, 3), "ttft_p99_s": q(fin_t, 99, 3),
            "itl_p50_ms": q(fin_i * 1e3, 50, 2), "itl_p90_ms": q(fin_i * 1e3, 90, 2),
            "itl_p99_ms": q(fin_i * 1e3, 99, 2)}, ttft, itl


def gpu_placement() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def model_dir(args) -> str:
    from splitserve.models import resolve_model
    tiny = Path(resolve_model("tiny"))
    if args.mock:
        return str(tiny)
    from engine.loader import write_arch_dir
    model = write_arch_dir(args.arch, Path(tempfile.mkdtemp()) / args.arch)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, model / f)
    return str(model)


def wait_ready(serve: subprocess.Popen, log: Path, timeout_s: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if "Splitserve is ready" in log.read_text(errors="replace"):
            return round(time.monotonic() - started, 1)
        if serve.poll() is not None:
            return None
        time.sleep(1)
    return None


def replay(url: str, model: str, w: Workload, seed: int):
    from splitserve.bench.serve import event_loop_factory, run_level_in_process

    rng = np.random.default_rng([seed, 35])
    prompts = [rng.integers(1, 4096, int(n)) for n in w.prompt]
    specs = [RequestSpec(int(n), int(o), (lambda p=p: p), float(t))
             for n, o, t, p in zip(w.prompt, w.output, w.arrival_s, prompts)]
    warm = [RequestSpec(1024, 16, (lambda p=rng.integers(1, 4096, 1024): p), 0.0) for _ in range(8)]
    client = SimpleNamespace(url=url, timeout_s=600.0, api_key=None, no_progress=not sys.stderr.isatty(),
                             extra_body=None)
    with asyncio.Runner(loop_factory=event_loop_factory("http://")) as runner:
        runner.run(run_level_in_process(client, model, warm, 8, "warm-up"))
        t0 = time.perf_counter()
        run = runner.run(run_level_in_process(client, model, specs, None, "replay"))
        return run, t0, time.perf_counter()


def simulate(args, w: Workload, slice_csv: Path) -> list[dict]:
    """The simulator on the slice for each of --simulate's configurations (planner, aggN, XpYd)."""
    from perf.profile import load_profile
    from planner import Planner
    from sim.plan.simulator import Simulation
    from splitserve.bench import plan as bench_plan

    t_ms, i_ms = args.targets
    ap = argparse.ArgumentParser()
    bench_plan.add_arguments(ap)
    plan_args = ap.parse_args(["--trace", str(slice_csv), "--warm-start-s", "0", "--ttft-ms", str(t_ms),
                               "--itl-ms", str(i_ms), "--planner-profile", args.profile,
                               "--planner-interval-s", str(args.interval_s), "--planner-startup-s",
                               str(args.startup_s), "--gpu-budget", str(args.gpus), "--planner-mode",
                               args.planner_mode, "--seed", str(args.seed), "--no-progress"])
    settings = bench_plan.plan_settings(plan_args)
    profile = load_profile(settings.sla.profile)
    planner_cfg, sim_cfg = bench_plan._configs(plan_args, settings, profile.startup_s)
    records = []
    for name in args.simulate.split(","):
        pools = parse_config(name)
        if pools is None:
            r = Simulation(w, profile, sim_cfg, planner=Planner(planner_cfg, profile),
                           prefill_workers=args.initial[0], decode_workers=args.initial[1]).run()
        else:
            r = Simulation(w, profile, sim_cfg, prefill_workers=pools[0], decode_workers=pools[1]).run()
        ok_t, ok_i = r.ttft_ok(t_ms / 1e3), r.itl_ok(i_ms / 1e3)
        records.append({"bench": "planner_live_sim", "git_sha": git_sha(), "config": name.lower(),
                        "trace": Path(args.trace).name, "speedup": args.speedup, "requests": len(w),
                        "targets_ms": list(args.targets), "profile": args.profile,
                        "handoff_s": sim_cfg.handoff_s, "sla_attainment": round(float((ok_t & ok_i).mean()), 5),
                        "ttft_attainment": round(float(ok_t.mean()), 5),
                        "itl_attainment": round(float(ok_i.mean()), 5),
                        "gpu_seconds": round(r.gpu_s, 1), "mean_gpus": round(r.gpu_s / max(r.end_s, 1e-9), 3),
                        "workers_started": r.workers_started,
                        "local_prefill_share": round(float(r.local_prefill.mean()), 4) if len(r.local_prefill)
                        else None, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return records


def plot(run_dir: Path, path: Path, title: str) -> None:
    """From a directory of live runs (timeline_*.jsonl, requests_*.npz): the request rate, the GPUs
    each configuration held, and the TTFT p90 and mean-ITL p90 per 10 s of arrivals."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    for npz in sorted(run_dir.glob("requests_*.npz")):
        tag = npz.stem.split("_", 1)[1]
        r = np.load(npz)
        edges = np.arange(0.0, float(r["arrival_s"].max()) + 10.0, 10.0)
        which = np.digitize(r["arrival_s"], edges) - 1
        mid = edges[:-1] + 5.0
        if not ax[0].lines:
            ax[0].plot(mid, np.bincount(which, minlength=len(mid))[:len(mid)] / 10.0, color="k")
        for k, (key, scale) in enumerate((("ttft_s", 1.0), ("itl_s", 1e3)), start=2):
            v = r[key] * scale
            p90 = [np.nanpercentile(v[which == i], 90) if np.any(which == i) else np.nan for i in range(len(mid))]
            ax[k].plot(mid, p90, label=tag)
        tl = [json.loads(line) for line in open(run_dir / f"timeline_{tag}.jsonl")]
        ax[1].step([x["t_s"] for x in tl], [x["gpus_held"] for x in tl], where="post", label=tag)
    ax[0].set_ylabel("arrivals (req/s)")
    ax[1].set_ylabel("GPUs held")
    ax[2].set_ylabel("TTFT p90 (s)")
    ax[3].set_ylabel("mean ITL p90 (ms)")
    ax[3].set_xlabel("replay time (s)")
    for a in ax[1:]:
        a.legend(loc="upper right", fontsize=8)
    ax[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="planner, aggN or XpYd (static pools): run it live")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="instead: plot the live runs kept in --out (their timelines and requests)")
    ap.add_argument("--simulate", default=None, metavar="CONFIGS",
                    help="instead: the simulator on the slice, for each of these (comma-separated)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=4, help="GPUs 0..N-1 of those visible: the planner's budget")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--start-s", type=float, default=0.0)
    ap.add_argument("--trace-seconds", type=float, default=None, help="default: to the trace's end")
    ap.add_argument("--speedup", type=float, default=8.0)
    ap.add_argument("--max-input-len", type=int, default=8000)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--targets", default="2000,50", help="TTFT ms, mean ITL ms")
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--interval-s", type=float, default=10.0, help="the planner's decision interval")
    ap.add_argument("--startup-s", type=float, default=20.0, help="the planner's start-up horizon")
    ap.add_argument("--planner-mode", default="disaggregated", choices=("disaggregated", "aggregated", "auto"))
    ap.add_argument("--initial", default="1,1", help="the planner's pools at the start: prefill,decode")
    ap.add_argument("--serve-args", default="--kv-cache-dtype fp8", help="more `serve` flags")
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--mock", action="store_true", help="mock workers on the CPU (serve --mock)")
    ap.add_argument("--startup-timeout-s", type=float, default=420.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    try:
        args.targets = tuple(float(x) for x in args.targets.split(","))
        args.initial = tuple(int(x) for x in args.initial.split(","))
        if len(args.targets) != 2 or len(args.initial) != 2:
            raise ValueError
    except ValueError:
        raise SystemExit("--targets: TTFT_MS,ITL_MS; --initial: PREFILL,DECODE") from None
    if args.speedup <= 0 or args.gpus < 1:
        raise SystemExit("--speedup must be > 0 and --gpus >= 1")
    if args.plot:
        plot(Path(args.out), Path(args.plot), args.label or "planner_live")
        return 0
    if (args.config is None) == (args.simulate is None):
        raise SystemExit("give --config (a live run), --simulate (the simulator) or --plot")
    for name in [args.config] if args.config else args.simulate.split(","):
        parse_config(name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    w = trace_slice(args.trace, args.start_s, args.trace_seconds, args.speedup, args.max_input_len,
                    args.max_output)
    write_azure_csv(w, out / "slice.csv")
    if args.simulate:
        with open(out / "planner_live.jsonl", "a") as f:
            for rec in simulate(args, w, out / "slice.csv"):
                print(json.dumps(rec), flush=True)
                f.write(json.dumps(rec) + "\n")
        return 0
    model = model_dir(args)
    ports = {k: free_port() for k in ("http", "grpc", "admin")}
    token = secrets.token_hex(16)
    tag = args.config.lower()
    log = out / f"serve_{tag}.log"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    argv = serve_argv(args, model, ports, token)
    with open(log, "wb") as f:
        serve = subprocess.Popen([sys.executable, "-m", "splitserve", *argv], env=env, cwd=ROOT, stdout=f,
                                 stderr=subprocess.STDOUT)
    poller = None
    try:
        ready_s = wait_ready(serve, log, args.startup_timeout_s)
        if ready_s is None:
            print(f"planner_live: the {tag} cluster did not start; its log:\n"
                  + log.read_text(errors="replace")[-3000:], file=sys.stderr)
            return 1
        print(f"planner_live: {tag} ready after {ready_s} s; replaying {len(w)} requests over "
              f"{w.arrival_s[-1]:.0f} s", file=sys.stderr, flush=True)
        poller = StatusPoller(f"127.0.0.1:{ports['admin']}", token)
        poller.start()
        run, t0, t1 = replay(f"http://127.0.0.1:{ports['http']}", args.arch, w, args.seed)
        placement = None if args.mock else gpu_placement()
    finally:
        if poller is not None:
            poller.stop()
        serve.terminate()
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
    start, end = t0 - poller.t0, t1 - poller.t0
    summary, ttft, itl = attainment(run.results, (args.targets[0] / 1e3, args.targets[1] / 1e3))
    gpu_s = held_seconds(poller.samples, start, end)
    held = [s["gpus_held"] for s in poller.samples if start <= s["t_s"] <= end]
    starts = sum(max(0, b["gpus_held"] - a["gpus_held"]) for a, b in zip(poller.samples, poller.samples[1:])
                 if start <= b["t_s"] <= end)
    tokens = sum(r.num_output_tokens for r in run.results if r.error is None)
    changes, last = [], None
    for s in poller.samples:
        now = {p: v["ready"] + v["starting"] for p, v in s["pools"].items()}
        if now != last:
            changes.append({"t_s": round(s["t_s"] - start, 1), **now})
            last = now
    with open(out / f"timeline_{tag}.jsonl", "w") as f:
        for s in poller.samples:
            f.write(json.dumps({**s, "t_s": round(s["t_s"] - start, 2)}) + "\n")
    np.savez_compressed(out / f"requests_{tag}.npz", arrival_s=w.arrival_s, prompt=w.prompt, output=w.output,
                        ttft_s=ttft, itl_s=itl)
    record = {"bench": "planner_live", "git_sha": os.environ.get("SPLITSERVE_GIT_SHA") or git_sha(),
              "device": "mock (CPU)" if args.mock else (placement and _device_name()), "gpus": args.gpus,
              "config": tag, "arch": args.arch, "label": args.label,
              "trace": Path(args.trace).name, "start_s": args.start_s, "trace_seconds": args.trace_seconds,
              "speedup": args.speedup, "requests": len(w), "replay_s": round(end - start, 1),
              "targets_ms": list(args.targets), "profile": args.profile, "serve_argv": [token_free(a, token) for a in argv[4:]],
              "start_to_ready_s": ready_s, **summary,
              "gpu_seconds": round(gpu_s, 1), "gpu_hours": round(gpu_s / 3600, 4),
              "mean_gpus": round(gpu_s / max(end - start, 1e-9), 3), "max_gpus": max(held, default=None),
              "gpus_added": starts, "pool_changes": changes, "output_tok_s": round(tokens / max(end - start, 1e-9), 1),
              "status_misses": poller.errors, "client_lag_p99_ms": _lag_p99_ms(run),
              "nvidia_smi_memory_used": placement, "serve_exit": serve.returncode,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    line = json.dumps(record)
    print(line, flush=True)
    with open(out / "planner_live.jsonl", "a") as f:
        f.write(line + "\n")
    return 0


def token_free(arg: str, token: str) -> str:
    return "<admin token>" if arg == token else arg


def _device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _lag_p99_ms(run) -> float | None:
    lag = getattr(run, "loop_lag_s", None)
    return round(float(np.percentile(lag, 99)) * 1e3, 2) if lag else None


if __name__ == "__main__":
    sys.exit(main())
