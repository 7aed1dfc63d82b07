"""The goodput study on one host with N GPUs: aggregated serving against every prefill/decode split,
per workload and latency-target pair, measured by `splitserve bench goodput`.

    python bench/device/goodput_study.py --gpus 2 --configs all --workloads 8k256 --targets tight --out $OUT
    bench/device/run.sh goodput        # the same through run.sh: GOODPUT_ARGS="--gpus 4 --configs 2p2d ..."
    python bench/device/goodput_study.py --mock --gpus 1 --workloads 128/8 --targets loose   # CPU smoke

Configurations (`--configs`, comma-separated, or all): `aggN`, N aggregated workers, and every
`xPyD` with x + y = N, each worker one process on its own GPU (CUDA_VISIBLE_DEVICES: prefill workers
on the first GPUs, then decode workers; the study's GPUs are those its own CUDA_VISIBLE_DEVICES
lists, else 0..N-1, so two studies can share a host). It starts what `serve` would, by hand: an
embedded Redis, each worker (`splitserve prefill-worker|decode-worker`, random bf16
weights of --arch, `--load-format dummy`, the tiny model's tokenizer) and a frontend. The workers of
a configuration stay up for all its runs; the frontend is started per target pair, with
`--itl-target-ms` set to the pair's ITL target (unless --itl-guard off), so that a saturated
prefill worker never sends a long prompt back to a decode worker whose ITL it would break
(--frontend-args adds flags such as `--itl-guard-mode budget --decode-profile P`; --worker-args
the workers').

Workloads (`--workloads`): 1k1k (1024 in / 1024 out), 8k256, 3k150, azure (the lengths of the Azure
LLM conversation trace: --azure-trace FILE), or any ISL/OSL such as 128/8. Targets (`--targets`):
loose (TTFT 2 s, ITL 50 ms) and tight (TTFT 1 s, ITL 15 ms); ITL is each request's mean
(splitserve/bench/goodput.py). Every run appends bench goodput's JSON lines (one per rate tried,
then the result with goodput_req_s_per_gpu) to OUT/goodput_study.jsonl, with the configuration in
its label, and a `goodput_study_run` line with the cluster's prefill counters (remote, local by
reason, held for the ITL target) and the ERROR lines and tracebacks of its logs; a plot per run.

Time: the whole call ends before --budget-s (default 540: one 9-minute device call). The runs
left share what remains after each cluster is up, and each goodput search gets its share as
--time-budget-s; a run whose share is under --min-run-s is not started but written as
`goodput_study_skipped`, to be run in a later call (pass the subset with --configs, --workloads and
--targets). --dry-run prints the plan and the commands without starting anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "device"))

from serve_e2e import log_findings, parse_counters  # noqa: E402

TARGETS = {"loose": (2000.0, 50.0), "tight": (1000.0, 15.0)}        # (TTFT ms, ITL ms)
WORKLOADS = {"1k1k": (1024, 1024), "8k256": (8192, 256), "3k150": (3072, 150)}
STOP_MARGIN_S = 45.0          # kept back from the budget to stop the last cluster
START_TIMEOUT_S = 400.0


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    prefill: int
    decode: int                # aggregated workers when prefill == 0

    def roles(self) -> list[str]:
        """One role per GPU, in GPU order."""
        decode = "decode" if self.prefill else "aggregated"
        return ["prefill"] * self.prefill + [decode] * self.decode


def all_configs(gpus: int) -> list[Config]:
    return [Config(f"agg{gpus}", 0, gpus)] + [Config(f"{x}p{gpus - x}d", x, gpus - x) for x in range(1, gpus)]


def pick(names: str, known: dict, what: str) -> list:
    if names == "all":
        return list(known.values())
    out = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in known:
            raise SystemExit(f"--{what}: unknown {name!r}; choose from {', '.join(known)} or all")
        out.append(known[name])
    return out


def workload_flags(name: str, azure_trace: str | None) -> list[str]:
    if name == "azure":
        if not azure_trace or not Path(azure_trace).is_file():
            raise SystemExit("--workloads azure needs --azure-trace FILE (azure_llm_2023_conv.csv)")
        return ["--trace", azure_trace]
    if name in WORKLOADS:
        isl, osl = WORKLOADS[name]
    else:
        try:
            isl, osl = (int(x) for x in name.split("/"))
        except ValueError:
            raise SystemExit(f"--workloads: {name!r} is none of {', '.join([*WORKLOADS, 'azure'])} nor "
                             "ISL/OSL such as 128/8") from None
    return ["--isl", str(isl), "--osl", str(osl)]


# ---------------------------------------------------------------------------------------------
# One configuration's cluster, started by hand


class Cluster:
    """An embedded Redis, the configuration's workers, and (per target pair) a frontend."""

    def __init__(self, cfg: Config, args: argparse.Namespace, model: str, out: Path) -> None:
        from runtime.redis_embedded import EmbeddedRedis
        self.cfg, self.args, self.model, self.out = cfg, args, model, out
        self.redis = EmbeddedRedis()
        self.port = 0
        self.frontend: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def _spawn(self, name: str, argv: list[str], gpu: int | None) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
        if gpu is not None:     # the gpu-th of the GPUs this study may use (all, or its CUDA_VISIBLE_DEVICES)
            visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            env["CUDA_VISIBLE_DEVICES"] = visible[gpu] if gpu < len(visible) else str(gpu)
        log = self.out / f"{self.cfg.name}_{name}.log"
        self.logs.append(log)
        with open(log, "ab") as f:
            return subprocess.Popen([sys.executable, "-m", "splitserve", *argv], cwd=ROOT, env=env, stdout=f,
                                    stderr=subprocess.STDOUT)

    def worker_argv(self, role: str, index: int) -> list[str]:
        a = self.args
        command = "prefill-worker" if role == "prefill" else "decode-worker"
        argv = [command, "--model", self.model, "--redis-url", self.redis.url, "--worker-id", f"{role}-{index}"]
        argv += ["--role", role] if role != "prefill" else []
        argv += ["--mock", "--device", "cpu"] if a.mock else ["--device", a.device]
        argv += ["--load-format", "dummy"] if a.device == "cuda" and not a.mock else []
        return argv + shlex.split(" ".join(a.worker_args))

    def frontend_argv(self, itl_ms: float) -> list[str]:
        from runtime.redis_embedded import free_port
        argv = ["frontend", "--model", self.model, "--redis-url", self.redis.url, "--http-port", str(self.port),
                "--grpc-port", str(free_port())]
        argv += ["--itl-target-ms", f"{itl_ms:g}"] if self.args.itl_guard == "on" and self.cfg.prefill else []
        if self.args.mock:
            from perf.profile import DEFAULT_MAX_MODEL_LEN     # the mock's context, as `serve --mock` sets it
            argv += ["--max-model-len", str(DEFAULT_MAX_MODEL_LEN)]
        return argv + shlex.split(" ".join(self.args.frontend_args))

    def start_workers(self) -> None:
        for gpu, role in enumerate(self.cfg.roles()):
            self.workers.append(self._spawn(f"{role}-{gpu}", self.worker_argv(role, gpu),
                                            None if self.args.mock or self.args.device == "cpu" else gpu))

    def start_frontend(self, itl_ms: float) -> None:
        from runtime.redis_embedded import free_port
        self.port = free_port()                 # a fresh port: the last frontend's may linger
        self.frontend = self._spawn("frontend", self.frontend_argv(itl_ms), None)
        deadline = time.monotonic() + START_TIMEOUT_S
        want = {"decode": self.cfg.decode, "prefill": self.cfg.prefill}
        while time.monotonic() < deadline:
            dead = [p for p in [self.frontend, *self.workers] if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{self.cfg.name}: a process exited during start-up (logs in {self.out})")
            try:
                body = httpx.get(f"{self.url}/health", timeout=2).json()
                if all(body.get(k, 0) >= n for k, n in want.items()):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.cfg.name}: not healthy within {START_TIMEOUT_S:.0f} s (logs in {self.out})")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop_frontend(self) -> None:
        if self.frontend is not None:
            _stop([self.frontend])
            self.frontend = None

    def close(self) -> None:
        self.stop_frontend()
        _stop(self.workers)
        self.redis.close()


