"""Does computing prompt logprobs cost the requests that do not ask? `bench serve` against this tree
and a baseline tree (a commit before prompt logprobs), in alternating rounds in one run.

    python bench/prompt_logprobs_cost.py --base-ref a6c9c61 [--rounds 5 --isl 256 --osl 32 --concurrency 4]

Each round starts `splitserve serve` (tiny model, CPU, aggregated, one worker) from the baseline
source (a `git archive` of --base-ref) and then from this tree, and drives each with the same
`splitserve bench serve` load of requests that ask for no prompt logprobs (this tree's client, so the
load is identical). A last round on this tree sends the same load with `echo` + `logprobs: 1` and
`max_tokens` as before, to show what asking costs. Prints one JSON line per measurement and a
summary with the median output tok/s of each side and the median of the rounds' ratios (this / base).
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
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode:
                raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
            rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            return next(r for r in rows if r.get("bench") == "serve")
    finally:
        cluster_mod.ROOT = old_root
        if env_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_path


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
    for r in range(args.rounds):
        for side, root in (("base", base), ("this", ROOT)):
            s = serve_load(root, args)
            tok_s[side].append(s["output_tok_s"])
            print(json.dumps({**common, "round": r, "side": side, "output_tok_s": round(s["output_tok_s"], 1),
                              "ttft_p50_s": s["ttft_p50_s"], "itl_p50_s": s["itl_p50_s"], "errors": s["errors"]}),
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
                      "this_over_base": round(statistics.median(ratios), 3),
                      "asking_over_this": round(asking["output_tok_s"] / med["this"], 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
