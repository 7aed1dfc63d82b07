"""One summary line per stage of bench/device/multi_gpu.sh, from the stage's JSON-line record:

    python bench/device/multi_gpu_summary.py tp RECORD      # TP=2 / TP=1 batch-1 decode per all-reduce, parity
    python bench/device/multi_gpu_summary.py tp70 RECORD    # 70B TP=2 FP8 or TP=4: batch 1 against its roofline

Prints the summary as a JSON line (the stage appends it to the record), with each target and whether
it was met. Reads only what the record holds: a missing measurement is `null` (and so is `met`), never
a guess.
"""

from __future__ import annotations

import json
import sys
import time

TP_SPEEDUP_TARGET = 1.7          # docs/multi_gpu.md: 8B, TP=2 over TP=1, batch-1 decode
TP70_ROOFLINE_TARGET = 0.75      # 70B TP=2 FP8: batch-1 decode over per-GPU weight bytes / HBM bandwidth


def lines(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def b1(records: list[dict], tp: int, all_reduce: str = "nccl") -> dict | None:
    """The batch-1 decode record (graphs, async) at this TP size and all-reduce."""
    for r in records:
        if (r.get("metric") == "decode_batch1" and r.get("tensor_parallel_size", 1) == tp and r.get("cuda_graphs")
                and r.get("async_scheduling") and r.get("tp_all_reduce", "nccl") == all_reduce):
            return r
    return None


ALL_REDUCES = ("nccl", "symm_mem", "flashinfer")


def summary_tp(records: list[dict]) -> dict:
    one = b1(records, 1)
    two = {ar: b1(records, 2, ar) for ar in ALL_REDUCES}
    parity = next((r for r in records if r.get("metric") == "tp_parity"), None)
    ratio = {ar: round(r["tok_s"] / one["tok_s"], 3) if one and r else None for ar, r in two.items()}
    best = max((ar for ar in ALL_REDUCES if ratio[ar] is not None), key=lambda ar: ratio[ar], default=None)
    speedup = ratio[best] if best else None
    return {"metric": "tp_summary", "tp1_tok_s": one and one["tok_s"],
            **{f"tp2_{ar}_tok_s": r and r["tok_s"] for ar, r in two.items()},
            **{f"speedup_{ar}": ratio[ar] for ar in ALL_REDUCES}, "best_all_reduce": best, "speedup": speedup,
            "target": TP_SPEEDUP_TARGET, "met": None if speedup is None else speedup >= TP_SPEEDUP_TARGET,
            "parity_tokens_equal": parity and parity.get("tokens_equal"),
            "parity_max_logits_rel_err": parity and parity.get("max_logits_rel_err")}


def summary_tp70(records: list[dict]) -> dict:
    r = next((x for tp in (2, 4, 8) for ar in ALL_REDUCES if (x := b1(records, tp, ar))), None)
    model = next((x for x in records if x.get("metric") == "model"), {})
    parity = next((x for x in records if x.get("metric") == "tp_parity"), None)
    frac = r and r.get("frac_of_roofline")
    return {"metric": "tp70_summary", "tensor_parallel_size": r and r.get("tensor_parallel_size"),
            "tp_all_reduce": r and r.get("tp_all_reduce"), "quantization": r and r.get("quantization"),
            "tok_s": r and r["tok_s"], "roofline_tok_s": r and r.get("roofline_tok_s"),
            "frac_of_roofline": frac, "target": TP70_ROOFLINE_TARGET,
            "met": None if frac is None else frac >= TP70_ROOFLINE_TARGET,
            "per_gpu_weight_bytes": model.get("decode_weight_bytes"), "load_to_ready_s": model.get("load_and_capture_s"),
            "startup_s": model.get("startup_s"), "parity_tokens_equal": parity and parity.get("tokens_equal")}


def main(argv: list[str]) -> int:
    stage, path = argv[1], argv[2]
    records = lines(path)
    out = {"tp": summary_tp, "tp70": summary_tp70}[stage](records)
    base = next((r for r in records if "git_sha" in r), {})
    print(json.dumps({"bench": "multi_gpu", "git_sha": base.get("git_sha"), "device": base.get("device"), **out,
                      "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
