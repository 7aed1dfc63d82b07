"""Where `serve` puts its workers on a host with GPUs: each pool's TP size, one worker's GPUs never
another's unless asked, and starting sizes the inventory cannot hold refused before anything starts,
naming what they need and what there is (through the real `splitserve serve` command line, with
a stand-in for nvidia-smi on PATH: this machine has no GPU)."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pools.book import PoolName
from runtime.config import ServeConfig
from runtime.errors import InvalidRequest
from runtime.gpus import parse_query
from splitserve.cli import build_parser, component_config
from splitserve.placement import plan_placement, pool_tp, ray_worker_gpus

ROOT = Path(__file__).resolve().parents[3]
FOUR = parse_query("\n".join(f"{i}, GPU-{i:04d}, NVIDIA H100 80GB HBM3, 81559" for i in range(4)))


def serve_cfg(*argv: str) -> ServeConfig:
    return component_config(build_parser().parse_args(["serve", *argv]))


def test_each_pool_spans_its_tp_and_the_workers_fit_the_inventory():
    cfg = serve_cfg("--device", "cuda", "--prefill-workers", "1", "--decode-workers", "1", "--decode-tp", "2")
    assert (pool_tp(cfg, "prefill"), pool_tp(cfg, "decode")) == (1, 2)
    placement = plan_placement(cfg, FOUR)
    assert placement.gpus_per_worker == {PoolName.PREFILL: 1, PoolName.DECODE: 2}
    assert placement.take(PoolName.DECODE).gpus == (0, 1) and placement.take(PoolName.PREFILL).gpus == (2,)


def test_an_oversubscribed_inventory_is_refused_naming_both_numbers():
    cfg = serve_cfg("--device", "cuda", "--prefill-workers", "1", "--decode-workers", "2", "--tensor-parallel-size", "2")
    with pytest.raises(InvalidRequest, match=r"the workers need 6 GPUs \(1 x 2 \+ 2 x 2\); the inventory holds 4 "
                                             r"\(0,1,2,3\)"):
        plan_placement(cfg, FOUR)
    with pytest.raises(InvalidRequest, match=r"need 3 GPUs \(1 x 1 \+ 2 x 1\); the inventory holds 2 \(1,3\)"):
        plan_placement(serve_cfg("--device", "cuda", "--decode-workers", "2", "--gpus", "1,3"), FOUR)
    # sharing on purpose: three half-GPU workers fit two GPUs
    assert plan_placement(serve_cfg("--device", "cuda", "--decode-workers", "2", "--gpus-per-worker", "0.5",
                                    "--gpus", "1,3"), FOUR) is not None


def test_a_cpu_run_and_gpus_per_worker_0_place_nothing():
    assert plan_placement(serve_cfg("--device", "cpu", "--decode-workers", "9"), FOUR) is None
    assert plan_placement(serve_cfg("--device", "auto"), []) is None              # no GPU: the CPU
    assert plan_placement(serve_cfg("--mock", "--decode-workers", "9"), FOUR) is None
    assert plan_placement(serve_cfg("--device", "cuda", "--decode-workers", "9", "--gpus-per-worker", "0"),
                          FOUR) is None
    with pytest.raises(InvalidRequest, match=r"--gpus-per-worker must lie in \[0, 1\]"):
        plan_placement(serve_cfg("--device", "cuda", "--gpus-per-worker", "2"), FOUR)
    with pytest.raises(InvalidRequest, match="nvidia-smi shows no GPU"):
        plan_placement(serve_cfg("--device", "cuda"), [])


def test_ray_actors_ask_for_the_gpus_their_worker_spans():
    cfg = serve_cfg("--device", "cuda", "--prefill-tp", "2", "--decode-tp", "4")
    assert (ray_worker_gpus(cfg, "prefill", lambda: True), ray_worker_gpus(cfg, "decode", lambda: True)) == (2.0, 4.0)
    assert ray_worker_gpus(dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, worker_gpus=0.5)),
                           "decode", lambda: True) == 0.5
    assert ray_worker_gpus(serve_cfg("--device", "auto"), "decode", lambda: False) == 0.0


@pytest.fixture
def fake_driver(tmp_path):
    """A PATH whose nvidia-smi reports four H100s (the driver's query, nothing else)."""
    smi = tmp_path / "nvidia-smi"
    rows = "\\n".join(f"{i}, GPU-{i:04d}, NVIDIA H100 80GB HBM3, 81559" for i in range(4))
    smi.write_text(f"#!/bin/sh\nprintf '{rows}\\n'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return {**env, "PATH": f"{tmp_path}{os.pathsep}{env.get('PATH', '')}"}


def serve_cli(env, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve", "serve", "--admin-port", "0", *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_serve_refuses_more_gpus_than_the_host_has_before_starting_anything(fake_driver):
    # --device auto: the (stand-in) driver shows GPUs, so the workers are placed on them; --device cuda
    # would be refused first on this machine's CPU build of torch (runtime/host_checks.py)
    r = serve_cli(fake_driver, "--device", "auto", "--prefill-workers", "1", "--decode-workers", "2",
                  "--decode-tp", "2")
    assert r.returncode == 2
    assert ("splitserve serve: the workers need 5 GPUs (1 x 1 + 2 x 2); the inventory holds 4 (0,1,2,3): start "
            "fewer workers, a smaller TP, or share GPUs with --gpus-per-worker") in r.stderr
    r = serve_cli(fake_driver, "--device", "auto", "--gpus", "0,5")
    assert r.returncode == 2 and "--gpus 0,5: GPU 5 is not on this host (visible GPUs: 0,1,2,3)" in r.stderr
    r = serve_cli(fake_driver, "--device", "auto", "--tensor-parallel-size", "4", "--prefill-workers", "0")
    assert r.returncode == 2 and "num_key_value_heads (2) is not divisible by --tensor-parallel-size 4" in r.stderr
