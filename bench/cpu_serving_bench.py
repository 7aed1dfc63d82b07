"""Tokens/s of the whole serving path on this CPU machine, next to HF transformers `generate`.

    python bench/cpu_serving_bench.py [--isl 128 --osl 64 --concurrency 1,8,32 --model tiny]

Starts `splitserve serve` (aggregated: one worker, so the comparison is one engine against one
`generate`), drives it with `splitserve bench serve` over HTTP at each concurrency, then runs HF
`generate` on the same model directory with batch = concurrency (greedy, same prompt/output
lengths, float32) in this process. Prints one JSON line per concurrency with both figures and
their ratio, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splitserve.bench.records import git_sha  # noqa: E402
from splitserve.models import resolve_model  # noqa: E402
from tests.integration.cluster import own_cluster  # noqa: E402


def hf_tokens_per_s(model_dir: str, batch: int, isl: int, osl: int, seed: int) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 4000, (batch, isl), generator=g)
    gc = GenerationConfig(max_new_tokens=osl, min_new_tokens=osl, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :16], generation_config=GenerationConfig(max_new_tokens=2, do_sample=False,
                                                                          pad_token_id=0))  # warm-up
        t = time.perf_counter()
        out = model.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
        elapsed = time.perf_counter() - t
    assert out.shape[1] == isl + osl
    return batch * osl / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    model_dir = resolve_model(args.model)
    common = {"bench": "cpu_serving", "git_sha": git_sha(), "device": f"cpu ({os.cpu_count()} cores, "
              f"{platform.machine()})", "model": args.model, "isl": args.isl, "osl": args.osl,
              "torch_threads": torch.get_num_threads()}
    with own_cluster("--model", args.model, "--prefill-workers", "0", "--decode-workers", "1") as c:
        proc = subprocess.run(
            [sys.executable, "-m", "splitserve", "bench", "serve", "--url", c.url, "--isl", str(args.isl),
             "--osl", str(args.osl), "--concurrency", args.concurrency, "--seed", str(args.seed),
             "--no-progress"], capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
            return 1
        serve_levels = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")
                        and json.loads(l).get("bench") == "serve"]
    rows = []
    for level in serve_levels:
        c = level["concurrency"]
        hf = hf_tokens_per_s(model_dir, c, args.isl, args.osl, args.seed)
        row = {**common, "concurrency": c, "splitserve_output_tok_s": round(level["output_tok_s"], 1),
               "splitserve_ttft_p50_s": level["ttft_p50_s"], "splitserve_itl_p50_s": level["itl_p50_s"],
               "hf_generate_tok_s": round(hf, 1), "ratio": round(level["output_tok_s"] / hf, 2),
               "errors": level["errors"], "requests": level["requests"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({**common, "bench": "cpu_serving_summary",
                      "ratios": {r["concurrency"]: r["ratio"] for r in rows}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
