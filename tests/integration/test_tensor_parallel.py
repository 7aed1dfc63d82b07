"""Workers that span several GPUs' worth of ranks, on real `splitserve serve` clusters (tiny models,
CPU, gloo between ranks, real Redis, gRPC and NIXL):

- disaggregated serving between workers of different tensor-parallel sizes (prefill TP=1 -> decode
  TP=2 on llama, TP=2 -> TP=1 on qwen2): each rank pushes only its heads, and the greedy tokens are
  HF transformers' own;
- aggregated TP=2 workers stream HF's tokens, and kill -9 of one worker's rank 1 takes that worker
  down at once: its requests continue on the other worker, the controller restarts it;
- placement: with a driver that reports two GPUs (a stand-in nvidia-smi: this machine has none),
  each worker gets its own GPU, `workers list`, `pools status` and /health show which, and a third
  worker is not started on a GPU that is taken.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat

import httpx
import pytest

pytest.importorskip("nixl")

from runtime.redis_embedded import EmbeddedRedis  # noqa: E402
from splitserve.models import cache_dir  # noqa: E402
from tests.integration.cluster import assert_clean_log, own_cluster, start_cluster, metric, until  # noqa: E402
from tests.integration.streams import complete_all, failures, prompts, stream_all  # noqa: E402
from tests.integration.test_disagg import parity_prompts  # noqa: E402

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
MODEL_DIRS = {"tiny": "tiny-llama-seed0", "tiny-qwen2": "tiny-qwen2-seed0"}     # under cache_dir()/models


def hf_greedy(model: str, prompt_list: list[list[int]], new_tokens: int) -> list[list[int]]:
    transformers = pytest.importorskip("transformers")
    import torch
    hf = transformers.AutoModelForCausalLM.from_pretrained(cache_dir() / "models" / model,
                                                           dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for p in prompt_list:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("model,prefill_tp,decode_tp", [("tiny", 1, 2), ("tiny-qwen2", 2, 1)])
def test_disaggregated_between_tp_sizes_streams_hf_tokens(model, prefill_tp, decode_tp):
    with own_cluster("--model", model, "--model-name", "tiny", "--prefill-workers", "1", "--decode-workers", "1",
                     "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
                     "--remote-prefill-min-tokens", "1", "--max-num-batched-tokens", "64") as c:
        got = asyncio.run(complete_all(c.url, parity_prompts(), NEW_TOKENS))
        assert metric(c.url, "splitserve_kv_handoffs_total") >= 8
        assert metric(c.url, "splitserve_prefill_fallback_total") == 0
        assert metric(c.url, "splitserve_kv_transfer_bytes_total") > 0
        assert {w.tensor_parallel_size for w in c.workers()} == {prefill_tp, decode_tp}
        c.wait_idle()
        assert_clean_log(c.log())
    assert got == hf_greedy(MODEL_DIRS[model], parity_prompts(), NEW_TOKENS)


PROMPTS = prompts(12, seed=5)
MAX_TOKENS = 24


def test_a_killed_rank_takes_its_worker_down_and_it_is_restarted(tmp_path):
    with own_cluster("--prefill-workers", "0", "--decode-workers", "2", "--tensor-parallel-size", "2",
                     "--max-num-batched-tokens", "64", "--lease-ttl-s", "2", tmp_dir=tmp_path) as c:
        until(lambda: len(c.workers()) == 2, 60, 0.2, "two workers")
        reference = asyncio.run(stream_all(c.url, PROMPTS, MAX_TOKENS))
        assert failures(reference, MAX_TOKENS) == []
        assert [s.tokens for s in reference] == hf_greedy(MODEL_DIRS["tiny"], PROMPTS, MAX_TOKENS)
        victim = min(c.workers(), key=lambda w: w.name)
        (worker_pid,) = c.child_pids(f"/{victim.name}.json")
        (rank_pid,) = [p for p in children(worker_pid) if "engine.parallel.rank_main" in cmdline(p)]

        async def during():
            await asyncio.sleep(1.0)           # streams are running on both workers
            os.kill(rank_pid, signal.SIGKILL)
        streams = asyncio.run(stream_all(c.url, PROMPTS, MAX_TOKENS, during=during))
        assert failures(streams, MAX_TOKENS) == [] and [s.tokens for s in streams] == [s.tokens for s in reference]
        until(lambda: restarted(c, victim), 90, 0.3, "the worker restarted and ready")
        log = c.log()
        assert (f"tensor-parallel rank 1 of {victim.name} was killed by SIGKILL: stopping the worker (exit code 3)"
                in log)
        assert f"{victim.name} exit code 3" in log and "restarting it in" in log
        assert metric(c.url, "splitserve_worker_restarts_total", pool="decode") == 1


def restarted(c, victim) -> bool:
    row = [line for line in c.cli("workers", "list").stdout.splitlines()[1:] if f" {victim.name} " in line]
    return bool(row) and " ready " in row[0] and " 1 " in row[0] and victim.worker_id not in row[0]


def children(pid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(p))
            except (OSError, ValueError, IndexError):
                pass
    return out


def cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture
def two_gpu_driver(tmp_path):
    """An environment whose nvidia-smi reports two H100s. The workers' engines still run on the
    CPU (--device auto finds no CUDA), so what is checked is the placement's plumbing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0, GPU-0000, NVIDIA H100 80GB HBM3, 81559\\n"
                   "1, GPU-0001, NVIDIA H100 80GB HBM3, 81559\\n'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}


def test_each_worker_gets_its_own_gpu_and_the_cluster_shows_which(tmp_path, two_gpu_driver):
    with EmbeddedRedis() as redis:
        c = start_cluster(tmp_path, "--device", "auto", "--prefill-workers", "0", "--decode-workers", "2",
                          redis_url=redis.url, env=two_gpu_driver, min_workers=2)
        try:
            check_placement(c)
        finally:
            assert c.stop() == 0


def check_placement(c) -> None:
    """Each worker on its own GPU, shown everywhere; no third one on a taken GPU."""
    until(lambda: len(c.workers()) == 2, 60, 0.2, "two workers")
    assert sorted(w.gpus for w in c.workers()) == ["0", "1"]
    health = httpx.get(f"{c.url}/health", timeout=5).json()
    assert sorted(health["worker_gpus"].values()) == ["0", "1"]
    listed = c.cli("workers", "list").stdout
    assert listed.splitlines()[0].split()[4] == "GPUS"
    assert sorted(line.split()[4] for line in listed.splitlines()[1:]) == ["0", "1"]
    assert "GPUS" in c.cli("pools", "status").stdout
    c.cli("pools", "scale", "--decode", "3")          # no GPU is free for a third worker
    until(lambda: "cannot start another decode worker: a worker needs 1 GPU; 0 of the 2 GPUs" in c.log(), 20, 0.2,
          "the refused start in the log")
    assert len(c.workers()) == 2
    c.cli("pools", "scale", "--decode", "2")