def _stop(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---------------------------------------------------------------------------------------------
# The runs


@dataclass(frozen=True, slots=True)
class Run:
    config: Config
    workload: str
    target: str


def goodput_argv(run: Run, args: argparse.Namespace, url: str, out: Path, budget_s: float) -> list[str]:
    ttft_ms, itl_ms = TARGETS[run.target]
    tag = f"{run.config.name}_{run.workload.replace('/', 'x')}_{run.target}"
    return ["bench", "goodput", "--url", url, "--ttft-ms", f"{ttft_ms:g}", "--itl-ms", f"{itl_ms:g}",
            *workload_flags(run.workload, args.azure_trace), "--gpus", str(args.gpus),
            "--label", f"{args.label} {run.config.name} {model_name(args)} {run.target}".strip(),
            "--duration-s", f"{args.probe_duration_s:g}", "--max-probes", str(args.max_probes),
            "--precision", f"{args.precision:g}", "--start-in-flight", f"{args.start_in_flight:g}",
            *(["--start-rate", f"{args.start_rate:g}"] if args.start_rate else []),
            "--processes", str(args.processes),
            "--min-requests", str(args.min_requests), "--time-budget-s", f"{budget_s:.0f}",
            "--timeout-s", f"{max(budget_s, 30):.0f}", "--seed", str(args.seed), "--no-progress",
            "--output", str(out / "goodput_study.jsonl"), "--plot", str(out / f"goodput_{tag}.png")]


def emit(record: dict, out: Path) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    with open(out / "goodput_study.jsonl", "a") as f:
        f.write(line + "\n")


class Schedule:
    """The call's time, shared by the runs not yet made: what is left after stopping the last
    cluster and starting the clusters still to come (each as long as the slowest start so far)."""

    def __init__(self, budget_s: float, runs: list[Run]) -> None:
        self.deadline = time.monotonic() + budget_s
        self.runs_left = len(runs)
        self.configs_left = len(dict.fromkeys(r.config for r in runs))
        self.start_s = 60.0                 # a cluster's start-up, until one is measured

    def started(self, seconds: float) -> None:
        self.configs_left -= 1
        self.start_s = max(self.start_s if self.configs_left else 0.0, seconds)

    def share_s(self) -> float:
        left = self.deadline - time.monotonic() - STOP_MARGIN_S - self.configs_left * self.start_s
        self.runs_left -= 1
        return left / (self.runs_left + 1)


def run_config(cfg: Config, runs: list[Run], args, model: str, out: Path, schedule: Schedule) -> None:
    cluster = Cluster(cfg, args, model, out)
    try:
        t0 = time.monotonic()
        cluster.start_workers()
        for i, target in enumerate(dict.fromkeys(r.target for r in runs)):
            cluster.start_frontend(TARGETS[target][1])
            if i == 0:
                schedule.started(time.monotonic() - t0)
            for run in (r for r in runs if r.target == target):
                one_run(run, cluster, args, out, schedule.share_s())
            cluster.stop_frontend()
    except RuntimeError as e:
        emit({"bench": "goodput_study_failed", "config": cfg.name, "error": str(e)}, out)
    finally:
        findings = {str(p.name): log_findings(p.read_text(errors="replace")) for p in cluster.logs if p.exists()}
        cluster.close()
        emit({"bench": "goodput_study_logs", "config": cfg.name, "logs": findings}, out)


def one_run(run: Run, cluster: Cluster, args, out: Path, share_s: float) -> None:
    fields = {"config": run.config.name, "workload": run.workload, "target": run.target}
    if share_s < args.min_run_s:
        emit({"bench": "goodput_study_skipped", **fields, "time_left_s": round(share_s, 1)}, out)
        return
    before = _counters(cluster.url)
    try:
        rc = subprocess.call([sys.executable, "-m", "splitserve", *goodput_argv(run, args, cluster.url, out, share_s)],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"},
                             timeout=share_s + 60)
    except subprocess.TimeoutExpired:
        rc = "timeout"                    # the last probe ran long; its lines up to then are written
    after = _counters(cluster.url)
    emit({"bench": "goodput_study_run", **fields, "exit": rc, "budget_s": round(share_s, 1),
          "worker_args": " ".join(args.worker_args), "frontend_args": " ".join(args.frontend_args),
          "counters": {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if "_mean_ms" not in k}}, out)


def _counters(url: str) -> dict:
    try:
        return parse_counters(httpx.get(f"{url}/metrics", timeout=10).text)
    except httpx.HTTPError:
        return {}


def model_name(args: argparse.Namespace) -> str:
    return "tiny mock" if args.mock else "tiny cpu" if args.device == "cpu" else f"{args.arch} random bf16"


def model_dir(args: argparse.Namespace) -> str:
    """The tiny model (CPU, --mock), or --arch's config with random weights and the tiny tokenizer."""
    from splitserve.models import resolve_model
    tiny = Path(resolve_model("tiny"))
    if args.mock or args.device == "cpu":
        return str(tiny)
    from engine.loader import write_arch_dir
    model = write_arch_dir(args.arch, Path(tempfile.mkdtemp()) / args.arch)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, model / f)
    return str(model)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[Run]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2, help="GPUs of this host, one worker each")
    ap.add_argument("--configs", default="all", help="aggN and xPyD names, comma-separated, or all")
    ap.add_argument("--workloads", default="1k1k,8k256,3k150",
                    help="1k1k, 8k256, 3k150, azure (with --azure-trace) or ISL/OSL, comma-separated")
    ap.add_argument("--targets", default="loose,tight", help="loose (TTFT 2 s, ITL 50 ms), tight (1 s, 15 ms)")
    ap.add_argument("--azure-trace", default=None, help="the Azure LLM conversation trace CSV (for azure)")
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--mock", action="store_true", help="the mock engine on the CPU")
    ap.add_argument("--itl-guard", default="on", choices=("on", "off"),
                    help="on: the frontend gets the target pair's --itl-target-ms (splits only)")
    ap.add_argument("--worker-args", action="append", default=[], help="extra worker flags, shell-quoted")
    ap.add_argument("--frontend-args", action="append", default=[],
                    help="extra frontend flags, shell-quoted (e.g. --itl-guard-mode budget --decode-profile P)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole call ends before this")
    ap.add_argument("--min-run-s", type=float, default=90.0, help="a run with less time than this is skipped")
    ap.add_argument("--probe-duration-s", type=float, default=20.0)
    ap.add_argument("--max-probes", type=int, default=8)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--precision", type=float, default=0.15)
    ap.add_argument("--start-in-flight", type=float, default=16.0)
    ap.add_argument("--processes", type=int, default=1,
                    help="bench goodput's client processes (a fast workload's probes outrun one client)")
    ap.add_argument("--start-rate", type=float, default=None,
                    help="the first probe's rate, req/s (default: --start-in-flight over the idle E2E)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--dry-run", action="store_true", help="print the runs and their commands, start nothing")
    args = ap.parse_args(argv)
    if args.gpus < 1:
        raise SystemExit("--gpus must be >= 1")
    configs = pick(args.configs, {c.name: c for c in all_configs(args.gpus)}, "configs")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        workload_flags(w, args.azure_trace)                # a bad name fails here, before any start
    targets = pick(args.targets, {t: t for t in TARGETS}, "targets")
    return args, [Run(c, w, t) for c in configs for t in targets for w in workloads]


def main(argv: list[str] | None = None) -> int:
    args, runs = parse_args(argv)
    schedule = Schedule(args.budget_s, runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        for run in runs:
            print(run.config.name, run.config.roles(), run.workload, run.target,
                  shlex.join(goodput_argv(run, args, "URL", out, args.budget_s / len(runs))))
        return 0
    model = model_dir(args)
    for cfg in dict.fromkeys(r.config for r in runs):
        run_config(cfg, [r for r in runs if r.config == cfg], args, model, out, schedule)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
