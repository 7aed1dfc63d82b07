"""Where `splitserve serve` put its workers: each worker's GPUs as its lease says, and as the driver
sees them (nvidia-smi: memory used per GPU, which process holds which GPU).

    python bench/device/placement_check.py --out OUT [--arch llama-3.1-8b] [-- SERVE FLAGS...]
    python bench/device/placement_check.py --out OUT --model tiny -- --device cpu   # the plumbing, no GPU

Starts a cluster (default flags: `--decode-workers 2 --prefill-workers 0 --device cuda`, the
architecture's random weights and the tiny model's tokenizer), waits until it is ready (start-to-
ready timed), sends a few completions, reads `workers list --json` and /health, saves nvidia-smi's
view to OUT/placement-nvidia-smi.txt, stops the cluster and prints one JSON line: per worker its
GPUs and pid, per GPU the workers whose processes hold it, and whether every worker is on GPUs of
its own (`one_worker_per_gpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from splitserve.bench.records import git_sha  # noqa: E402

DEFAULT_SERVE = ["--decode-workers", "2", "--prefill-workers", "0", "--device", "cuda"]
SMI_GPUS = ["nvidia-smi", "--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"]
SMI_APPS = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]


def smi(argv: list[str]) -> str | None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def model_dir(args) -> tuple[str, list[str]]:
    """The model to serve and the flags that load it."""
    from splitserve.models import resolve_model
    if args.model:
        return resolve_model(args.model), []
    from engine.loader import write_arch_dir
    tiny = Path(resolve_model("tiny"))
    model = write_arch_dir(args.arch, Path(tempfile.mkdtemp()) / args.arch)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, model / f)
    return str(model), ["--load-format", "dummy"]


def gpu_holders(workers: list[dict], apps: str | None, gpus: str | None) -> dict[str, list[str]]:
    """GPU index -> the workers (by name) whose process tree holds memory on it."""
    if not apps or not gpus:
        return {}
    index_of = {row.split(",")[1].strip(): row.split(",")[0].strip() for row in gpus.strip().splitlines()}
    out: dict[str, list[str]] = {}
    for row in apps.strip().splitlines():
        pid, uuid = (x.strip() for x in row.split(",")[:2])
        owner = next((w["name"] for w in workers if int(pid) in w["pids"]), f"pid {pid}")
        out.setdefault(index_of.get(uuid, uuid), []).append(owner)
    return out


def tree(pid: int) -> set[int]:
    """`pid` and its descendants (a worker and its tensor-parallel ranks)."""
    kids: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(p))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += kids.get(p, [])
    return out


def worker_pids(serve_pid: int) -> dict[str, set[int]]:
    """Worker name -> its process tree (a worker's command line names its config file NAME.json)."""
    out = {}
    for pid in tree(serve_pid):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        m = re.search(r"-worker --config \S+/([\w-]+)\.json", cmd)
        if m:
            out[m.group(1)] = tree(pid)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--model", default=None, help="an HF directory or tiny, instead of --arch's random weights")
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("serve", nargs="*", help="flags for splitserve serve (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, load = model_dir(args)
    flags = args.serve or DEFAULT_SERVE
    log_path = out / "placement-serve.log"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        serve = subprocess.Popen([sys.executable, "-m", "splitserve", "serve", "--model", model, *load,
                                  "--model-name", "m", "--http-port", str(args.port), "--admin-port", "0", *flags],
                                 cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    record = {"bench": "placement", "git_sha": git_sha(), "serve_flags": flags, "model": args.model or args.arch}
    try:
        while "Splitserve is ready" not in log_path.read_text(errors="replace"):
            if serve.poll() is not None or time.monotonic() - t0 > 480:
                record["error"] = "the cluster did not start: " + log_path.read_text(errors="replace")[-800:]
                print(json.dumps(record), flush=True)
                return 1
            time.sleep(0.5)
        record["start_to_ready_s"] = round(time.monotonic() - t0, 1)
        url = f"http://127.0.0.1:{args.port}"
        ok = sum(httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": [11, 12, 13] * 10,
                                                           "max_tokens": 8}, timeout=120).status_code == 200
                 for _ in range(4))
        admin = re.search(r"Admin +(\S+)", log_path.read_text()).group(1)
        listed = subprocess.run([sys.executable, "-m", "splitserve", "workers", "list", "--json", "--admin-url", admin],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        pids = worker_pids(serve.pid)
        workers = [{"name": w.get("name"), "worker_id": w.get("workerId") or w.get("worker_id"),
                    "gpus": w.get("gpus", ""), "tensor_parallel_size": w.get("tensorParallelSize") or
                    w.get("tensor_parallel_size"), "pids": sorted(pids.get(w.get("name"), ()))}
                   for w in json.loads(listed.stdout or "[]")]
        gpus_text, apps_text = smi(SMI_GPUS), smi(SMI_APPS)
        (out / "placement-nvidia-smi.txt").write_text(f"{smi(['nvidia-smi'])}\n{gpus_text}\n{apps_text}\n")
        holders = gpu_holders(workers, apps_text, gpus_text)
        given = [g for w in workers for g in w["gpus"].split(",") if g]
        record.update(completions_ok=ok, workers=workers, health_worker_gpus=httpx.get(f"{url}/health").json().get(
            "worker_gpus"), gpu_memory=gpus_text, gpu_holders=holders,
            one_worker_per_gpu=bool(given) and len(given) == len(set(given)) and
            all(len(set(v)) == 1 for v in holders.values()))
        print(json.dumps(record), flush=True)
        return 0 if ok == 4 else 1
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()


if __name__ == "__main__":
    raise SystemExit(main())
