"""`splitserve bench replay` end to end: real Redis, mock workers, the real frontend and router.

A short, prefix-heavy slice (multi-turn conversations whose later turns extend earlier ones) is
replayed on 3 mock workers with a fast timing profile under kv and round_robin. The run must
finish without errors, print its JSON summary last, and kv must reuse more of the prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def write_trace(path: Path) -> None:
    """8 conversations x 5 turns, interleaved; turn k's prompt is turn k-1's plus one block."""
    lines = []
    t = 0
    for turn in range(5):
        for conv in range(8):
            ids = [conv * 100 + b for b in range(2 + turn)]
            lines.append({"timestamp": t, "input_length": 512 * len(ids) - 100, "output_length": 8,
                          "hash_ids": ids})
            t += 50
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_replay_kv_beats_round_robin_on_prefix_reuse(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    profile = tmp_path / "fast.json"   # an H100 curve 10x faster: the test is about routing
    profile.write_text(json.dumps({"curve": {"base_s": 7e-4, "per_token_s": 4e-6,
                                             "per_attn_pair_s": 1.3e-10, "per_kv_token_s": 4.4e-9}}))
    out = tmp_path / "results.jsonl"
    env = dict(os.environ, SPLITSERVE_CACHE=os.environ.get("SPLITSERVE_CACHE", str(tmp_path / "cache")))
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve", "bench", "replay", "--trace", str(trace), "--workers", "3",
         "--policy", "kv,round_robin", "--limit", "40", "--speedup", "1", "--mock-profile", str(profile),
         "--output", str(out), "--plot", str(tmp_path / "ttft.png"), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    runs = {r["policy"]: r for r in map(json.loads, lines[:-1])}
    assert summary["bench"] == "replay_summary" and summary["policy"] == ["kv", "round_robin"]
    for policy, r in runs.items():
        for key in ("requests", "prefix_hit_rate", "oracle_share", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                    "itl_p50_s", "output_tok_s", "max_over_mean_load"):
            assert r[key] is not None, (policy, key)
            assert summary[key][policy] == r[key]
        assert r["requests"] == 40 and r["errors"] == 0 and r["token_mismatches"] == 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"] < 30
        assert r["output_tokens"] == 40 * 8
        assert 1.0 <= r["max_over_mean_load"] < 3.0
        assert sum(r["worker_prompt_tokens"].values()) == r["input_tokens"]
        # the pooled-cache oracle of the same prompts, and the policy's share of it
        assert r["oracle_hit_rate"] > 0.5
        assert r["oracle_share"] == round(r["prefix_hit_rate"] / r["oracle_hit_rate"], 3)
    # 8 conversations over 3 workers: kv keeps each conversation where its history is
    assert runs["kv"]["prefix_hit_rate"] > 0.5
    assert runs["kv"]["prefix_hit_rate"] > runs["round_robin"]["prefix_hit_rate"] + 0.15
    assert len(out.read_text().splitlines()) == 3
    assert (tmp_path / "ttft.png").stat().st_size > 1000
