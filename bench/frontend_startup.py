"""Frontend start-to-ready: process start to the first /health 200 with one mock worker present.

Starts an embedded Redis and one mock decode worker, then N times: spawn `splitserve frontend`,
poll /health every 5 ms until it says 200, record the wall time, stop it. Prints one JSON line.
Also reports whether torch was imported by the frontend process (read from /proc/<pid>/maps).
"""
from __future__ import annotations

import argparse, json, os, platform, signal, statistics, subprocess, sys, time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from runtime.redis_embedded import EmbeddedRedis, free_port  # noqa: E402


def wait_worker(redis_url: str, timeout_s: float = 120) -> None:
    import redis
    c = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    # the lease appears as "starting" before the model loads; wait for "ready"
    while not any(b'"state": "ready"' in (c.get(k) or b"") for k in c.scan_iter(match="splitserve:worker:*")):
        if time.monotonic() > deadline:
            raise SystemExit("the mock worker did not register")
        time.sleep(0.1)


def torch_loaded(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    py = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with EmbeddedRedis() as r:
        worker = subprocess.Popen([py, "-m", "splitserve", "decode-worker", "--mock", "--redis-url", r.url,
                                   "--role", "aggregated", "--model", "tiny"], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_worker(r.url)
            times, torch_seen = [], []
            for _ in range(a.runs):
                port = free_port()
                t0 = time.perf_counter()
                fe = subprocess.Popen([py, "-m", "splitserve", "frontend", "--redis-url", r.url, "--model", "tiny",
                                       "--http-port", str(port), "--grpc-port", str(free_port())], cwd=ROOT,
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                try:
                    while True:
                        try:
                            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        if fe.poll() is not None:
                            raise SystemExit(f"frontend exited with {fe.returncode}")
                        time.sleep(0.005)
                    times.append(time.perf_counter() - t0)
                    torch_seen.append(torch_loaded(fe.pid))
                finally:
                    fe.send_signal(signal.SIGTERM)
                    fe.wait(30)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(json.dumps({"bench": "frontend_startup", "git_sha": sha, "label": a.label, "runs": a.runs,
                      "start_to_ready_s_median": round(statistics.median(times), 3),
                      "start_to_ready_s": [round(t, 3) for t in times], "torch_imported": any(torch_seen),
                      "machine": f"{platform.machine()} {os.cpu_count()} cpus", "load_avg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
